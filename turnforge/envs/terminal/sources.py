"""Where terminal tasks come from: one registry of task sources, each a ``TaskSource`` whose tasks'
``data`` names the source and what it needs to rebuild the ``TerminalTask`` in any process.

- ``generated``: verifiable shell tasks from families of generators (``generated``), with
  held-out families never trained on;
- ``repair``: SWE-style repair from the shell, the code-repair catalogue's bugs (``repair``);
- ``inject`` and ``selfplay``: SWE-RL's self-play, the agent injecting bugs that the hidden tests
  catch, and those bugs as repair tasks (``selfplay``);
- ``harbor``: Harbor task directories (``harbor``), read by ``env.tasks=DIR`` rather than named here.

``build_task(data)`` dispatches on ``data["source"]``; adding a source is one module with a
``TaskSource`` and a builder, registered in ``TERMINAL_SOURCES`` and ``BUILDERS``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Mapping

from turnforge.envs.tasks import TaskSource
from turnforge.envs.terminal import generated, harbor, repair, selfplay
from turnforge.envs.terminal.task import TerminalTask
from turnforge.errors import UserError, choices

#: The ``source`` option of the terminal env: name -> its task source's factory (the env's other options go to it).
TERMINAL_SOURCES: dict[str, Callable[..., TaskSource]] = {
    "generated": generated.ShellTasks,
    "repair": repair.RepairTasks,
    "inject": selfplay.InjectTasks,
    "selfplay": selfplay.SelfPlayTasks,
}


@functools.lru_cache(maxsize=256)
def _harbor(path: str) -> TerminalTask:
    return harbor.read_task(Path(path))


#: ``data["source"]`` -> the function that builds its ``TerminalTask``.
BUILDERS: dict[str, Callable[[Mapping[str, Any]], TerminalTask]] = {
    "generated": generated.build_task,
    "repair": repair.build_task,
    "injected": repair.build_task,
    "inject": selfplay.build_task,
    "harbor": lambda data: _harbor(str(data["path"])),
}


def build_task(data: Mapping[str, Any]) -> TerminalTask:
    """The ``TerminalTask`` that a task's ``data`` names."""
    source = data.get("source")
    if source not in BUILDERS:
        raise UserError(f"terminal task data {dict(data)!r} names no known source; valid: {choices(BUILDERS)}")
    return BUILDERS[source](data)


def task_label(data: Mapping[str, Any]) -> str:
    """What evaluations group success by: the family (``heldout/FAMILY`` for a held-out family of
    generated tasks), the bug's function for repair tasks, the category for Harbor tasks."""
    source = data.get("source")
    if source == "generated":
        family = str(data.get("family", ""))
        return f"{generated.HELDOUT_LABEL}/{family}" if generated.FAMILIES[family].heldout else family
    if source in ("repair", "injected", "inject"):
        return f"{source}/{data.get('seed', '')}"
    return build_task(data).family or str(source)
