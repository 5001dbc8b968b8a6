"""Shared by the benchmarks that train (``algorithms.py``, ``rollout.py``): train the BC stage
once per seed, then RL once per variant from that checkpoint, and where their outputs go.

    from _runs import RESULTS, bc_start, from_bc, run

    bc = bc_start(work, "sokoban-tiny", ["threads=1"], seed=0)        # WORK/bc-0/checkpoints/bc
    summary = run("sokoban-tiny", ["seed=0", *from_bc(bc), "rl.advantage=gigpo"], work / "gigpo-0")

- ``run(recipe, overrides, out_dir)``: one ``turnforge.app.run.train`` run, its output
  (progress lines, warnings, the traceback of a failure) in ``out_dir.with_suffix('.log')``. Skipped when
  ``out_dir/summary.json`` exists (its ``RunSummary`` is read back), so an interrupted
  benchmark picks up where it stopped; a directory left by an unfinished attempt is deleted
  and run again. A failed run prints one line and returns None, so one failure does not
  lose the other runs.
- ``bc_start(work_dir, recipe, overrides, seed)``: the BC stage alone (``rl.iterations=0``)
  in ``work_dir/bc-<seed>``; returns its ``checkpoints/bc``. ``bc_starts`` runs several seeds
  at once.
- ``from_bc(checkpoint)``: the overrides that start a run from it (``model.path=...``,
  ``bc.enabled=false``).
- ``run_all(jobs, workers)``: several ``Job``s in a process pool (results in job order);
  ``run_fresh(recipe, overrides, out_dir)``: ``run`` in a process of its own (timings).
- ``model_dir(spec)``: the model directory of a ``--model`` argument (``tiny``, a directory, a GGUF source).

Run directories are reused by name only: after changing a budget or an option, give the
benchmark a new work directory (or delete the old runs).

``RESULTS`` (``runs/benchmarks``, relative to the working directory) is where every
benchmark writes by default, so nothing lands in the source tree; past measurements are
kept in ``docs/results/``. Importing this module imports no torch (``envpool.py`` uses it).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from turnforge.train.metrics import RunSummary

RESULTS = Path("runs/benchmarks")


@dataclass(frozen=True)
class Job:
    """One training run: a recipe, its ``key=value`` overrides and the run directory."""

    recipe: str
    overrides: tuple[str, ...]
    out_dir: Path


def run(recipe: str, overrides: Sequence[str], out_dir: str | Path) -> RunSummary | None:
    """Train ``recipe`` with ``overrides`` into ``out_dir`` (see the module docstring);
    its ``RunSummary``, or None if it failed."""
    from turnforge.app.config import load_config
    from turnforge.app.run import train
    from turnforge.train.metrics import read_summary

    out_dir = Path(out_dir)
    if (out_dir / "summary.json").exists():
        return read_summary(out_dir)
    log_path = out_dir.with_suffix(".log")
    try:
        if out_dir.exists():  # an unfinished attempt: start over
            if any(out_dir.iterdir()) and not (out_dir / "config.yaml").exists():
                raise RuntimeError(f"{out_dir} exists and is not a turnforge run directory; not deleting it")
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            summary = train(load_config(recipe, list(overrides)), out_dir, live=False)
        if summary is None:
            raise RuntimeError("it stopped before the end of RL")
        return summary
    except Exception as err:  # one failed run must not lose the others
        if log_path.parent.exists():
            with open(log_path, "a") as log:
                log.write(traceback.format_exc())
        print(f"run {out_dir} failed: {type(err).__name__}: {err} (log: {log_path})", flush=True)
        return None


def run_job(job: Job) -> RunSummary | None:
    """``run`` of one ``Job`` (a top-level function, so a process pool can call it)."""
    return run(job.recipe, job.overrides, job.out_dir)


def run_fresh(recipe: str, overrides: Sequence[str], out_dir: str | Path) -> RunSummary | None:
    """``run`` in a fresh (spawned) process of its own, as a user's ``turnforge train`` runs:
    for timings, where what an earlier run left in this process (allocator, caches) would
    weigh on a later one."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_job, Job(recipe, tuple(overrides), Path(out_dir))).result()


