"""Self-play bugs (SWE-RL's self-play): the agent injects a bug that the hidden tests catch, and each
valid injected bug becomes a repair task for the same policy.

An ``inject`` task's workspace is a correct function of the code-repair catalogue
(``/app/pkg/NAME.py``), its visible tests and ``run_tests.py``. The agent must change at most
``MAX_CHANGED`` lines so that the module still imports and some test fails. The verifier scores
that on the pristine tests: 1 for a valid bug, else 0. The env (``TerminalEnv``) reports a valid
bug's module in the last turn's ``info["injected_module"]``; the flywheel mechanism ``selfplay``
(``turnforge.train.mechanisms.selfplay``) turns those into repair tasks
(``turnforge.envs.terminal.repair``, source ``injected``) that the same policy plays in later rounds.

``SelfPlayTasks``: the train split is inject tasks on the train functions, the held-out split the
catalogue's repair tasks on the held-out functions (``HELDOUT``): what the run does to repair
success on unseen code is what its evaluations measure. The expert of an inject task applies one
of the catalogue's mutants (an ``off_by_one``/``wrong_operator``... rewrite) with a python3
here-document, so BC has demonstrations of both halves.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from turnforge.envs.code.mutations import mutate, normalize
from turnforge.envs.code.repair import HELDOUT
from turnforge.envs.code.seeds import RUNNER, SEEDS
from turnforge.envs.tasks import TaskSource
from turnforge.envs.terminal.repair import RepairTasks, _catalogue, _seed, _tests, fix_command
from turnforge.envs.terminal.task import TESTS_DIR, TaskFile, TerminalTask
from turnforge.seeding import stable_hash
from turnforge.types import Task

#: The most lines an injected bug may change.
MAX_CHANGED = 2

#: Scores an injected bug: few lines changed, the module imports, a pristine test fails, nothing hangs.
CHECK_PY = f"""import difflib, json, os, subprocess, sys, tempfile
name, original = sys.argv[1], open("{TESTS_DIR}/original.py").read()
try:
    current = open(f"/app/pkg/{{name}}.py").read()
except OSError:
    current = ""
changed = sum(1 for line in difflib.ndiff(original.splitlines(), current.splitlines()) if line[:1] in "+-")
reward = 0
if current and 0 < changed <= 2 * {MAX_CHANGED}:
    work = tempfile.mkdtemp()
    os.makedirs(f"{{work}}/pkg")
    open(f"{{work}}/pkg/{{name}}.py", "w").write(current)
    subprocess.run(["cp", "-r", "{TESTS_DIR}/pristine/.", work])
    imports = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, 'pkg'); from {{name}} import {{name}}"],
                             cwd=work, capture_output=True, timeout=10).returncode == 0
    try:
        out = subprocess.run([sys.executable, "run_tests.py"], cwd=work, capture_output=True, text=True, timeout=10).stdout
        last = out.strip().splitlines()[-1] if out.strip() else ""
        failed = last.endswith("failed") and not last.endswith(" 0 failed")
    except subprocess.TimeoutExpired:
        failed = False  # a hang is not a bug the tests catch
    reward = int(imports and failed)
    print(f"changed lines: {{changed}}, imports: {{imports}}, a test fails: {{failed}}")
else:
    print(f"changed lines: {{changed}} (a bug changes 1 to {MAX_CHANGED} lines)")
open("/logs/verifier/reward.txt", "w").write(f"{{reward}}\\n")
"""


def build_task(data: Mapping[str, Any]) -> TerminalTask:
    """The inject task of ``data`` ({"source": "inject", "seed": NAME, "variant": N})."""
    seed = _seed(str(data.get("seed")))
    original = normalize(seed.source)
    mutants = [(k, s) for name, k, s in _catalogue() if name == seed.name]
    kind, site = mutants[int(data.get("variant", 0)) % len(mutants)]
    path = f"pkg/{seed.name}.py"
    return TerminalTask(
        name=f"inject-{seed.name}-{data.get('variant', 0)}",
        instruction=(f"Introduce a bug into /app/pkg/{seed.name}.py: change 1 to {MAX_CHANGED} lines so that the module "
                     "still imports but some test in /app/tests fails (check with python3 run_tests.py), then submit."),
        tests=(TaskFile(f"{TESTS_DIR}/test.sh", f"#!/bin/bash\npython3 {TESTS_DIR}/check.py {seed.name}\n".encode(), 0o755),
               TaskFile(f"{TESTS_DIR}/check.py", CHECK_PY.encode()),
               TaskFile(f"{TESTS_DIR}/original.py", original.encode()),
               TaskFile(f"{TESTS_DIR}/pristine/tests/test_{seed.name}.py", _tests(seed).encode()),
               TaskFile(f"{TESTS_DIR}/pristine/run_tests.py", RUNNER.lstrip("\n").encode())),
        files=(TaskFile(f"/app/{path}", original.encode()), TaskFile(f"/app/tests/test_{seed.name}.py", _tests(seed).encode()),
               TaskFile("/app/run_tests.py", RUNNER.lstrip("\n").encode())),
        workdir="/app", writable=("/app",),
        expert_commands=(f"cat {path}", fix_command(path, original, mutate(original, kind, site)), "python3 run_tests.py"),
        family=f"inject/{seed.name}", difficulty=1, agent_timeout_s=120.0, verifier_timeout_s=30.0, command_timeout_s=10.0,
    )


class InjectTasks(TaskSource):
    """Inject tasks: the train split on the train functions, the held-out split on ``HELDOUT``."""

    def task(self, split: str, index: int) -> Task:
        names = [s.name for s in SEEDS if (s.name in HELDOUT) == (split == "heldout")]
        rng = random.Random(stable_hash("inject-task", split, index))
        return Task("", split, index, {"source": "inject", "seed": rng.choice(names), "variant": rng.randrange(64)})  # type: ignore[arg-type]

    def size(self, split: str) -> None:
        return None

    def key(self, task: Task) -> str:
        data = task.data or {}
        return build_task(data).name


class SelfPlayTasks(TaskSource):
    """Train: inject tasks on the train functions; held-out: repair tasks on the held-out functions."""

    def __init__(self, partial_credit: bool = False) -> None:
        self.inject, self.repair = InjectTasks(), RepairTasks(partial_credit=partial_credit)

    def task(self, split: str, index: int) -> Task:
        return (self.inject if split == "train" else self.repair).task(split, index)

    def size(self, split: str) -> int | None:
        return None if split == "train" else self.repair.size(split)

    def key(self, task: Task) -> str:
        return (self.inject if (task.data or {}).get("source") == "inject" else self.repair).key(task)
