"""The optimizer step every stage takes: a guarded step that skips (and counts) non-finite
losses or gradients, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch

from turnforge.dist import world
from turnforge.errors import RunStopped


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` at learning rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Multiplier of the base learning rate at step ``step`` of ``total``: 1 for
    'constant'; for 'cosine', half a cosine from 1 down to 0 at ``total`` (and 0 after)."""
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


class NonFiniteLoss(RunStopped):
    """Several consecutive optimizer steps had a NaN/inf loss or gradient."""


class GuardedStep:
    """Optimizer step that skips (and counts) steps with a non-finite loss or gradient norm,
    and raises ``NonFiniteLoss`` after ``max_bad`` in a row."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float, max_bad: int) -> None:
        self.model, self.optimizer, self.max_grad_norm, self.max_bad = model, optimizer, max_grad_norm, max_bad
        self.bad_in_a_row = 0
        self.skipped = 0
        self._open, self._finite = False, True  # passes since the last step, all of finite loss

    def __call__(self, loss: torch.Tensor) -> float | None:
        """Backward + clip + step; returns the grad norm, or None if the step was skipped."""
        self.backward(loss)
        return self.step()

    def backward(self, loss: torch.Tensor) -> None:
        """One pass's backward: its gradients add to those of the step's earlier passes (a minibatch
        in several passes, ``turnforge.dist.micro_batches``); the step's first pass starts from zero."""
        if not self._open:
            self.optimizer.zero_grad(set_to_none=True)
            self._open, self._finite = True, True
        # on several ranks every rank runs its backward pass (FSDP's collectives): a non-finite loss on any
        # rank makes the gradient norm, taken over all shards, non-finite on all, and all skip alike
        if world().distributed or torch.isfinite(loss):
            loss.backward()
        else:
            self._finite = False

    def step(self) -> float | None:
        """Clip and step on the gradients of the passes since the last step; returns the grad norm,
        or None if the step was skipped (a non-finite loss or gradient norm)."""
        self._open = False
        if self._finite:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            if hasattr(norm, "full_tensor"):  # FSDP2-sharded gradients (turnforge.dist): the norm over all shards
                norm = norm.full_tensor()
        else:
            norm = torch.tensor(float("nan"))
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_in_a_row += 1
            self.skipped += 1
            if self.bad_in_a_row >= self.max_bad:
                raise NonFiniteLoss(
                    f"{self.bad_in_a_row} optimizer steps in a row had a NaN/inf loss or gradient; "
                    "lower the learning rate or check the rewards"
                )
            return None
        self.bad_in_a_row = 0
        self.optimizer.step()
        return float(norm)
