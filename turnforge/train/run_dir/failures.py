"""Infrastructure failures: when a stage has too many, the run stops.

An episode is an infrastructure failure when the machinery failed, not the policy: env code
raised in ``reset``/``step``/``restore``, an env worker crashed or hung twice on one request,
an agent program raised or timed out (``Trajectory.infra_failure`` holds the error). Every stage counts them, leaves them out of
its scores and samples (never a reward of 0) and asks ``check_failures`` whether it may go
on: a BC demonstration batch, an evaluation, an RL iteration's rollouts, value pretraining, a
batch of Monte-Carlo estimates. The rule, in one place:

- more than ``max_share`` of the stage's episodes failed: stop (``TrainConfig.max_failure_share``);
- every episode failed: stop, whatever ``max_share`` (1.0 included): nothing is left to
  score or train on, and an empty stage must not read as a success rate or reward of 0;
- no episode at all: nothing to decide.
"""

from __future__ import annotations

from typing import Sequence

from turnforge.config import TrainConfig
from turnforge.errors import RunStopped
from turnforge.types import Trajectory

#: ``TrainConfig.max_failure_share``'s default.
DEFAULT_MAX_FAILURE_SHARE: float = TrainConfig.model_fields["max_failure_share"].default


def check_failures(stage: str, env_id: str, failed: int, total: int, first_error: str | None, max_share: float, *,
                   kind: str = "episodes") -> None:
    """Raise ``RunStopped`` when ``failed`` of ``total`` episodes of ``stage`` are more than
    ``max_share`` of them (``failed / total > max_share``; exactly ``max_share`` goes on), or
    all of them. The message names the stage, the env, the count of ``kind`` (e.g.
    "12 of 16 demonstration episodes"), the first error and the config knob."""
    if not 0.0 <= max_share <= 1.0:
        raise ValueError(f"max_share must be in [0, 1]; got {max_share}")
    if not 0 <= failed <= total:
        raise ValueError(f"failed must be in [0, total={total}]; got {failed}")
    if failed == 0:
        return
    agent = env_id == "agent"  # turnforge.gateway.agents: the agent program is the machinery
    machinery = "the agent program or its tools" if agent else "the env machinery"
    where = f"{stage}: {failed} of {total} {kind} on env {env_id!r} failed in {machinery} (not the policy)"
    first = f"first error: {first_error}"
    if failed == total:
        raise RunStopped(f"{where}, so nothing is left to use (whatever max_failure_share); {first}")
    if failed / total > max_share:
        raise RunStopped(
            f"{where}, more than max_failure_share={max_share:g} allows (fix the {'agent' if agent else 'env'}, or raise max_failure_share "
            f"to go on without them); {first}"
        )


def count_failures(trajectories: Sequence[Trajectory]) -> tuple[int, int, str | None]:
    """``(failed, total, first error)`` of a stage's episodes, in their order."""
    errors = [t.infra_failure for t in trajectories if t.infra_failure is not None]
    return len(errors), len(trajectories), errors[0] if errors else None


def check_trajectories(stage: str, env_id: str, trajectories: Sequence[Trajectory], max_share: float, *,
                       kind: str = "episodes") -> int:
    """``check_failures`` on a stage's trajectories; returns how many failed."""
    failed, total, first = count_failures(trajectories)
    check_failures(stage, env_id, failed, total, first, max_share, kind=kind)
    return failed
