"""Paths the user chose for output: checked before any work, written whole or not at all.

Every check raises ``UserError`` (one line, exit 2) naming the path and what is wrong.

Sealed directories: a ``manifest.json`` with the size and sha256 of every file, written last
and fsynced, marks a directory (a checkpoint, a model) as complete (``seal``); ``verify`` names
the first file that is missing, truncated or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from turnforge.errors import UserError


def probe_writable(directory: Path, label: str) -> None:
    """Raise ``UserError`` unless a file can be created in ``directory``. The probe is an
    unnamed temporary file, gone when closed: nothing is left behind."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise UserError(f"{label}: cannot write in {str(directory)!r} ({err.strerror})") from None


def check_out_dir(path: Path, label: str) -> None:
    """A run directory to create or fill: not a file, under a writable directory."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{label} {str(path)!r} is a file, not a directory")
    existing = path
    while not existing.exists():  # the nearest existing ancestor: where the first mkdir happens
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{label} {str(path)!r}: {str(existing)!r} is a file, not a directory")
    probe_writable(existing, f"{label} {str(path)!r}")


def check_out_file(path: Path, label: str, *, refuse_existing: bool) -> None:
    """A JSON file to write: a regular file or a new name, in an existing writable directory;
    an existing one is refused when ``refuse_existing``."""
    if path.exists():
        if not path.is_file():
            kind = "a directory" if path.is_dir() else "not a regular file"
            raise UserError(f"{label} {str(path)!r} is {kind}; give the path of a file to write")
        if refuse_existing:
            raise UserError(f"{label} {str(path)!r} already exists; give --force to overwrite it")
    parent = path.parent
    if not parent.is_dir():
        what = f"directory {str(parent)!r} does not exist" if not parent.exists() else f"{str(parent)!r} is not a directory"
        raise UserError(f"{label} {str(path)!r}: {what}")
    probe_writable(parent, f"{label} {str(path)!r}")


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (str or bytes) to ``path`` through a temporary file, fsync and a rename (never half a file)."""
    target = Path(path).resolve()  # through a symlink to its file
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict) -> None:
    """``write_atomic`` of ``data`` as JSON; an OS error is a ``UserError`` naming the path."""
    try:
        write_atomic(path, json.dumps(data, indent=2) + "\n")
    except OSError as err:
        raise UserError(f"cannot write {str(path)!r}: {err.strerror}") from None


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# ------------------------------------------------------------------ sealed directories
MANIFEST = "manifest.json"


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def seal(directory: Path) -> None:
    """fsync every file of ``directory`` and write its manifest (last): from then on the
    directory is a complete checkpoint."""
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            fsync(p)
            files[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")
    fsync(directory / MANIFEST)
    fsync(directory)


def verify(directory: Path) -> str | None:
    """None when ``directory`` is a complete, intact checkpoint; else one line saying which
    file is missing, truncated or corrupt."""
    manifest = directory / MANIFEST
    if not directory.is_dir():
        return f"{directory} does not exist"
    if not manifest.exists():
        return f"{directory} is incomplete (no {MANIFEST}: the save was interrupted)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{manifest} is corrupt"
    for name, meta in files.items():
        p = directory / name
        if not p.exists():
            return f"{p} is missing"
        size = p.stat().st_size
        if size != meta["bytes"]:
            return f"{p} is truncated ({size} of {meta['bytes']} bytes)" if size < meta["bytes"] else f"{p} has the wrong size"
        if file_sha256(p) != meta["sha256"]:
            return f"{p} is corrupt (sha256 differs from {MANIFEST})"
    return None
