"""The verifier of a terminal task: the task's hidden tests run on the agent's final workspace, in a
fresh box, after the episode.

``verify(task, files, backend)``: a new box of the task's workspace receives ``files`` (the final
workspace, a ``BoxSnapshot``'s tar), the offline stand-ins (``offline``) and, only now, the tests
under ``/tests``; ``task.test_command`` runs in the task's working directory with the task's
variables, for at most ``task.verifier_timeout_s``; the reward is read from
``/logs/verifier/reward.json`` (``{"reward": x}``, or named numbers, averaged) or ``reward.txt``
(one number), as Harbor's verifier reads them. A verifier that writes no reward, writes one that
is not a finite number, or runs past its timeout is an infrastructure failure (``VerifierError``:
the episode is counted and excluded, never scored 0); the agent cannot cause one through the
files it leaves, since a well-formed test script writes 0 when the work is wrong.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

from turnforge.envs.terminal.offline import PATH, UV_ENV, shim_files
from turnforge.envs.terminal.task import REWARD_JSON, REWARD_TXT, TESTS_DIR, VERIFIER_LOGS, TerminalTask
from turnforge.sandbox.box import BoxSnapshot, BoxSpec, open_box
from turnforge.sandbox.limits import Limits


class VerifierError(RuntimeError):
    """The verifier failed to give a reward (an infrastructure failure of the episode, not a score)."""


@dataclass(frozen=True)
class Verdict:
    """What the verifier found."""

    reward: float
    success: bool  # reward >= 1 (binary tasks), or every test passed (fraction)
    output: str  # the last lines of what the test command printed
    seconds: float


#: Host paths a task's box sees read-only: the package database (the offline apt-get reads which packages exist).
HOST_BINDS = tuple(p for p in ("/var/lib/dpkg",) if os.path.isdir(p))
#: The writable places of a verifier's box besides the workspace.
VERIFIER_DIRS = (TESTS_DIR, "/logs")


def box_spec(task: TerminalTask, *, extra: tuple[str, ...] = (), timeout_s: float | None = None,
             max_output_bytes: int = 16_384) -> BoxSpec:
    """The box a task's episodes (and its verifier, with ``extra``) run in."""
    limits = Limits(timeout_s=timeout_s or task.command_timeout_s, cpu_s=max(60, int(task.agent_timeout_s)),
                    memory_mb=task.memory_mb, max_processes=128, disk_mb=task.disk_mb, max_output_bytes=max_output_bytes)
    env = {"PATH": PATH, "TEST_DIR": TESTS_DIR, **dict(task.env)}
    return BoxSpec(workdir=task.writable[0], env=env, limits=limits, extra_dirs=extra, binds=HOST_BINDS)


def prepare(box, task: TerminalTask) -> None:
    """The offline stand-ins and ``$HOME/.local/bin/env`` in a new box (first on its PATH)."""
    shims = shim_files()
    home = f"{task.writable[0]}/.local/bin/env"  # HOME is the workspace
    box.put({**shims, "/tmp/.offline/home-env": UV_ENV.encode()}, {p: 0o755 for p in shims})
    box.exec(f"mkdir -p $(dirname {home}) && cp /tmp/.offline/home-env {home} 2>/dev/null; true", timeout_s=10)


def read_reward(found: dict[str, bytes], task: TerminalTask) -> float:
    """The reward a verifier wrote (``found``: path -> bytes of the reward files); ``VerifierError``
    when there is none or it is not a finite number."""
    if REWARD_JSON in found:
        try:
            data = json.loads(found[REWARD_JSON])
            values = [float(data["reward"])] if isinstance(data, dict) and "reward" in data else [float(v) for v in data.values()]
        except (ValueError, TypeError, AttributeError, KeyError):
            raise VerifierError(f"task {task.name}: {REWARD_JSON} is not a JSON object of numbers") from None
        value = sum(values) / len(values) if values else math.nan
    elif REWARD_TXT in found:
        try:
            value = float(found[REWARD_TXT].decode().strip())
        except ValueError:
            raise VerifierError(f"task {task.name}: {REWARD_TXT} holds {found[REWARD_TXT][:40]!r}, not a number") from None
    else:
        raise VerifierError(f"task {task.name}: the verifier wrote neither {REWARD_TXT} nor {REWARD_JSON}")
    if not math.isfinite(value):
        raise VerifierError(f"task {task.name}: the verifier's reward is {value}")
    return value


def verify(task: TerminalTask, final: BoxSnapshot, backend: str = "bwrap", max_starting: int | None = None) -> Verdict:
    """Run ``task``'s tests on the final workspace ``final`` (see the module docstring)."""
    start = time.monotonic()
    extra = tuple(dict.fromkeys(VERIFIER_DIRS + tuple(final.extra_dirs)))  # (an oracle's box also had /solution)
    with open_box(box_spec(task, extra=extra, timeout_s=task.verifier_timeout_s), backend,
                  max_starting=max_starting) as box:
        box.restore(final)
        prepare(box, task)
        tests = {f.path: f.data for f in task.tests}
        box.put(tests, {f.path: f.mode | 0o400 for f in task.tests})
        box.exec(f"mkdir -p {VERIFIER_LOGS} && cd {task.workdir}", timeout_s=10)
        result = box.exec(task.test_command, timeout_s=task.verifier_timeout_s)
        if result.timed_out:
            raise VerifierError(f"task {task.name}: the verifier ran past {task.verifier_timeout_s:g} s")
        reward = read_reward(box.get([REWARD_JSON, REWARD_TXT]), task)
    tail = "\n".join(result.output.strip().splitlines()[-5:])
    success = reward >= 1.0 - 1e-9
    return Verdict(reward if task.reward == "fraction" else float(success), success, tail, time.monotonic() - start)
