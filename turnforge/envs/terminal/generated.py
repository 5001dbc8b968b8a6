"""Generated shell tasks for the ``terminal`` env: small, exactly checked jobs (create a file, count
matching lines, archive a directory, sum a CSV column...) for training small models with
imitation and then RL.

A task is named by ``{"source": "generated", "family": F, "level": L, "seed": S}`` (its
``task.data``); ``build_task`` turns that into a ``TerminalTask`` the same way every time. The
family (``FAMILIES``, one function per family under ``families/``) draws the workspace under /app
(distractor files included), a one- or two-sentence instruction naming absolute paths, the
reference commands (1 to 3, one per turn: coreutils, grep, sed, mawk, find, tar, python3; never
jq or gawk) and the checks. Levels: 1, one command on flat paths; 2, nested paths and more
distractors; 3, two steps or a pipeline.

The hidden tests are ``/tests/test.sh``, which runs ``/tests/check.py``: one fixed checker
program (``CHECK_PY``, stdlib only, for Debian's python3) with the family's checks and expected
answers baked in as JSON. It writes 1 to /logs/verifier/reward.txt when every check passes, else 0,
and checks only what the instruction asks (a trailing newline is tolerated).

``ShellTasks`` splits them. The train split draws only train families. The held-out split draws
its family uniformly from all families: every instance of a held-out family (``Family.heldout``: the train
skills recombined, to measure transfer), and the instances of train families whose content hash
(of the built task, not of the seed) falls in the held-out share, so a held-out instance is never
a train task under another seed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
from typing import Any, Mapping, Sequence

from turnforge.envs.tasks import TaskSource
from turnforge.envs.terminal.families import FAMILIES, Check, Family
from turnforge.envs.terminal.task import REWARD_TXT, TESTS_DIR, VERIFIER_LOGS, TaskFile, TerminalTask
from turnforge.errors import UserError
from turnforge.seeding import stable_hash
from turnforge.types import SPLITS, Task

LEVELS = (1, 2, 3)
HELDOUT_LABEL = "heldout"  # task_label's prefix for held-out families: "heldout/largest_file"

TEST_SH = f"#!/bin/bash\npython3 {TESTS_DIR}/check.py\n".encode()

CHECK_PY = '''"""Scores the final /app of a generated shell task: writes 1 (every check passed) or 0 to
REWARD_TXT and prints the checks that failed."""
import json
import os
import subprocess
import tarfile

CHECKS = json.loads(CHECKS_JSON)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def text(c):
    return read(c["path"]).rstrip("\\n") == c["expected"].rstrip("\\n")


def lines(c):  # in any order, blank lines ignored
    return sorted(line for line in read(c["path"]).splitlines() if line) == sorted(c["expected"])


def is_dir(c):
    return os.path.isdir(c["path"])


def absent(c):
    return not os.path.lexists(c["path"])


def mode(c):
    return os.stat(c["path"]).st_mode & c["mask"] == c["expected"]


def tar(c):
    with tarfile.open(c["path"], "r:gz") as archive:
        members = [m for m in archive.getmembers() if m.isfile()]
        got = {m.name.removeprefix("./"): archive.extractfile(m).read().decode() for m in members}
    return got == c["expected"]


def run(c):
    for path, data in c["inputs"]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(data)
    program = subprocess.Popen([c["path"], *c["args"]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               cwd="/app", start_new_session=True)
    try:
        out, _ = program.communicate(timeout=5)
    finally:  # nothing it started outlives the check (a background job could rewrite the reward)
        try:
            os.killpg(program.pid, 9)
        except ProcessLookupError:
            pass
    return out.rstrip("\\n") == c["expected"].rstrip("\\n")


KINDS = {"text": text, "lines": lines, "dir": is_dir, "absent": absent, "mode": mode, "tar": tar, "run": run}


def passes(c):
    try:
        return KINDS[c["kind"]](c)
    except Exception as err:  # whatever the agent left (no file, a directory, a broken archive) fails the check
        print(f"{c['kind']} {c['path']}: {type(err).__name__}: {err}")
        return False


failed = [c for c in CHECKS if not passes(c)]
for c in failed:
    print(f"failed: {c['kind']} {c['path']}")
os.makedirs("VERIFIER_LOGS", exist_ok=True)
with open("REWARD_TXT", "w") as f:
    f.write("0\\n" if failed else "1\\n")
'''.replace("REWARD_TXT", REWARD_TXT).replace("VERIFIER_LOGS", VERIFIER_LOGS)


def checker(checks: Sequence[Check]) -> bytes:
    """``CHECK_PY`` with ``checks`` baked in."""
    payload = json.dumps([dataclasses.asdict(c) for c in checks], sort_keys=True)
    return CHECK_PY.replace("CHECKS_JSON", repr(payload)).encode()


def _parse(data: Mapping[str, Any]) -> tuple[str, int, int]:
    if data.get("source") != "generated":
        raise UserError(f"generated shell task: data {dict(data)!r} is not a generated task (its source must be 'generated')")
    family, level, seed = data.get("family"), data.get("level"), data.get("seed")
    if family not in FAMILIES:
        raise UserError(f"generated shell task: unknown family {family!r}; valid families: {', '.join(sorted(FAMILIES))}")
    if level not in LEVELS:
        raise UserError(f"generated shell task: level {level!r}; valid levels: 1, 2, 3")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"generated shell task: seed {seed!r} must be an integer")
    return family, level, seed


def build_task(data: Mapping[str, Any]) -> TerminalTask:
    """The ``TerminalTask`` that ``data`` ({"source": "generated", "family", "level", "seed"})
    names, byte-identical on every call and in every process."""
    return _build(*_parse(data))


@functools.lru_cache(maxsize=4096)
def _build(family: str, level: int, seed: int) -> TerminalTask:
    draft = FAMILIES[family].build(random.Random(stable_hash("shell-task", family, level, seed)), level)
    files = tuple(TaskFile(path, content if isinstance(content, bytes) else content.encode())
                  for path, content in sorted(draft.files.items()))
    return TerminalTask(
        name=f"{family}-{level}-{seed}",
        instruction=draft.instruction,
        tests=(TaskFile(f"{TESTS_DIR}/test.sh", TEST_SH, 0o755), TaskFile(f"{TESTS_DIR}/check.py", checker(draft.checks))),
        workdir="/app",
        writable=("/app",),
        files=files,
        expert_commands=draft.commands,
        family=family,
        difficulty=level,
        agent_timeout_s=120.0,
        verifier_timeout_s=20.0,
        command_timeout_s=10.0,
        metadata=(("source", "generated"), ("seed", str(seed))),
    )


def fingerprint(task: TerminalTask) -> str:
    """A hash of what the agent and the verifier see (instruction, files, tests), not of the seed:
    two seeds that build the same task have the same fingerprint."""
    content = repr((task.family, task.difficulty, task.instruction, task.files, task.tests))
    return hashlib.blake2b(content.encode(), digest_size=12).hexdigest()


class ShellTasks(TaskSource):
    """Generated shell tasks split for measuring transfer (see the module docstring).

    ``families``: the train families (default: every family not marked held-out);
    ``heldout_families``: families seen in the held-out split only (default: those marked);
    ``levels``: the levels drawn; ``heldout_fraction``: the share of train families' instances
    kept for the held-out split (by content hash). ``task.data`` is the small dict
    ``build_task`` reads; ``size`` is None (unbounded)."""

    def __init__(self, families: Sequence[str] | None = None, heldout_families: Sequence[str] | None = None,
                 levels: Sequence[int] = LEVELS, heldout_fraction: float = 0.1, cache_size: int = 4096) -> None:
        marked = tuple(n for n, f in FAMILIES.items() if f.heldout)
        self.heldout_families = _names("heldout_families", marked if heldout_families is None else heldout_families)
        self.families = _names("families", tuple(n for n in FAMILIES if n not in self.heldout_families)
                               if families is None else families)
        both = sorted(set(self.families) & set(self.heldout_families))
        if both:
            raise UserError(f"ShellTasks: {both} are both train and held-out families; a held-out family must not be trained on")
        if not self.families:
            raise UserError("ShellTasks: no train families; name at least one in families")
        if not levels or any(level not in LEVELS for level in levels):
            raise UserError(f"ShellTasks: levels {list(levels)!r}; give a non-empty subset of [1, 2, 3]")
        if not 0.0 <= heldout_fraction < 1.0 or (heldout_fraction == 0.0 and not self.heldout_families):
            raise UserError(f"ShellTasks: heldout_fraction {heldout_fraction} must be in [0, 1), and above 0 when there are "
                            "no held-out families (the held-out split would be empty)")
        self.levels, self.heldout_fraction, self.cache_size = tuple(sorted(set(levels))), heldout_fraction, cache_size
        self._cache: dict[tuple[str, int], dict[str, Any]] = {}

    def task(self, split: str, index: int) -> Task:
        if split not in SPLITS:
            raise UserError(f"ShellTasks: split {split!r}; valid splits: 'heldout', 'train'")
        key = (split, index)
        if key not in self._cache:
            if len(self._cache) >= self.cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self._draw(split, index)
        return Task("", split, index, dict(self._cache[key]))  # type: ignore[arg-type]

    def _draw(self, split: str, index: int) -> dict[str, Any]:
        """The family and level drawn uniformly, then seeds until the task falls in ``split`` (so a
        family's share of a split does not depend on heldout_fraction)."""
        rng = random.Random(stable_hash("shell-tasks", split, index))
        pool = self.families if split == "train" else self.families + self.heldout_families
        family, level = rng.choice(pool), rng.choice(self.levels)
        for _ in range(10_000):
            data = {"source": "generated", "family": family, "level": level, "seed": rng.randrange(2**31)}
            if self.split_of(data) == split:
                return data
        raise UserError(f"ShellTasks: no {split} task of {family} level {level} in 10000 seeds; raise heldout_fraction")

    def split_of(self, data: Mapping[str, Any]) -> str:
        """'heldout' for every instance of a held-out family; otherwise by the built task's fingerprint."""
        if data["family"] in self.heldout_families:
            return "heldout"
        share = stable_hash("shell-split", fingerprint(build_task(data))) % 10_000
        return "heldout" if share < self.heldout_fraction * 10_000 else "train"

    def size(self, split: str) -> None:
        return None

    def key(self, task: Task) -> str:
        """The built task's fingerprint: equal keys mean the agent and the verifier see the same task."""
        return fingerprint(build_task(task.data or {}))

    def is_heldout_family(self, task: Task) -> bool:
        return (task.data or {}).get("family") in self.heldout_families

    def task_label(self, task: Task) -> str:
        """The task's family, as ``heldout/FAMILY`` for a held-out family (evaluations report success per label)."""
        family = str((task.data or {}).get("family", ""))
        return f"{HELDOUT_LABEL}/{family}" if self.is_heldout_family(task) else family


def _names(what: str, names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        names = [names]
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        raise UserError(f"ShellTasks: unknown {what} {unknown}; valid families: {', '.join(sorted(FAMILIES))}")
    return tuple(dict.fromkeys(names))


__all__ = ["FAMILIES", "Family", "LEVELS", "ShellTasks", "build_task", "checker", "fingerprint"]
