"""SWE-style repair from the shell: the code-repair catalogue's bugs as terminal tasks.

A task's workspace is the ``code-repair`` env's package (``turnforge.envs.code``): ``/app/pkg/NAME.py``
with one injected bug, its unit tests ``/app/tests/test_NAME.py`` and ``/app/run_tests.py`` (which
the agent runs itself, ``python3 run_tests.py``). The verifier runs the pristine tests and runner
(copied in at verification, so editing the visible ones changes nothing) against the agent's
``pkg/``: reward 1 when every test passes (or, with ``partial_credit``, the passed share). The
split is by seed function, as the code-repair env's: held-out functions (``HELDOUT``) are never
trained on. The expert reads the file, runs the tests, rewrites the buggy line(s) with a
``python3`` here-document and submits.

``data``: ``{"source": "repair", "seed": NAME, "kind": KIND, "site": N}`` for a catalogue bug, or
``{"source": "injected", "seed": NAME, "module": TEXT}`` for a bug an agent injected (self-play,
``turnforge.envs.terminal.selfplay``): the same task around that module.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
from typing import Any, Mapping

from turnforge.envs.code.mutations import KINDS, mutate, normalize
from turnforge.envs.code.repair import HELDOUT, catalogue
from turnforge.envs.code.seeds import RUNNER, SEEDS, Seed
from turnforge.envs.tasks import TaskSource
from turnforge.envs.terminal.task import TESTS_DIR, TaskFile, TerminalTask
from turnforge.errors import UserError
from turnforge.seeding import stable_hash
from turnforge.types import SPLITS, Task

#: Runs the pristine tests and runner on the agent's pkg/ and writes the reward (reward.json: the passed share).
VERIFY_SH = f"""#!/bin/bash
work=$(mktemp -d)
cp -r /app/pkg "$work/pkg" 2>/dev/null || mkdir -p "$work/pkg"
cp -r {TESTS_DIR}/pristine/. "$work/"
cd "$work" && timeout 20 python3 run_tests.py > "$work/out.txt" 2>&1
python3 - "$work/out.txt" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
m = re.search(r"^(\\d+) passed, (\\d+) failed$", text, re.M)
passed, failed = (int(m.group(1)), int(m.group(2))) if m else (0, 1)
json.dump({{"reward": passed / max(passed + failed, 1)}}, open("/logs/verifier/reward.json", "w"))
EOF
tail -3 "$work/out.txt"
""".encode()


def _seed(name: str) -> Seed:
    found = next((s for s in SEEDS if s.name == name), None)
    if found is None:
        raise UserError(f"repair task: unknown function {name!r}; valid: {', '.join(s.name for s in SEEDS)}")
    return found


def _tests(seed: Seed) -> str:
    return f"from {seed.name} import {seed.name}\n" + seed.tests.lstrip("\n")


def repair_task(seed: Seed, module: str, name: str, *, partial_credit: bool = False) -> TerminalTask:
    """The terminal task of repairing ``module`` (a buggy version of ``seed``'s function)."""
    fixed = normalize(seed.source)
    files = (TaskFile(f"/app/pkg/{seed.name}.py", module.encode()), TaskFile(f"/app/tests/test_{seed.name}.py", _tests(seed).encode()),
             TaskFile("/app/run_tests.py", RUNNER.lstrip("\n").encode()))
    tests = (TaskFile(f"{TESTS_DIR}/test.sh", VERIFY_SH, 0o755),
             TaskFile(f"{TESTS_DIR}/pristine/tests/test_{seed.name}.py", _tests(seed).encode()),
             TaskFile(f"{TESTS_DIR}/pristine/run_tests.py", RUNNER.lstrip("\n").encode()))
    return TerminalTask(
        name=name,
        instruction=(f"The function in /app/pkg/{seed.name}.py has a bug: some tests in /app/tests fail. Find it (run "
                     "python3 run_tests.py), fix pkg/, then submit."),
        tests=tests, files=files, workdir="/app", writable=("/app",),
        expert_commands=(f"cat pkg/{seed.name}.py", "python3 run_tests.py", fix_command(f"pkg/{seed.name}.py", module, fixed)),
        reward="fraction" if partial_credit else "binary", family=seed.name, difficulty=2,
        agent_timeout_s=120.0, verifier_timeout_s=30.0, command_timeout_s=10.0,
    )


def fix_command(path: str, current: str, fixed: str) -> str:
    """A shell command that turns file ``path`` from ``current`` into ``fixed``: a python3
    here-document replacing the differing lines (widened until they occur once)."""
    a, b = current.splitlines(keepends=True), fixed.splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not ops:
        return "true"
    i1, i2, j1, j2 = ops[0][1], ops[-1][2], ops[0][3], ops[-1][4]
    while True:
        old = "".join(a[i1:i2])
        if old and current.count(old) == 1:
            break
        i1, j1, i2, j2 = max(i1 - 1, 0), max(j1 - 1, 0), min(i2 + 1, len(a)), min(j2 + 1, len(b))
    new = "".join(b[j1:j2])
    return (f"python3 - <<'EOF'\nimport pathlib\np = pathlib.Path({path!r})\n"
            f"p.write_text(p.read_text().replace({old!r}, {new!r}, 1))\nEOF")


@functools.lru_cache(maxsize=1)
def _catalogue() -> tuple[tuple[str, str, int], ...]:
    from turnforge.sandbox import Limits, Sandbox

    return catalogue(Sandbox(Limits(timeout_s=120, cpu_s=120)))


def build_task(data: Mapping[str, Any]) -> TerminalTask:
    """The repair task ``data`` names (a catalogue bug, or an injected module)."""
    seed = _seed(str(data.get("seed")))
    partial = bool(data.get("partial_credit", False))
    if data.get("source") == "injected":
        module = str(data["module"])
        digest = stable_hash("injected", module) % 10**8
        return repair_task(seed, module, f"injected-{seed.name}-{digest}", partial_credit=partial)
    kind, site = str(data.get("kind")), int(data.get("site", -1))
    if kind not in KINDS:
        raise UserError(f"repair task: unknown bug kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    return repair_task(seed, mutate(normalize(seed.source), kind, site), f"repair-{seed.name}-{kind}-{site}",
                       partial_credit=partial)


class RepairTasks(TaskSource):
    """The catalogue's bugs (every mutant the seed's tests catch), split by function (``HELDOUT``)."""

    def __init__(self, kinds: tuple[str, ...] | list[str] = KINDS, partial_credit: bool = False) -> None:
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown or not kinds:
            raise UserError(f"source repair: unknown bug kinds {unknown}; valid kinds: {', '.join(KINDS)}")
        self.kinds, self.partial_credit = tuple(kinds), bool(partial_credit)
        self._bugs: dict[str, list[tuple[str, str, int]]] | None = None

    def bugs(self, split: str) -> list[tuple[str, str, int]]:
        if self._bugs is None:
            self._bugs = {s: [] for s in SPLITS}
            for bug in _catalogue():
                if bug[1] in self.kinds:
                    self._bugs["heldout" if bug[0] in HELDOUT else "train"].append(bug)
        return self._bugs[split]

    def task(self, split: str, index: int) -> Task:
        bugs = self.bugs(split)
        name, kind, site = bugs[random.Random(stable_hash("repair-task", split, index)).randrange(len(bugs))]
        data = {"source": "repair", "seed": name, "kind": kind, "site": site, "partial_credit": self.partial_credit}
        return Task("", split, index, data)  # type: ignore[arg-type]

    def size(self, split: str) -> int:
        return len(self.bugs(split))

    def key(self, task: Task) -> str:
        data = task.data or {}
        return json.dumps([data.get("seed"), data.get("kind"), data.get("site")])
