"""What keeps a run directory whole, apart from the stages that train in it.

- ``checkpoint``: HF-format model directories and the counters and optimizer state a resume
  needs, written beside the old ones and swapped in (``save_resumable``, ``find_resumable``);
- ``interrupts``: SIGINT/SIGTERM stop at a checkpoint and say how to resume;
- ``failures``: the one rule that stops a stage with too many infrastructure failures.

The layout, the lock and the writer that obeys the rank rule are ``turnforge.runs``; what the
stages of one run share (``Session``) is ``turnforge.train.session``.
"""
