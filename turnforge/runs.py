"""The run directory: its layout, stated once, and the one writer of it.

Layout (every path of a run, each a property or method of ``RunDir``)::

    DIR/.lock                       held by the run writing DIR, for its whole life (``RunLock``)
    DIR/config.yaml                 the full resolved config
    DIR/metrics.jsonl, DIR/tb/      typed records (``turnforge.train.metrics``) and TensorBoard
    DIR/learning_curve.png          held-out success and return vs env steps, stages marked
    DIR/pass_at_k.png               pass@k of the start and after training (eval.pass_at_k_samples > 0)
    DIR/flywheel.png                the flywheel's rounds (flywheel.rounds > 0) ...
    DIR/flywheel_report.md          ... and its report
    DIR/summary.json                headline numbers (``turnforge.train.metrics.RunSummary``)
    DIR/trajectories/*.parquet      one row per training sample (see turnforge.data.store)
    DIR/memory.parquet              the episodic memory (memory.enabled)
    DIR/rehearsal.parquet           the rehearsal cache (rl.rehearsal_coef > 0)
    DIR/gateway_splits.jsonl        an agent run's gateway splits (turnforge.gateway.agents)
    DIR/base_model/                 the initial model (tiny recipes build it here)
    DIR/checkpoints/bc/             after behaviour cloning (HF format)
    DIR/checkpoints/last/           resumable: HF model + optimizer + counters ...
    DIR/checkpoints/prev/           ... and the one it replaced
    DIR/checkpoints/reference/      the KL reference after its last reset (rl.reference_reset_every)
    DIR/checkpoints/kept-NNN-LABEL/ weights kept for a checkpoint soup (keep_checkpoints)
    DIR/checkpoints/final/          the trained policy (HF format)
    DIR/logs/                       the inference replicas' logs (rollout.backend=server)
    DIR/weights/                    weights pushed to the replicas as files (rollout.server.transport=file)

The rank rule: on several trainer ranks (``turnforge.dist``) every rank runs the same code and
rank 0 alone writes the run directory. ``RunDir``'s writers obey it, writing nothing on the
other ranks, so that no stage tests the rank itself: ``write_text``, ``write_json``,
``write(path, fn)`` (``fn(path)`` on rank 0: Parquet files, plots, the metrics log), ``remove``,
``hold`` (the lock) and ``write_sealed``, the one writer every rank takes part in (a
checkpoint: each rank writes its optimizer shards into it before rank 0 seals it).

Readers (``turnforge.data``, ``turnforge.view``, ``read_summary``, ``find_resumable``) take their
paths from ``RunDir`` too.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from turnforge.errors import UserError
from turnforge.paths import fsync, seal, write_atomic, write_json

R = TypeVar("R")

#: The checkpoints of a run by name (``checkpoints/<name>/``); kept weights are named by ``RunDir.kept``.
CHECKPOINTS: tuple[str, ...] = ("bc", "last", "prev", "reference", "final")
#: Name prefix of the weights ``keep_checkpoints`` keeps: ``kept-<NNN>-<stage label>``.
KEPT_PREFIX = "kept-"


def _main() -> bool:
    """Whether this process writes the run directory: rank 0 (or a world of one). ``turnforge.dist``
    is read when a write is asked for, so a reader of runs (``turnforge view``) never loads torch."""
    from turnforge.dist import world

    return world().main


def _barrier() -> None:
    from turnforge.dist import barrier

    barrier()


def run_config_of(checkpoint: str | Path) -> Path | None:
    """``RUN/config.yaml`` of the run a checkpoint ``RUN/checkpoints/<name>/`` belongs to (None for a
    model directory outside a run, or a run without its config)."""
    ckpt = Path(checkpoint).resolve()
    run = RunDir(ckpt.parent.parent)
    return run.config if ckpt.parent == run.checkpoints and run.config.is_file() else None


def staging(path: Path) -> Path:
    """Where a sealed directory is written before it is renamed to ``path``: ``<path>.tmp``."""
    return path.with_name(path.name + ".tmp")


@dataclass(frozen=True)
class RunDir:
    """A run directory: every path under it (see the module docstring) and the writers that obey
    the rank rule. ``os.fspath(run)`` and ``str(run)`` are the root's."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str, a Path or a RunDir

    def __fspath__(self) -> str:
        return str(self.root)

    def __str__(self) -> str:
        return str(self.root)

    # ------------------------------------------------------------------ layout
    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def learning_curve(self) -> Path:
        return self.root / "learning_curve.png"

    @property
    def pass_at_k(self) -> Path:
        return self.root / "pass_at_k.png"

    @property
    def flywheel_plot(self) -> Path:
        return self.root / "flywheel.png"

    @property
    def flywheel_report(self) -> Path:
        return self.root / "flywheel_report.md"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    def trajectory_file(self, name: str) -> Path:
        """``trajectories/<name>.parquet`` (``bc_demos``, ``flywheel_00002``, ``rl_00007``)."""
        return self.trajectories / f"{name}.parquet"

    @property
    def memory(self) -> Path:
        return self.root / "memory.parquet"

    @property
    def rehearsal(self) -> Path:
        return self.root / "rehearsal.parquet"

    @property
    def gateway_splits(self) -> Path:
        return self.root / "gateway_splits.jsonl"

    @property
    def base_model(self) -> Path:
        return self.root / "base_model"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, name: str) -> Path:
        """``checkpoints/<name>/``, ``name`` one of ``CHECKPOINTS`` (kept weights: ``kept``)."""
        if name not in CHECKPOINTS:
            raise ValueError(f"no checkpoint {name!r} in a run directory; valid names: {', '.join(CHECKPOINTS)}")
        return self.checkpoints / name

    def kept(self, index: int, label: str) -> Path:
        """``checkpoints/kept-<NNN>-<label>/``: the ``index``-th weights kept (``keep_checkpoints``)."""
        return self.checkpoints / f"{KEPT_PREFIX}{index:03d}-{label}"

    def kept_checkpoints(self) -> list[Path]:
        """The kept weights (``kept``) there are, oldest first (a save in progress left out)."""
        root = self.checkpoints
        found = [p for p in root.glob(f"{KEPT_PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp")] if root.is_dir() else []
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def leftovers(self) -> tuple[Path, ...]:
        """What a run that stopped before its first checkpoint may have written, to clear before it
        starts over (the lock aside)."""
        return (self.config, self.metrics, self.tb, self.trajectories, self.base_model, staging(self.base_model),
                self.checkpoints, self.learning_curve, self.summary)

    # ------------------------------------------------------------------ writers (rank 0 writes)
    def _writes(self, path: Path) -> bool:
        """Whether this rank writes ``path`` (rank 0); a path outside the run is a bug."""
        if not Path(path).is_relative_to(self.root):
            raise ValueError(f"{path} is not under the run directory {self.root}")
        return _main()

    def write_text(self, path: Path, text: str) -> None:
        """``text`` to ``path`` whole (``write_atomic``), on rank 0."""
        if self._writes(path):
            write_atomic(path, text)

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        """``data`` as indented JSON to ``path`` whole (``turnforge.paths.write_json``), on rank 0."""
        if self._writes(path):
            write_json(path, data)

    def write(self, path: Path, fn: Callable[[Path], R]) -> R | None:
        """``fn(path)`` on rank 0 and its result; None on the other ranks. For what writes a file
        its own way (Parquet, a plot, the metrics log); ``path`` is what ``fn`` writes (the root
        for what writes several paths)."""
        return fn(path) if self._writes(path) else None

    def remove(self, path: Path) -> None:
        """Delete the file or directory ``path``, on rank 0."""
        if self._writes(path):
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    def hold(self) -> AbstractContextManager:
        """The run's lock for the life of the ``with`` block (``RunLock``), on rank 0; nothing
        on the others (rank 0's lock is the run's)."""
        return RunLock(self.root) if self._writes(self.lock) else nullcontext()

    def write_sealed(self, path: Path, fill: Callable[[Path], None], *, previous: Path | None = None,
                     shards: Mapping[str, Callable[[Path], None]] | None = None) -> Path:
        """Write the directory ``path`` whole: ``fill(tmp)`` writes its files into ``staging(path)``,
        which is sealed (``turnforge.paths.seal``: each file fsynced, its manifest last) and renamed
        into place; the old ``path`` becomes ``previous`` (None: deleted once replaced). Every rank
        calls it: rank 0 makes the directory and fills it; ``shards`` (subdirectory -> a collective
        that writes each rank's part into it, e.g. an optimizer's sharded state) are written by
        every rank first; the other ranks return once rank 0 has renamed it into place."""
        tmp = staging(path)
        main = self._writes(path)
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if shards:
            _barrier()  # the directory exists
            for name, write in shards.items():
                write(tmp / name)  # a collective: when it returns on rank 0 every rank's part is written
        if not main:
            _barrier()
            return path
        fill(tmp)
        seal(tmp)
        _swap_in(tmp, path, previous)
        _barrier()
        return path


