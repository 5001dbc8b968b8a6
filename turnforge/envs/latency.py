"""Sokoban with long-tail step latency: the benchmark env for asynchronous rollouts.

Real agent environments (tool calls, code execution, web pages) take variable time per
step, with a long tail. ``SlowSokobanEnv`` is Sokoban whose ``step`` first sleeps a
lognormal delay: ``median_ms * exp(sigma * z)``, ``z ~ N(0, 1)``, capped at ``max_ms``.
With the defaults (median 20 ms, sigma 1.0, cap 1 s) the mean is ~33 ms, the 90th
percentile ~72 ms and the 99th ~205 ms, so a lock-step batch of 32 waits on a slow env at
almost every turn.

The delay is a pure function of the state (task, step count, board), so a step replayed
from a snapshot sleeps exactly as long again, and runs are reproducible. Sleeping does not
use a CPU, like waiting on a remote tool.
"""

from __future__ import annotations

import math
import random
import time

from turnforge.envs.sokoban import SokobanEnv
from turnforge.seeding import stable_hash
from turnforge.types import StepResult


class SlowSokobanEnv(SokobanEnv):
    """Sokoban whose every step sleeps a lognormal delay first (see the module docstring)."""

    def __init__(self, *, median_ms: float = 20.0, sigma: float = 1.0, max_ms: float = 1000.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if median_ms < 0 or sigma < 0 or max_ms < 0:
            raise ValueError(f"median_ms, sigma and max_ms must be >= 0; got {median_ms}, {sigma}, {max_ms}")
        self.median_ms, self.sigma, self.max_ms = float(median_ms), float(sigma), float(max_ms)

    def step_delay(self) -> float:
        """Seconds the next step will sleep (deterministic in the current state)."""
        if self.median_ms == 0:
            return 0.0
        task = self.current_task.task_id if self.current_task is not None else ""
        z = random.Random(stable_hash("latency", task, self.steps, self.anchor_key())).gauss(0.0, 1.0)
        return min(self.median_ms * math.exp(self.sigma * z), self.max_ms) / 1000.0

    def step(self, action_text: str) -> StepResult:
        if not self.done:
            time.sleep(self.step_delay())
        return super().step(action_text)
