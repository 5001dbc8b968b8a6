"""Bounded staleness for asynchronous rollouts (AReaL's admission rule).

Trajectories are numbered in the order their generation starts (1, 2, ...). The trainer
consumes them oldest first, ``batch_size`` per step, so trajectory ``n`` is trained on at
step ``floor((n - 1) / batch_size)``. A new trajectory may start only while

    floor((N_r - 1) / batch_size) <= version + eta

where ``N_r`` counts it too and ``version`` is the number of trainer steps done (the
policy version it would be sampled with). Its staleness, the steps between the version
that samples it and the step that trains on it, is then at most ``eta``. ``eta = 0``
is synchronous on-policy training: no trajectory of step i+1 starts before step i ends.

Departure from AReaL: the bound is on the version a trajectory *starts* with. With
partial rollouts a long trajectory may carry tokens of later versions too (each token
keeps its own version, see ``Sample.versions``); those are fresher, never staler.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessController:
    """Admission control for asynchronous generation (see the module docstring)."""

    batch_size: int  # trajectories per trainer step
    eta: int  # the largest staleness allowed (0 = synchronous)
    group_size: int = 1  # trajectories of one group (GRPO's G) are admitted together
    started: int = 0  # trajectories admitted so far (N_r)
    version: int = 0  # trainer steps done

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError(f"staleness eta must be >= 0; got eta={self.eta}")
        if self.batch_size < 1 or self.group_size < 1:
            raise ValueError(f"batch_size ({self.batch_size}) and group_size ({self.group_size}) must be >= 1")
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size={self.batch_size} is not a multiple of group_size={self.group_size}: "
                "a training batch must hold whole groups"
            )

    def can_admit(self) -> bool:
        """May the next group start now? (Its last trajectory decides: it is trained last.)"""
        last = self.started + self.group_size
        return (last - 1) // self.batch_size <= self.version + self.eta

    def admit(self) -> tuple[range, int]:
        """Start the next group: its trajectory numbers (1-based) and the version that
        samples it. Raises ``RuntimeError`` when ``can_admit()`` is False."""
        if not self.can_admit():
            raise RuntimeError(
                f"admitting trajectory {self.started + self.group_size} would exceed staleness eta={self.eta} "
                f"at version {self.version}"
            )
        numbers = range(self.started + 1, self.started + self.group_size + 1)
        self.started += self.group_size
        return numbers, self.version

    def train_step(self) -> None:
        """The trainer finished a step (the policy version goes up by one)."""
        self.version += 1

    @staticmethod
    def step_of(number: int, batch_size: int) -> int:
        """The trainer step that consumes trajectory ``number`` (oldest first)."""
        return (number - 1) // batch_size