def _swap_in(tmp: Path, final: Path, keep_previous: Path | None) -> None:
    """Rename the complete ``tmp`` to ``final``; the old ``final`` becomes ``keep_previous``
    (or is deleted once the new one is in place)."""
    parent = final.parent
    if final.exists():
        if keep_previous is not None:
            shutil.rmtree(keep_previous, ignore_errors=True)
            final.rename(keep_previous)
        else:
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            fsync(parent)
            shutil.rmtree(old)
            return
    tmp.rename(final)
    fsync(parent)


# ------------------------------------------------------------------ the lock
_HELD: set[Path] = set()  # run directories this process holds (record locks are per process)


class RunLock:
    """One process writes a run directory at a time: ``DIR/.lock`` carries a POSIX record lock
    (``fcntl.lockf``) for the whole life of the run (``with RunLock(dir):`` or
    ``acquire``/``release``). The kernel drops it when the process ends, however it ends (SIGKILL
    included), so a lock file left by a dead run is stale by construction and is simply taken
    over; record locks are not inherited by forked children, so env workers never hold it. The
    file's text names the holder (pid, host, start time) for the error a second writer gets."""

    def __init__(self, run_dir: str | Path | RunDir) -> None:
        self.path = RunDir(run_dir).lock
        self._fd: int | None = None
        self.stale: dict | None = None  # the holder recorded by a dead run whose lock was taken over

    def acquire(self) -> "RunLock":
        key = self.path.resolve()
        if key in _HELD:
            raise UserError(f"run directory {str(self.path.parent)!r} is in use by a run of this process; use another --out")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}" if holder else "another process"
            raise UserError(
                f"run directory {str(self.path.parent)!r} is in use by a live turnforge run ({who}); "
                "wait for it to end, or use another --out"
            ) from None
        self.stale = _read_holder(fd) or None
        os.ftruncate(fd, 0)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        _HELD.add(key)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the record lock
            self._fd = None
            _HELD.discard(self.path.resolve())

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def resume_lines(run_dir: Path | None, where: str | None = None) -> list[str]:
    """Where to resume a stopped run: ``where``, the point a stopped rank named (its own resume
    line, ``turnforge.train.run_dir.interrupts``: "during flywheel round 1; resume with: ..."),
    else the last checkpoint, else a start over ([] without a run directory)."""
    if where is not None:
        return ["the run stopped " + where]
    if run_dir is None or not Path(run_dir).is_dir():
        return []
    if RunDir(Path(run_dir)).checkpoints.is_dir():
        return [f"the run's last checkpoint is intact; resume with: turnforge train --resume {run_dir}"]
    return [f"the run stopped before its first checkpoint; resume with: turnforge train --resume {run_dir} (starts it over)"]
