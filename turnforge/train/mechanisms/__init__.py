"""The data flywheel's mechanisms (``flywheel.mechanisms``): one class each, in one registry, ``MECHANISMS``.

A mechanism is an exploration aid or a way to re-use data. Each class (``base.Mechanism``)
declares what it needs and owns its state, so the config, the start checks, the round
(``turnforge.train.flywheel``) and the report ask the object instead of comparing names:

- ``source``: the trajectory store's ``source`` of the episodes it plays (``SOURCES``), and
  whether its successes may enter the episodic memory (``remembered``: ``MEMORY_SOURCES``);
- ``requirements(cfg)``: the env capabilities it needs; ``env_conflict(cfg, env)``: what else it
  needs of the env; ``conflict(cfg)``: its own cross-key config rules;
- its state (``initial_state``: what ``FlywheelState`` keeps for it in a resumable checkpoint)
  and its record (``Record``: its entry of ``FlywheelRound.mechanisms``);
- hooks at the points of a round where mechanisms act (``Mechanism``'s docstring), called in
  registry order: ``retry`` narrows a wave's unsolved tasks before ``guidance`` sees them;
  ``curriculum``'s and ``anchor``'s episodes come before the waves, ``evolve``'s tasks first
  among them, ``keep``'s re-tests of the start's levels last; ``curriculum`` stores start states
  before ``replay`` takes the round's successes; ``negatives`` adds the failed turns the round's
  successes contradict to the rft stage (``rft_extra``).

The config imports this package to validate ``flywheel.mechanisms`` and to run the rules, so the
declarations import nothing heavy; the hooks import torch and the engine when they run. Adding a
mechanism is one class (a module here), registered in ``MECHANISMS``, plus its test
(``tests/train/test_flywheel_mechanisms.py`` adds one that does nothing).
"""

from __future__ import annotations

from typing import Iterable

from turnforge.train.mechanisms.anchor import Anchoring
from turnforge.train.mechanisms.base import ExpertUse, Mechanism, MechanismRecord
from turnforge.train.mechanisms.curriculum import Curriculum
from turnforge.train.mechanisms.evolve import Evolve
from turnforge.train.mechanisms.guidance import Guidance
from turnforge.train.mechanisms.keep import Keep
from turnforge.train.mechanisms.negatives import Negatives
from turnforge.train.mechanisms.replay import Replay
from turnforge.train.mechanisms.retry import Retry
from turnforge.train.mechanisms.selfplay import SelfPlay

#: Every mechanism by its ``flywheel.mechanisms`` name, in the order they act in a round.
MECHANISMS: dict[str, type[Mechanism]] = {cls.name: cls for cls in (Retry, Guidance, Curriculum, Anchoring, Evolve, SelfPlay,
                                                                  Replay, Keep, Negatives)}

#: Where an episode came from (the trajectory store's ``source`` column): ``demo`` (the expert's:
#: BC's demonstrations, the anchor mechanism's solutions), ``plain`` (the policy from a task's
#: real start, RL's episodes included), then each mechanism's.
SOURCES: tuple[str, ...] = ("demo", "plain", *(cls.source for cls in MECHANISMS.values() if cls.source))

#: The sources whose successes may enter the episodic memory (``memory.sources``).
MEMORY_SOURCES: tuple[str, ...] = ("demo", "plain", *(cls.source for cls in MECHANISMS.values()
                                                      if cls.source and cls.remembered))


def enabled(names: Iterable[str]) -> list[type[Mechanism]]:
    """The mechanisms ``names`` turns on, in registry order (the order they act in)."""
    names = set(names)
    return [cls for name, cls in MECHANISMS.items() if name in names]


def description() -> str:
    """``flywheel.mechanisms``' description: every mechanism with its few words."""
    return "Exploration aids and data re-use, any of: " + "; ".join(f"{n} ({cls.help})" for n, cls in MECHANISMS.items())


__all__ = ["ExpertUse", "MECHANISMS", "MEMORY_SOURCES", "Mechanism", "MechanismRecord", "SOURCES", "description", "enabled"]
