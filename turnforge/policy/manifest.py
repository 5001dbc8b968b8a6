"""Sealed directories: a ``manifest.json`` with the size and sha256 of every file, written
last and fsynced, marks a directory (a checkpoint, a model) as complete; ``verify`` names
the first file that is missing, truncated or corrupt."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
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
            files[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
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
        if _sha256(p) != meta["sha256"]:
            return f"{p} is corrupt (sha256 differs from {MANIFEST})"
    return None
