"""``replay``: kept successes on hard tasks, trained on again in later rounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from turnforge.train.mechanisms.base import Mechanism, MechanismRecord

if TYPE_CHECKING:
    from turnforge.data.filters import Candidate


@dataclass
class ReplayState:
    buffer: list[Candidate] = field(default_factory=list)  # oldest first, each with its own source


@dataclass(frozen=True)
class ReplayRecord(MechanismRecord):
    size: int = 0  # episodes in the buffer after the round


class Replay(Mechanism):
    """A buffer of the newest ``replay_size`` kept successes on tasks the round's plain rollouts
    solved at most ``replay_max_success`` of the time: each round trains on the buffer as it was
    before the round (guided episodes keep their importance weights), then adds the round's."""

    name = "replay"
    help = "earlier rounds' kept successes on hard tasks, trained on again"
    Record = ReplayRecord

    def initial_state(self):
        return ReplayState()

    def route(self, hard):
        replayed = list(self.state.buffer)
        self.state.buffer = (self.state.buffer + hard)[-self.cfg.flywheel.replay_size:]
        return replayed

    def record(self, episodes):
        return ReplayRecord(episodes, len(self.state.buffer))

    @classmethod
    def columns(cls, record):
        return {"replay": str(record.size)}
