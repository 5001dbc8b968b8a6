"""SWE-style code repair: a small package with one injected bug and failing unit tests; the
agent reads files, edits with search/replace, runs the tests and submits.

A task's files: ``pkg/<name>.py`` (a seed function of ``seeds.py`` with one bug from
``mutations.py``), ``tests/test_<name>.py`` (its unit tests) and ``run_tests.py`` (the test
runner). Tools: ``list_files``, ``view_file``, ``edit_file`` (search/replace; only files under
``pkg/`` are editable), ``run_tests`` and ``submit``, which ends the episode. Every execution
runs in ``turnforge.sandbox``. Reward on submit: ``success_reward`` if every test passes, else
0, or with ``partial_credit`` the fraction of tests that pass. Scoring runs the env's own
pristine tests and runner against the agent's ``pkg/`` files.

Levels: a mutant of the catalogue (``catalogue()``: every (seed function, bug kind, site)
whose mutant fails some test of its function and finishes within 0.5 s; built once per
process by one sandbox run that tests all mutants, each in a forked child, about 5 s), drawn
from the level seed. So every task is a real bug the tests catch. Splits are by seed function: the held-out split's
functions (``HELDOUT``) never appear in training tasks, so held-out success measures repair of
unseen code, not recall of seen fixes.

The ``oracle`` expert edits the mutated line(s) back (search = the buggy lines, widened until
unique), runs the tests and submits: it solves every task (``check_env`` proves it).
``random_action`` is a uniformly random agent (random tool, random arguments drawn from the
files) for the baseline: it solves almost none.

Known limit: the agent's code runs in the same interpreter as the test runner (as in
SWE-bench-style harnesses), so a program written to tamper with the runner could fake a
pass; the sandbox keeps such a program from anything outside its work dir.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from dataclasses import dataclass

from turnforge.envs.code.mutations import KINDS, count_sites, mutate, normalize
from turnforge.envs.code.seeds import RUNNER, SEEDS, Seed
from turnforge.envs.tool.base import ToolEnv, ToolError
from turnforge.errors import UserError
from turnforge.sandbox import SandboxError

#: Seed functions of the held-out split (fixed, so both splits are never empty).
HELDOUT = frozenset({"binary_search", "dedupe", "is_leap_year", "word_lengths"})
_SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.MULTILINE)


@dataclass(frozen=True)
class RepairLevel:
    seed: str  # the seed function's name
    kind: str  # the bug kind
    site: int
    files: tuple[tuple[str, str], ...]  # (path, text), the task as the agent gets it
    fixed: str  # the original pkg file (the oracle's target)


def _task_files(seed: Seed, module: str) -> tuple[tuple[str, str], ...]:
    tests = f"from {seed.name} import {seed.name}\n" + seed.tests.lstrip("\n")
    return ((f"pkg/{seed.name}.py", module), (f"tests/test_{seed.name}.py", tests), ("run_tests.py", RUNNER.lstrip("\n")))


class CodeRepairEnv(ToolEnv):
    """Repair a bug in a small Python package (see the module docstring)."""

    final_tool = "submit"

    def __init__(self, *, kinds: tuple[str, ...] | list[str] = KINDS, partial_credit: bool = False,
                 success_reward: float = 1.0, timeout_s: float = 5.0, sandbox_backend: str = "bwrap",
                 max_starting: int | None = None, max_tool_calls: int = 12, **kwargs) -> None:
        from turnforge.sandbox import Limits, Sandbox

        unknown = sorted(set(kinds) - set(KINDS))
        if unknown or not kinds:
            raise UserError(f"unknown bug kinds {unknown}; valid kinds: {', '.join(KINDS)}")
        kwargs.setdefault("max_steps", max_tool_calls + 2)
        kwargs.setdefault("max_output_chars", 3000)
        super().__init__(max_tool_calls=max_tool_calls, **kwargs)
        self.kinds, self.partial_credit, self.success_reward = tuple(sorted(kinds)), bool(partial_credit), float(success_reward)
        self.sandbox = Sandbox(Limits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s))), backend=sandbox_backend,
                               max_starting=max_starting)

    @property
    def instructions(self) -> str:
        return ("The package in pkg/ has a bug: some tests in tests/ fail. Find it, fix it with edit_file "
                "(search/replace), check with run_tests, then call submit.")

    def tool_functions(self):
        return [self.list_files, self.view_file, self.edit_file, self.run_tests, self.submit]

    # ------------------------------------------------------------------ tools
    def list_files(self) -> str:
        """List the files of the task."""
        return "\n".join(sorted(self.state["files"]))

    def view_file(self, path: str) -> str:
        """Show the content of a file.

        Args:
            path: the file's path, as list_files shows it
        """
        files = self.state["files"]
        if path not in files:
            return ToolError(f"error: no file {path!r}; files: {', '.join(sorted(files))}")
        return files[path]

    def edit_file(self, path: str, search: str, replace: str) -> str:
        """Replace the one occurrence of a text in a file of pkg/.

        Args:
            path: the file's path, under pkg/
            search: the exact text to replace; it must occur exactly once in the file
            replace: the new text
        """
        files = self.state["files"]
        if path not in files:
            return ToolError(f"error: no file {path!r}; files: {', '.join(sorted(files))}")
        if not path.startswith("pkg/"):
            return ToolError(f"error: {path} is read-only; only files under pkg/ can be edited")
        count = files[path].count(search) if search else 0
        if count != 1:
            why = "search is empty" if not search else f"search text found {count} times in {path}"
            return ToolError(f"error: {why}; give text that occurs exactly once (add neighbouring lines)")
        files[path] = files[path].replace(search, replace, 1)
        return f"edited {path}"

    def run_tests(self) -> str:
        """Run the unit tests in tests/ against the current files and show the results."""
        result = self._test(self.state["files"])
        text = result.stdout.strip() or "(no output)"
        if result.stderr.strip():
            text += "\nstderr:\n" + result.stderr.strip()
        if result.killed_reason:
            text += f"\nkilled: {result.killed_reason} limit"
        return text if _SUMMARY.search(result.stdout) and result.exit_code == 0 and not result.killed_reason else ToolError(text)

    def submit(self) -> str:
        """Submit the repaired package; the tests decide the reward. Ends the episode."""
        return "submitted"  # never called: ToolEnv ends the episode on final_tool and calls score()

    def _test(self, files: dict[str, str], pristine: RepairLevel | None = None):
        """Run the runner over ``files``; with ``pristine`` the tests and runner come from
        the level, not from the agent's copy."""
        if pristine is not None:
            files = {**files, **{p: t for p, t in pristine.files if not p.startswith("pkg/")}}
        return self.sandbox.run(["python3", "run_tests.py"], files=files)

    # ------------------------------------------------------------------ levels
    def generate_level(self, level_seed: int) -> RepairLevel:
        """A mutant of the catalogue, drawn uniformly (``level_for`` keeps the draws that fall in
        the asked split; the split is by seed function, ``split_of``)."""
        rng = random.Random(level_seed)
        seed_name, kind, site = rng.choice([m for m in catalogue(self.sandbox) if m[1] in self.kinds])
        seed = next(s for s in SEEDS if s.name == seed_name)
        original = normalize(seed.source)
        return RepairLevel(seed.name, kind, site, _task_files(seed, mutate(original, kind, site)), original)

    def level_key(self, level: RepairLevel) -> str:
        return f"{level.seed}/{level.kind}/{level.site}"

    def split_of(self, level: RepairLevel) -> str:
        return "heldout" if level.seed in HELDOUT else "train"

    def initial_state(self, level, rng):
        return {**super().initial_state(level, rng), "files": dict(level.files)}

    def question(self, level: RepairLevel) -> str:
        return f"Some tests fail. Files:\n{chr(10).join(p for p, _ in level.files)}"

    def score(self, level: RepairLevel, answer: str) -> tuple[float, bool]:
        result = self._test(self.state["files"], pristine=level)
        match = _SUMMARY.search(result.stdout)
        passed, failed = (int(match.group(1)), int(match.group(2))) if match and not result.killed_reason else (0, 1)
        won = failed == 0 and passed > 0
        if self.partial_credit:
            return self.success_reward * passed / max(passed + failed, 1), won
        return (self.success_reward if won else 0.0), won

    # ------------------------------------------------------------------ policies
    def expert_action(self) -> str:
        level = self.state["level"]
        path = f"pkg/{level.seed}.py"
        names = [name for name, _, _ in self.state["calls"]]
        if self.state["files"][path] != level.fixed:
            search, replace = _fix(self.state["files"][path], level.fixed)
            return self.call_text("edit_file", {"path": path, "search": search, "replace": replace})
        if "run_tests" not in names:
            return self.call_text("run_tests", {})
        return self.call_text("submit", {})

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random tool call with arguments drawn from the task's files (the
        random baseline): edits replace a random line of the package file by another of its
        lines or by itself with one character changed."""
        files = self.state["files"]
        tool = rng.choice(["list_files", "view_file", "edit_file", "run_tests", "submit"])
        if tool == "view_file":
            return self.call_text(tool, {"path": rng.choice(sorted(files))})
        if tool == "edit_file":
            path = f"pkg/{self.state['level'].seed}.py"
            lines = [line for line in files[path].splitlines() if line.strip()]
            line = rng.choice(lines)
            if rng.random() < 0.5:
                new = rng.choice(lines)
            else:
                i = rng.randrange(len(line))
                new = line[:i] + rng.choice("0123456789+-*<>=!") + line[i + 1:]
            return self.call_text(tool, {"path": path, "search": line, "replace": new})
        return self.call_text(tool, {})


def _failed(stdout: str) -> int:
    match = _SUMMARY.search(stdout)
    return int(match.group(2)) if match else 1


def _fix(current: str, fixed: str) -> tuple[str, str]:
    """(search, replace) that turns ``current`` into ``fixed``: the differing lines, widened by
    neighbouring lines until the search text occurs once."""
    a, b = current.splitlines(keepends=True), fixed.splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    i1, i2, j1, j2 = ops[0][1], ops[-1][2], ops[0][3], ops[-1][4]
    while True:
        search = "".join(a[i1:i2])
        if search and current.count(search) == 1:
            return search, "".join(b[j1:j2])
        i1, j1 = max(i1 - 1, 0), max(j1 - 1, 0)
        i2, j2 = min(i2 + 1, len(a)), min(j2 + 1, len(b))


# Tests every mutant in a forked child with a 0.5 s timer; prints one exit status per mutant
# (1: a test failed, the bug is caught; 0: an equivalent mutant; else: crashed or too slow).
_CATALOGUE_SCRIPT = """
import json, os, signal
statuses = []
for source, tests in json.load(open("jobs.json")):
    pid = os.fork()
    if pid == 0:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            ns = {}
            exec(source, ns)
            exec(tests, ns)
            failed = 0
            for name in sorted(k for k in ns if k.startswith("test_")):
                try:
                    ns[name]()
                except Exception:
                    failed += 1
            os._exit(1 if failed else 0)
        except BaseException:
            os._exit(3)
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(statuses))
"""
_CATALOGUE: tuple[tuple[str, str, int], ...] | None = None


def catalogue(sandbox) -> tuple[tuple[str, str, int], ...]:
    """Every (seed name, bug kind, site) whose mutant is a bug the seed's tests catch, in a
    fixed order; computed once per process with one run of ``sandbox``."""
    global _CATALOGUE
    if _CATALOGUE is None:
        candidates, jobs = [], []
        for seed in SEEDS:
            original = normalize(seed.source)
            for kind in KINDS:
                for site in range(count_sites(original, kind)):
                    module = mutate(original, kind, site)
                    if module != original:
                        candidates.append((seed.name, kind, site))
                        jobs.append((module, seed.tests))
        result = sandbox.run(["python3", "catalogue.py"], files={"catalogue.py": _CATALOGUE_SCRIPT,
                                                                 "jobs.json": json.dumps(jobs)}, timeout=120)
        if result.exit_code != 0:
            raise SandboxError(f"building the code-repair catalogue failed: {result.stderr.strip()[-300:]}")
        statuses = json.loads(result.stdout)
        _CATALOGUE = tuple(c for c, status in zip(candidates, statuses) if status == 1)
    return _CATALOGUE
