"""The bubblewrap command line: what a sandboxed program sees and who it runs as.

The program sees a read-only ``/usr`` (with the merged-/usr links ``/bin``, ``/lib``...) and,
from ``/etc``, only what the dynamic loader and Debian's python3 read, plus a synthetic
``passwd``, ``group`` and ``hosts``. It does not see ``/root``, ``/home``, ``/work``, the host's
``/tmp``, ``/var``, ``/run``, ``/sys`` or any run directory. It gets a fresh ``/proc`` of its own
pid namespace, a read-only minimal ``/dev`` with a ``/dev/shm`` tmpfs of ``disk_mb``, and a
private tmpfs of ``disk_mb`` holding its work dir (``/sandbox/work``: cwd and HOME) and ``/tmp``
(a link to ``/sandbox/tmp``); or, given another work dir (a terminal box's ``/app``), one tmpfs
of ``disk_mb`` there and one at ``/sandbox/tmp``. Nothing else is writable: bwrap's root tmpfs
is made read-only.

It runs as uid/gid 65534 in its own user, pid, network, ipc, uts and cgroup namespaces, with
no capabilities, no_new_privs, a new session, no further user namespaces and
``--die-with-parent``. When the caller is root, bwrap itself is started as host uid 65534
(``setpriv``): otherwise the sandbox uid maps to host root, which the kernel exempts from
RLIMIT_NPROC (the fork-bomb limit) and which owns every root file the sandbox can see.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Iterator

from turnforge.errors import UserError
from turnforge.sandbox.limits import MB, Limits

SANDBOX_UID = 65534
ROOT, WORK_DIR, TMP_DIR = "/sandbox", "/sandbox/work", "/sandbox/tmp"
INSTALL_HINT = "apt-get install -y bubblewrap"
MIN_VERSION = (0, 8, 0)  # --disable-userns and --size
_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
_NET_ETC = ("resolv.conf", "hosts", "nsswitch.conf", "gai.conf", "host.conf", "ssl", "ca-certificates")
_PASSWD = f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{WORK_DIR}:/bin/sh\n"
_GROUP = f"sandbox:x:{SANDBOX_UID}:\n"
_HOSTS = "127.0.0.1 localhost\n::1 localhost\n127.0.1.1 sandbox\n"


def program_env(home: str, tmp: str) -> dict[str, str]:
    """The program's whole environment: nothing of the caller's is passed on."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def find_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(f"{name} is not installed; the sandbox needs it: apt-get install -y {package}")
    return path


