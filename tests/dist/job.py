"""A training run as one rank of torch's launcher, for the scale-out tests:
``python -m torch.distributed.run --standalone --nproc-per-node N job.py OUT STOP_AFTER [key=value ...]``
(``STOP_AFTER`` 0: the whole run; k: stop after k RL iterations, leaving a resumable checkpoint)."""

import sys

from turnforge.app.config import load_config
from turnforge.app.run import train

out, stop, *overrides = sys.argv[1:]
train(load_config("sokoban-tiny", overrides), out, live=False, stop_after=int(stop) or None)
