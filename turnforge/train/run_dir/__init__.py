"""What keeps a run directory whole, apart from the stages that train in it.

- ``lock``: one process writes a run directory at a time (``RunLock``, ``DIR/.lock``);
- ``checkpoint``: HF-format model directories and the counters and optimizer state a resume
  needs, written beside the old ones and swapped in (``save_resumable``, ``find_resumable``);
- ``interrupts``: SIGINT/SIGTERM stop at a checkpoint and say how to resume;
- ``failures``: the one rule that stops a stage with too many infrastructure failures.

What the stages of one run share (``Session``) is ``turnforge.train.session``.
"""
