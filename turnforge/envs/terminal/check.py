"""``turnforge check-env DIR`` on terminal tasks: each task's reference solution must score 1 and an
agent that does nothing must score 0, in the same boxes and verifier that training uses.

``check_tasks(tasks)`` plays, for every task, (1) the oracle: the reference written under
``/solution`` and ``solve_command`` run in the working directory (Harbor's ``OracleAgent``), or the
reference commands one by one; (2) an agent that submits at once. A reference that does not
score 1, or an empty workspace that does not score 0, is a ``TaskCheck`` whose ``problem`` names
the task and the file (``solution/solve.sh`` or ``tests/test.sh``); a verifier that gives no
reward is reported the same way (it would be an infrastructure failure in training).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from turnforge.envs.terminal.task import SOLUTION_DIR, TerminalTask
from turnforge.envs.terminal.verify import VerifierError, box_spec, prepare, verify
from turnforge.sandbox.box import open_box


@dataclass(frozen=True)
class TaskCheck:
    """What ``check_tasks`` found for one task."""

    task: str
    reference: float | None  # the reference solution's reward (None: the task has none)
    nothing: float | None  # the reward of an agent that does nothing (None: the verifier failed)
    seconds: float
    problem: str | None  # one line, or None when the task is sound


def _build(box, task: TerminalTask) -> None:
    prepare(box, task)
    box.put({f.path: f.data for f in task.files}, {f.path: f.mode for f in task.files})
    box.exec(f"mkdir -p {task.workdir}", timeout_s=10)
    for name, value in task.env:
        box.exec(f"export {name}='{value}'", timeout_s=10)
    for command in task.setup:
        result = box.exec(command, timeout_s=max(60.0, task.verifier_timeout_s))
        if result.exit_code != 0:
            raise VerifierError(f"task {task.name}: environment/Dockerfile: set-up command {command[:60]!r} exited with "
                                f"{result.exit_code}: {result.output.strip().splitlines()[-1:]}")
    box.exec(f"cd {task.workdir}", timeout_s=10)


def play_reference(task: TerminalTask, backend: str = "bwrap") -> float:
    """The verifier's reward for the task's reference solution."""
    extra = (SOLUTION_DIR,) if task.solve_command else ()
    with open_box(box_spec(task, extra=extra, timeout_s=task.agent_timeout_s), backend) as box:
        _build(box, task)
        if task.solve_command:
            box.put({f.path: f.data for f in task.solution}, {f.path: f.mode | 0o500 for f in task.solution})
            box.exec(task.solve_command, timeout_s=task.agent_timeout_s)
        else:
            for command in task.expert_commands:
                box.exec(command, timeout_s=task.command_timeout_s)
        final = box.snapshot()
    return verify(task, final, backend).reward


def play_nothing(task: TerminalTask, backend: str = "bwrap") -> float:
    """The verifier's reward for the workspace as the task starts."""
    with open_box(box_spec(task), backend) as box:
        _build(box, task)
        final = box.snapshot()
    return verify(task, final, backend).reward


def check_task(task: TerminalTask, backend: str = "bwrap") -> TaskCheck:
    start = time.monotonic()
    reference = nothing = None
    try:
        nothing = play_nothing(task, backend)
        if task.has_reference:
            reference = play_reference(task, backend)
    except VerifierError as err:
        return TaskCheck(task.name, reference, nothing, time.monotonic() - start, str(err))
    file = "solution/solve.sh" if task.solve_command else "its reference commands"
    problem = None
    if nothing is not None and nothing > 0:
        problem = f"task {task.name}: tests/test.sh gives reward {nothing:g} to a workspace nobody touched (it must give 0)"
    elif reference is not None and reference < 1:
        problem = f"task {task.name}: {file} scores {reference:g} on its own tests (it must score 1)"
    return TaskCheck(task.name, reference, nothing, time.monotonic() - start, problem)


def check_tasks(tasks: Sequence[TerminalTask], backend: str = "bwrap") -> list[TaskCheck]:
    """``check_task`` of every task, in order."""
    return [check_task(t, backend) for t in tasks]