def launcher() -> tuple[str, ...]:
    """The command that starts bwrap: ``bwrap``, or ``setpriv ... bwrap`` to drop root first."""
    path = shutil.which("bwrap")
    if path is None:
        raise UserError(
            f"bubblewrap (bwrap) is not installed; the sandbox needs it: {INSTALL_HINT} "
            "(or Sandbox(backend='unsafe-none') for trusted code only)"
        )
    version = _version(path)
    if version < MIN_VERSION:
        raise UserError(
            f"bubblewrap {'.'.join(map(str, version))} at {path} is too old; the sandbox needs "
            f"{'.'.join(map(str, MIN_VERSION))} or newer (--disable-userns, --size)"
        )
    if os.geteuid() != 0:
        return (path,)
    setpriv = find_tool("setpriv", "util-linux")
    return (setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--", path)


@functools.cache
def _version(path: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError as err:
        raise UserError(f"cannot run {path}: {err}; reinstall it: {INSTALL_HINT}") from err
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if found is None:
        raise UserError(f"{path} --version printed {out.strip()!r}, not a bubblewrap version; reinstall it: {INSTALL_HINT}")
    return tuple(int(x) for x in found.groups())


@functools.cache
def _system_view() -> tuple[str, ...]:
    """Read-only binds of the host system, decided once per process."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for name in _LINKS:
        host = Path("/", name)
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    for name in (*_ETC, *sorted(p.name for p in Path("/etc").glob("python3*"))):
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return tuple(argv)


def unreadable(path: str) -> str | None:
    """The first part of ``path`` that the sandbox's user cannot open (None if it can).

    Only a root caller drops to uid 65534 (see ``launcher``); any other caller's sandbox
    reads what the caller reads. For root, every directory on the way needs the "other"
    execute bit, and the path itself the "other" read bit (and execute, for a directory)."""
    if os.geteuid() != 0:
        return None
    parts = Path(path).resolve().parts
    for i in range(1, len(parts) + 1):
        part = Path(*parts[:i])
        try:
            mode = part.stat().st_mode
        except OSError:
            return str(part)
        last = i == len(parts)
        need = (0o4 | (0o1 if part.is_dir() else 0)) if last else 0o1
        if mode & need != need:
            return str(part)
    return None


@contextlib.contextmanager
def command(launch: tuple[str, ...], limits: Limits, files: dict[PurePosixPath, bytes], binds: tuple[str, ...] = (),
            env: dict[str, str] | None = None, *, workdir: str = WORK_DIR, extra_dirs: tuple[str, ...] = (),
            ro_files: dict[str, bytes] | None = None, as_pid_1: bool = False) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """The bwrap command line up to ``--``, and the memfds bwrap copies files from (closed on exit).

    ``binds``: host paths shown read-only at the same place (a Python environment for an MCP
    server); ``env``: variables added to the program's scrubbed environment; ``workdir``: an
    absolute path other than ``WORK_DIR`` becomes a private tmpfs of ``disk_mb`` of its own (cwd,
    HOME and where ``files`` land) and /sandbox/tmp another, /sandbox itself staying read-only;
    ``extra_dirs``: absolute paths made private tmpfs of ``disk_mb`` too; ``ro_files``: read-only
    files at absolute paths (path -> content); ``as_pid_1``: the program is the pid namespace's
    init (bwrap's ``--as-pid-1``): no process of the sandbox can signal it, and when it exits
    every other process of the sandbox dies."""
    fds: list[int] = []

    def data(content: bytes) -> str:
        fd = os.memfd_create("turnforge-sandbox")
        fds.append(fd)
        with open(fd, "wb", closefd=False) as f:
            f.write(content)
        os.lseek(fd, 0, os.SEEK_SET)
        return str(fd)

    try:
        uid = str(SANDBOX_UID)
        argv = [
            *launch, "--unshare-all", "--unshare-user", "--uid", uid, "--gid", uid, "--disable-userns",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
            *_system_view(),
        ]
        if limits.network:
            argv.append("--share-net")
            for name in _NET_ETC:
                argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        else:
            argv += ["--ro-bind-data", data(_HOSTS.encode()), "/etc/hosts"]
        argv += [
            "--ro-bind-data", data(_PASSWD.replace(WORK_DIR, workdir).encode()), "/etc/passwd",
            "--ro-bind-data", data(_GROUP.encode()), "/etc/group",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(limits.disk_mb * MB), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
        ]
        size = str(limits.disk_mb * MB)
        if workdir == WORK_DIR:
            argv += ["--size", size, "--tmpfs", ROOT, "--dir", WORK_DIR, "--dir", TMP_DIR]
        else:
            argv += ["--size", size, "--tmpfs", TMP_DIR, "--size", size, "--tmpfs", workdir]
        for path in extra_dirs:
            argv += ["--size", size, "--tmpfs", path]
        # /tmp -> sandbox/tmp, relative: a bind under /tmp (a venv in /tmp) resolves inside the new root
        argv += ["--symlink", TMP_DIR.lstrip("/"), "/tmp"]
        for parent in sorted({p.parent for p in files} - {PurePosixPath(".")}):
            argv += ["--dir", f"{workdir}/{parent}"]
        for path, content in files.items():
            argv += ["--file", data(content), f"{workdir}/{path}"]
        for path in binds:
            argv += ["--ro-bind", path, path]
        for path, content in (ro_files or {}).items():
            argv += ["--ro-bind-data", data(content), path]
        # Last: the root (bwrap's own tmpfs, holding /etc and the mount points) becomes read-only.
        argv += ["--remount-ro", "/", "--chdir", workdir, "--clearenv"]
        if as_pid_1:
            argv.append("--as-pid-1")
        for key, value in {**program_env(workdir, "/tmp"), **(env or {})}.items():
            argv += ["--setenv", key, value]
        yield [*argv, "--"], tuple(fds)
    finally:
        for fd in fds:
            os.close(fd)
