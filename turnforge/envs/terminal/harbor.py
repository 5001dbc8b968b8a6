"""Harbor task directories (Terminal-Bench 2.0's format) as terminal tasks, run on this host.

A task directory holds ``instruction.md`` (the prompt), ``task.toml`` (timeouts and resources),
``environment/Dockerfile`` (how its machine is made), ``tests/test.sh`` (the verifier, which
writes ``/logs/verifier/reward.txt`` or ``reward.json``) and, optionally, ``solution/solve.sh``
(the reference solution, this env's expert). ``env.tasks=DIR`` reads ``DIR`` itself when it is a
task, else every task directory under it.

There is no container here: the task runs in the ``terminal`` env's bubblewrap box on the host's
own system, so only a Dockerfile that picks a Debian, Ubuntu or Python base and then sets up
files can be honoured: ``FROM`` (those bases), ``WORKDIR`` (the agent's cwd; its top directory
becomes writable), ``COPY``/``ADD`` of files of ``environment/`` (a local tar archive is
unpacked, as ``ADD`` does), ``ENV``, ``ARG`` (defaults substituted), ``RUN`` (run in the box at
build time, with the offline stand-ins of ``shims/`` on its PATH: ``apt-get install`` of a package
this host has succeeds, nothing is downloaded), and ``LABEL``/``CMD``/``EXPOSE``/``VOLUME``
(ignored: Harbor itself replaces the command with ``sleep infinity``). Anything else — another
base system, a package to install, a download, a service (``ENTRYPOINT``, ``HEALTHCHECK``),
another user, a docker-compose file — refuses the task with one line naming the task, the file
and the line (``TaskRefused``). ``tests/test.sh`` and ``solution/solve.sh`` are screened the same
way, since the verifier has no network either: the uv installer, ``uvx ... pytest`` and ``pip
install`` of pytest run offline (Debian's ``python3-pytest``; the ``--ctrf`` report is dropped when
its plugin is missing), any other package must already be importable by the sandbox's python3.

Departures from Harbor: the box's python is the host's (Debian's 3.11 here, where a task's image
may hold 3.13); commands run as the sandbox's unprivileged user, not root; ``[environment]``'s
``cpus`` is not enforced (memory and disk are, disk capped at the env's ``max_disk_mb``).
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import tarfile
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from turnforge.envs.tasks import TaskSource, _bucket
from turnforge.envs.terminal.task import SOLUTION_DIR, TESTS_DIR, TaskFile, TerminalTask
from turnforge.errors import UserError
from turnforge.types import SPLITS, Task

#: The base images whose system this host stands in for.
BASES = ("debian", "ubuntu", "python")
#: Top-level directories a task may not write to (the sandbox keeps the host's system read-only).
SYSTEM_DIRS = frozenset({"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root", "run", "sbin",
                         "sys", "usr", "var", "tmp"})
REQUIRED = ("instruction.md", "task.toml", "environment", "tests/test.sh")
_IGNORED = {"LABEL", "MAINTAINER", "CMD", "EXPOSE", "VOLUME", "STOPSIGNAL", "SHELL"}
#: Python packages the verifier provides offline (Debian's python3-pytest); a report plugin is dropped.
OFFLINE_PYTHON = {"pytest", "pytest-json-ctrf"}
_NETWORK = re.compile(r"\b(git\s+clone|npm\s+(install|i|ci)\b|cargo\s+install|go\s+install|gem\s+install|"
                      r"conda\s+install|pip3?\s+download|uv\s+(add|sync|pip\s+install))")
_UVX_WITH = re.compile(r"(?:-w|--with)(?:\s+|=)(\S+)")


class TaskRefused(UserError):
    """A Harbor task this host cannot run faithfully: one line naming the task, the file, the line and why."""


@dataclass(frozen=True)
class _Line:
    number: int  # the first line of the instruction (after joining continuation lines)
    op: str
    args: str


def dockerfile_lines(text: str) -> list[_Line]:
    """The instructions of a Dockerfile: continuation lines joined, comments and blank lines dropped."""
    out, pending, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        start = start or n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        op, _, args = whole.partition(" ")
        out.append(_Line(start, op.upper(), args.strip()))
        start = 0
    if pending:
        op, _, args = pending.strip().partition(" ")
        out.append(_Line(start, op.upper(), args.strip()))
    return out


@functools.lru_cache(maxsize=None)
def host_has_package(package: str) -> bool:
    """Whether the Debian package ``package`` is installed here (or a command of that name exists)."""
    try:
        status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if "install ok installed" in status.stdout:
        return True
    return any(Path(d, package).exists() for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"))


@functools.lru_cache(maxsize=None)
def sandbox_python_has(distribution: str) -> bool:
    """Whether the sandbox's python3 (the host's /usr/bin/python3, which the box sees) has ``distribution``."""
    name = re.split(r"[=<>!~\[ ]", distribution.strip(), maxsplit=1)[0]
    if not name:
        return True
    probe = "import importlib.metadata as m, sys\ntry: m.version(sys.argv[1])\nexcept m.PackageNotFoundError: sys.exit(1)"
    try:
        return subprocess.run(["/usr/bin/python3", "-c", probe, name], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _segments(command: str) -> list[list[str]]:
    """The simple commands of a shell line (split at ``;``, ``&&``, ``||``, ``|``, ``$(``, backticks), as
    words, with leading ``VAR=value`` assignments and ``sudo`` dropped."""
    out = []
    for part in re.split(r"&&|\|\||[;|`]|\$\(|\)", command):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            words = part.split()
        while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]) or words[0] in ("sudo", "exec", "time")):
            words = words[1:]
        if words:
            out.append(words)
    return out


def screen_command(command: str, where: str) -> None:
    """Refuse a shell command that needs the network or what the host lacks (``where``: the task,
    file and line, for the message). The uv installer and pytest are provided offline."""
    net = _NETWORK.search(command)
    if net:
        raise TaskRefused(f"{where}: {net.group(0)!r} needs the network, which the sandbox does not have")
    for words in _segments(command):
        head, args = words[0].rsplit("/", 1)[-1], [w for w in words[1:] if not w.startswith("-")]
        if head in ("curl", "wget") and not any("astral.sh/uv" in w for w in words):
            raise TaskRefused(f"{where}: {' '.join(words)[:80]!r} needs the network, which the sandbox does not have")
        if head in ("pip", "pip3") or words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
            rest = words[words.index("pip") + 1:] if "pip" in words else words[1:]
            if rest[:1] == ["install"]:
                missing = [p for p in rest[1:] if not p.startswith("-") and p.split("==")[0] not in OFFLINE_PYTHON
                           and not sandbox_python_has(p)]
                if missing:
                    raise TaskRefused(f"{where}: pip install {' '.join(missing)} needs the network (the sandbox's python3 "
                                      f"lacks {missing[0].split('==')[0]})")
        if head in ("apt-get", "apt") and args[:1] == ["install"]:
            missing = [p.split("=")[0] for p in args[1:] if not host_has_package(p.split("=")[0])]
            if missing:
                raise TaskRefused(f"{where}: apt-get install of {', '.join(missing)}, which this host lacks (no network to "
                                  f"install it; `apt-get install -y {' '.join(missing)}` on the host would do)")
        if head == "uvx":
            extra = [w for w in _UVX_WITH.findall(" ".join(words)) if w.split("==")[0] not in OFFLINE_PYTHON]
            missing = [w for w in extra if not sandbox_python_has(w)]
            if missing:
                raise TaskRefused(f"{where}: uvx --with {missing[0]} needs the network (the sandbox's python3 lacks "
                                  f"{missing[0].split('==')[0]})")


def _screen_script(text: str, where: str) -> None:
    joined = re.sub(r"\\\n", " ", text)
    for n, line in enumerate(joined.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            screen_command(line, f"{where} line {n}")


def _memory_mb(env: dict) -> int:
    if "memory_mb" in env:
        return int(env["memory_mb"])
    text = str(env.get("memory", "2G")).strip().upper()
    units = {"G": 1024, "M": 1, "K": 1 / 1024}
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(float(text or 2048))


def _copy(task: str, line: _Line, context: Path, cwd: str, args: dict[str, str], dirs: set[str]) -> list[TaskFile]:
    """The files a ``COPY``/``ADD`` line puts in the machine (``dirs``: the directories known to
    exist, the WORKDIRs: a destination that is one receives the sources inside it, as Docker does)."""
    words = [w for w in shlex.split(_substitute(line.args, args)) if not w.startswith("--")]
    if len(words) < 2:
        raise TaskRefused(f"task {task}: environment/Dockerfile line {line.number}: {line.op} needs a source and a destination")
    *sources, dest = words
    target = PurePosixPath(dest) if dest.startswith("/") else PurePosixPath(cwd) / dest
    files: list[TaskFile] = []
    for source in sources:
        if re.match(r"[a-z]+://", source):
            raise TaskRefused(f"task {task}: environment/Dockerfile line {line.number}: {line.op} {source} downloads a file; "
                              "the sandbox has no network")
        found = sorted(context.glob(source)) if any(c in source for c in "*?[") else [context / source]
        for path in found:
            if not path.exists() or not path.resolve().is_relative_to(context.resolve()):
                raise TaskRefused(f"task {task}: environment/Dockerfile line {line.number}: {line.op} source {source!r} "
                                  "is not a file of environment/")
            into_dir = dest.endswith("/") or str(target) in dirs or len(sources) > 1 or len(found) > 1 or path.is_dir()
            if line.op == "ADD" and path.is_file() and tarfile.is_tarfile(path):
                files += _untar(path, target)
            elif path.is_dir():
                for f in sorted(p for p in path.rglob("*") if p.is_file()):
                    files.append(TaskFile(str(target / f.relative_to(path)), f.read_bytes(), f.stat().st_mode & 0o777))
            else:
                out = target / path.name if into_dir else target
                files.append(TaskFile(str(out), path.read_bytes(), path.stat().st_mode & 0o777))
    return files


def _untar(path: Path, target: PurePosixPath) -> list[TaskFile]:
    out = []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if member.isfile():
                data = tar.extractfile(member)
                out.append(TaskFile(str(target / member.name.lstrip("./")), data.read() if data else b"", member.mode & 0o777))
    return out


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def _environment(task: str, root: Path) -> tuple[str, tuple[TaskFile, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(workdir, files, setup commands, env) of ``environment/Dockerfile``; ``TaskRefused`` naming the line."""
    env_dir = root / "environment"
    for compose in ("docker-compose.yaml", "docker-compose.yml"):
        if (env_dir / compose).exists():
            raise TaskRefused(f"task {task}: environment/{compose}: a compose file starts services; the sandbox runs one shell")
    dockerfile = env_dir / "Dockerfile"
    if not dockerfile.is_file():
        raise TaskRefused(f"task {task}: environment/Dockerfile is missing (a task's machine is made from it)")
    cwd, files, setup, env, args, dirs = "/", [], [], [], {}, {"/"}
    for line in dockerfile_lines(dockerfile.read_text()):
        where = f"task {task}: environment/Dockerfile line {line.number}"
        if line.op == "FROM":
            image = line.args.split()[0].split("/")[-1].split(":")[0] if line.args else ""
            if image not in BASES:
                raise TaskRefused(f"{where}: FROM {line.args} needs another system than this host's (the sandbox runs "
                                  f"tasks based on {', '.join(BASES)} images)")
        elif line.op == "WORKDIR":
            path = _substitute(line.args, args)
            cwd = str(PurePosixPath(cwd) / path) if not path.startswith("/") else path
            dirs.update(str(p) for p in (PurePosixPath(cwd), *PurePosixPath(cwd).parents))
        elif line.op in ("COPY", "ADD"):
            if "--from" in line.args:
                raise TaskRefused(f"{where}: {line.op} --from copies from another image; the sandbox has none")
            files += _copy(task, line, env_dir, cwd, args, dirs)
        elif line.op == "ENV":
            env += _env_pairs(_substitute(line.args, args))
        elif line.op == "ARG":
            name, _, default = line.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
        elif line.op == "RUN":
            command = _substitute(line.args, args)
            if command.startswith("["):
                raise TaskRefused(f"{where}: RUN in exec form is not supported; write it as a shell command")
            screen_command(command, where)
            for script in _scripts_run(command, cwd, files):  # a copied script the line runs is screened too
                _screen_script(script.data.decode(errors="replace"), f"{where} (runs {script.path})")
            setup.append(f"cd {shlex.quote(cwd)} && {command}" if cwd != "/" else command)
        elif line.op == "USER":
            if line.args.split(":")[0] not in ("root", "0"):
                raise TaskRefused(f"{where}: USER {line.args}: the sandbox runs every command as one unprivileged user")
        elif line.op not in _IGNORED:
            raise TaskRefused(f"{where}: {line.op} {line.args[:40]} needs a container (the sandbox runs one shell, "
                              "no service or entry point)")
    if cwd == "/":
        raise TaskRefused(f"task {task}: environment/Dockerfile sets no WORKDIR (the agent and the tests run in it)")
    return cwd, tuple(files), tuple(setup), tuple(env)


def _scripts_run(command: str, cwd: str, files: list[TaskFile]) -> list[TaskFile]:
    """The task's shell scripts that ``command`` runs (``bash FILE``, ``sh FILE``, ``./FILE``)."""
    by_path = {f.path: f for f in files}
    out = []
    for words in _segments(command):
        for word in words[1:] if words[0] in ("bash", "sh") else words[:1]:
            path = word if word.startswith("/") else str(PurePosixPath(cwd) / word)
            if path in by_path:
                out.append(by_path[path])
    return out


def _env_pairs(text: str) -> list[tuple[str, str]]:
    words = shlex.split(text)
    if words and "=" not in words[0]:  # ENV KEY value...
        return [(words[0], " ".join(words[1:]))]
    return [tuple(w.split("=", 1)) for w in words if "=" in w]  # type: ignore[misc]


def _writable(task: str, workdir: str, files: tuple[TaskFile, ...]) -> tuple[str, ...]:
    tops = {PurePosixPath(workdir).parts[1]} | {PurePosixPath(f.path).parts[1] for f in files}
    bad = sorted(t for t in tops if t in SYSTEM_DIRS)
    if bad:
        raise TaskRefused(f"task {task}: environment/Dockerfile writes into /{bad[0]}, which the sandbox keeps read-only "
                          "(a task's files live in its own directories, e.g. /app)")
    return tuple(sorted(f"/{t}" for t in tops))


def _dir_files(directory: Path, under: str) -> tuple[TaskFile, ...]:
    return tuple(TaskFile(f"{under}/{p.relative_to(directory)}", p.read_bytes(), p.stat().st_mode & 0o777)
                 for p in sorted(directory.rglob("*")) if p.is_file())


def read_task(root: Path, max_disk_mb: int = 512) -> TerminalTask:
    """The Harbor task in directory ``root`` (see the module docstring); ``TaskRefused`` (a
    ``UserError``: one line, exit 2) naming the task and file when it cannot run here."""
    name = root.name
    for required in REQUIRED:
        if not (root / required).exists():
            raise TaskRefused(f"task {name}: {required} is missing (a Harbor task has instruction.md, task.toml, "
                              "environment/ and tests/test.sh)")
    try:
        config = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as err:
        raise TaskRefused(f"task {name}: task.toml is malformed TOML ({err})") from None
    sections = {k: config.get(k, {}) for k in ("metadata", "verifier", "agent", "environment")}
    bad = [k for k, v in sections.items() if not isinstance(v, dict)]
    if bad:
        raise TaskRefused(f"task {name}: task.toml [{bad[0]}] must be a table")
    workdir, files, setup, env = _environment(name, root)
    test_sh = (root / "tests/test.sh").read_text()
    _screen_script(test_sh, f"task {name}: tests/test.sh")
    solution = root / "solution"
    solve = solution / "solve.sh"
    if solve.is_file():
        _screen_script(solve.read_text(), f"task {name}: solution/solve.sh")
    meta = sections["metadata"]
    try:
        return TerminalTask(
            name=name, instruction=(root / "instruction.md").read_text().strip(),
            tests=_dir_files(root / "tests", TESTS_DIR), test_command=f"bash {TESTS_DIR}/test.sh",
            workdir=workdir, writable=_writable(name, workdir, files), files=files, setup=setup, env=env,
            solution=_dir_files(solution, SOLUTION_DIR) if solve.is_file() else (),
            solve_command=f"bash {SOLUTION_DIR}/solve.sh" if solve.is_file() else None,
            reward="fraction", family=str(meta.get("category", "")), difficulty={"easy": 1, "medium": 2, "hard": 3}.get(meta.get("difficulty"), 2),
            agent_timeout_s=float(sections["agent"].get("timeout_sec", 600.0)),
            verifier_timeout_s=float(sections["verifier"].get("timeout_sec", 600.0)),
            memory_mb=_memory_mb(sections["environment"]), disk_mb=max_disk_mb,
            metadata=tuple((k, str(v)) for k, v in sorted(meta.items())),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise TaskRefused(f"task {name}: task.toml: {err}") from None


def task_dirs(path: Path) -> list[Path]:
    """``path`` itself when it is a task directory, else its task subdirectories (sorted)."""
    if (path / "task.toml").exists():
        return [path]
    found = sorted(p for p in path.iterdir() if p.is_dir() and (p / "task.toml").exists()) if path.is_dir() else []
    if not found:
        raise UserError(f"env.tasks={str(path)!r} is not a Harbor task directory and holds none (a task directory "
                        "has task.toml, instruction.md, environment/ and tests/test.sh)")
    return found


class HarborTasks(TaskSource):
    """The Harbor tasks under a directory (``task_dirs``), each read and screened up front, so a
    task that cannot run is one line before any work. Splits: a task's ``[metadata] split`` when
    it has one ('train' or 'heldout'), else by a hash of its name with ``heldout_fraction``
    (required then). ``task.data`` is ``{"source": "harbor", "path": DIR}``; ``read(task)`` gives
    its ``TerminalTask``."""

    def __init__(self, path: str | Path, *, heldout_fraction: float | None = None, max_disk_mb: int = 512) -> None:
        self.root = Path(path).expanduser().resolve()
        self.tasks: dict[str, TerminalTask] = {}
        self.rows: dict[str, list[str]] = {s: [] for s in SPLITS}
        for d in task_dirs(self.root):
            task = read_task(d, max_disk_mb)
            split = dict(task.metadata).get("split")
            if split is None:
                if heldout_fraction is None:
                    raise UserError(f"task {task.name}: task.toml has no [metadata] split; set env.heldout_fraction=F to "
                                    "split the tasks by name (1 for evaluation only)")
                split = "heldout" if heldout_fraction >= 1 else _bucket(task.name, heldout_fraction)
            if split not in SPLITS:
                raise UserError(f"task {task.name}: task.toml [metadata] split={split!r}; valid: 'train', 'heldout'")
            self.tasks[str(d)] = task
            self.rows[split].append(str(d))

    def task(self, split: str, index: int) -> Task:
        rows = self.rows[split]
        if not rows:
            raise UserError(f"the Harbor tasks under {str(self.root)!r} have no {split} task")
        i = index % len(rows)
        return Task("", split, i, {"source": "harbor", "path": rows[i]})  # type: ignore[arg-type]

    def size(self, split: str) -> int:
        return len(self.rows[split])

    def key(self, task: Task) -> str:
        return str((task.data or {}).get("path"))

    def read(self, data: dict) -> TerminalTask:
        return self.tasks[data["path"]]


def with_limits(task: TerminalTask, command_timeout_s: float) -> TerminalTask:
    """``task`` with a command timeout no longer than ``command_timeout_s``."""
    return replace(task, command_timeout_s=min(task.command_timeout_s, command_timeout_s))


__all__ = ["BASES", "HarborTasks", "TaskRefused", "dockerfile_lines", "read_task", "screen_command", "task_dirs"]
