"""A Sokoban whose worker process dies at random, or hangs once: fault injection for the
asynchronous training run (workers import this module by name)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from pathlib import Path

from turnforge.envs.sokoban import SokobanEnv

_chaos = random.Random(os.getpid() ^ int(time.time() * 1e6))  # unseeded on purpose: a replayed step usually survives


class FaultySokobanEnv(SokobanEnv):
    """``crash_prob``: chance that a step kills its worker process (``os._exit``);
    ``hang_flag``: a file path; the first step that finds it missing creates it and then
    sleeps ``hang_seconds`` (past the pool's step timeout). Faults happen only inside env
    worker processes: the trainer's own envs (BC demos, evaluation) behave."""

    def __init__(self, *, crash_prob: float = 0.05, hang_flag: str | None = None, hang_seconds: float = 30.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.crash_prob, self.hang_flag, self.hang_seconds = crash_prob, hang_flag, hang_seconds

    def step(self, action_text):
        if mp.current_process().name == "MainProcess":
            return super().step(action_text)
        if self.hang_flag and not Path(self.hang_flag).exists():
            Path(self.hang_flag).touch()
            time.sleep(self.hang_seconds)
        if _chaos.random() < self.crash_prob:
            os._exit(17)
        return super().step(action_text)
