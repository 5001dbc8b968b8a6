"""Model merging (``turnforge merge``): merge methods as pure tensor functions (``methods``) and
the checkpoint reading, checking and writing around them (``checkpoints``)."""
