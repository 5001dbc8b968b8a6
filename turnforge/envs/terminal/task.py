"""A terminal task, whatever its source: the files an agent starts from, the instruction, the
hidden tests that score the final workspace, and the reference solution.

Every task source (Harbor task directories, the generated shell tasks, the code-repair
catalogue, self-play bugs) produces a ``TerminalTask``; the ``terminal`` env plays any of them
the same way (``turnforge.envs.terminal.env``):

1. a box (``turnforge.sandbox.box``) is opened with ``workdir`` as its working directory and
   ``writable`` as its only writable places; ``files`` are written and ``setup`` commands run
   (a Dockerfile's ``RUN`` lines), then the agent gets ``instruction``;
2. after the agent stops (``submit`` or the turn budget), the final workspace is copied into a
   fresh box, ``tests`` are written under ``/tests`` (only then: the agent never sees them) and
   ``test_command`` runs in ``workdir``; it writes the reward to ``/logs/verifier/reward.txt``
   (a number) or ``reward.json`` (``{"reward": x}`` or named numbers, averaged), as Harbor's
   verifier does.

The reference solution is ``solution`` (files written under ``/solution``) run by
``solve_command``, or, for tasks made for imitation, ``expert_commands``: the commands an
expert types, one per turn (the BC demonstrations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal

#: Where the verifier's tests are written at verification time, and where the reward is read.
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
VERIFIER_LOGS = "/logs/verifier"
REWARD_TXT = f"{VERIFIER_LOGS}/reward.txt"
REWARD_JSON = f"{VERIFIER_LOGS}/reward.json"


@dataclass(frozen=True)
class TaskFile:
    """A file of a task: an absolute path in the box, its bytes and its mode."""

    path: str
    data: bytes
    mode: int = 0o644

    def __post_init__(self) -> None:
        if not PurePosixPath(self.path).is_absolute():
            raise ValueError(f"task file path {self.path!r} must be absolute")


@dataclass(frozen=True)
class TerminalTask:
    """One task of the ``terminal`` env (see the module docstring)."""

    name: str  # unique within its source: a Harbor directory's name, family-level-seed for generated ones
    instruction: str  # what the agent is told
    tests: tuple[TaskFile, ...]  # written under /tests at verification only
    test_command: str = f"bash {TESTS_DIR}/test.sh"  # run in workdir; writes the reward file
    workdir: str = "/app"  # the agent's working directory (created if missing)
    writable: tuple[str, ...] = ("/app",)  # the box's writable places (workdir lies in one of them)
    files: tuple[TaskFile, ...] = ()  # the workspace before the agent starts
    setup: tuple[str, ...] = ()  # commands run in workdir before the agent starts (a Dockerfile's RUN lines)
    env: tuple[tuple[str, str], ...] = ()  # exported variables (a Dockerfile's ENV lines)
    solution: tuple[TaskFile, ...] = ()  # written under /solution for the reference solution
    solve_command: str | None = None  # the reference solution, run in workdir (e.g. bash /solution/solve.sh)
    expert_commands: tuple[str, ...] = ()  # or: the reference as commands, one per turn
    reward: Literal["binary", "fraction"] = "binary"  # 'fraction': the tests' passed share (reward.json)
    family: str = ""  # what kind of task it is (generated families; Harbor: its category)
    difficulty: int = 1
    agent_timeout_s: float = 600.0  # wall clock of the whole episode's commands
    verifier_timeout_s: float = 120.0
    command_timeout_s: float = 30.0  # one command's limit (the env's option can lower it)
    memory_mb: int = 2048
    disk_mb: int = 256  # each writable place's size cap
    metadata: tuple[tuple[str, str], ...] = field(default=())  # free-form (difficulty, category...)

    def __post_init__(self) -> None:
        if not PurePosixPath(self.workdir).is_absolute():
            raise ValueError(f"task {self.name}: workdir {self.workdir!r} must be absolute")
        if not any(PurePosixPath(self.workdir).is_relative_to(w) for w in self.writable):
            raise ValueError(f"task {self.name}: workdir {self.workdir} is not under a writable place {self.writable}")
        if self.solve_command is None and not self.expert_commands and self.solution:
            raise ValueError(f"task {self.name}: solution files without a solve_command")

    @property
    def has_reference(self) -> bool:
        """Whether the task carries a reference solution (the expert)."""
        return self.solve_command is not None or bool(self.expert_commands)