def run_all(jobs: Sequence[Job], workers: int = 1) -> list[RunSummary | None]:
    """``run`` every job, ``workers`` at a time in fresh (spawned) processes; the results in
    job order. ``workers <= 1`` runs them one after another in this process."""
    if workers <= 1 or len(jobs) <= 1:
        return [run_job(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(run_job, jobs))


def bc_job(work_dir: str | Path, recipe: str, overrides: Sequence[str], seed: int) -> Job:
    """The BC-only run of ``seed``: ``work_dir/bc-<seed>``, ``overrides`` + ``seed``, no flywheel, ``rl.iterations=0``."""
    return Job(recipe, (*overrides, f"seed={seed}", "flywheel.rounds=0", "rl.iterations=0"), Path(work_dir) / f"bc-{seed}")


def checkpoint_of(job: Job) -> Path:
    """The BC checkpoint a ``bc_job`` leaves."""
    return job.out_dir / "checkpoints" / "bc"


def bc_start(work_dir: str | Path, recipe: str, overrides: Sequence[str], seed: int) -> Path:
    """Train the BC stage of ``recipe`` once for ``seed`` (skipped if done); its checkpoint.
    Raises ``RuntimeError`` if the run failed (nothing can start from it)."""
    job = bc_job(work_dir, recipe, overrides, seed)
    if run_job(job) is None:
        raise RuntimeError(f"the BC start {job.out_dir} failed; see {job.out_dir.with_suffix('.log')}")
    return checkpoint_of(job)


def bc_starts(work_dir: str | Path, recipe: str, overrides: Sequence[str], seeds: Sequence[int],
              workers: int = 1) -> dict[int, Path]:
    """``bc_start`` of every seed, ``workers`` at a time; the checkpoints of the seeds whose
    BC run finished (a failed one is printed by ``run`` and left out)."""
    jobs = [bc_job(work_dir, recipe, overrides, s) for s in seeds]
    return {s: checkpoint_of(j) for s, j, summary in zip(seeds, jobs, run_all(jobs, workers)) if summary is not None}


def from_bc(bc_checkpoint: str | Path) -> list[str]:
    """Overrides that start a run from a BC checkpoint instead of training BC again."""
    return [f"model.path={Path(bc_checkpoint).resolve()}", "bc.enabled=false"]


def model_dir(spec: str) -> Path:
    """The HF model directory a benchmark's ``--model`` names: ``tiny`` (built in a temp dir),
    an HF directory, or a GGUF file or package (converted once and cached, ``cached_import``)."""
    if spec == "tiny":
        import tempfile

        from turnforge.policy.tiny import build_tiny_model

        path = Path(tempfile.mkdtemp(prefix="bench-tiny-")) / "tiny"
        build_tiny_model(path)
        return path
    if Path(spec).is_dir():
        return Path(spec)
    from turnforge.policy.gguf import cached_import

    return cached_import(spec)


def cpu_info() -> dict[str, str]:
    """CPU model name, family and model number (from /proc/cpuinfo), and cores."""
    import os
    import platform

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    return {"model_name": info.get("model name", platform.processor() or "unknown"), "family": info.get("cpu family", "?"),
            "model": info.get("model", "?"), "cores": str(os.cpu_count())}


def cpu() -> str:
    """``cpu_info()`` as one line for a report: 'NAME (family F model M, C cores)'."""
    c = cpu_info()
    return f"{c['model_name']} (family {c['family']} model {c['model']}, {c['cores']} cores)"


def random_samples(vocab: int, rows: int, tokens: int, action: int, seed: int = 0) -> list:
    """``rows`` training samples of ``tokens`` random ids each, the last ``action`` of them the
    action (loss mask 1): a fixed batch for timing and memory benchmarks of the trainers' loss path."""
    import numpy as np

    from turnforge.types import Sample

    gen = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        ids = gen.integers(0, vocab, tokens)
        mask = np.zeros(tokens, np.int8)
        mask[-action:] = 1
        out.append(Sample(token_ids=ids.astype(np.int64), loss_mask=mask, logprobs=np.full(tokens, np.nan, np.float32),
                          versions=np.full(tokens, -1, np.int32), trajectory_id=f"t{i}", turn_index=0))
    return out
