"""``turnforge merge --sweep N``: a grid of mixing weights between two checkpoints (or one
checkpoint and its start weights, ``--toward init``), each merged model evaluated on the env of
every parent, as a table (``sweep.json``, ``sweep.md``) and a plot (``sweep.png``).

Each parent must sit in its run directory (``RUN/checkpoints/<name>/`` next to
``RUN/config.yaml``): its env, env options, tasks, rollout settings, evaluation split,
temperature and seed come from there, as ``turnforge eval`` takes them, with ``--episodes``
held-out episodes. Parents of one run share its evaluation: each merged model is evaluated once
per run, not once per parent. Point ``t`` merges with weights ``(1 - t, t)``: ``t = 0`` is the first
parent (for ``linear``, bit for bit), ``t = 1`` the second. A run with episodic memory is
evaluated without it (the merged model has no memory of its own).
"""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

from turnforge.errors import UserError
from turnforge.merge.checkpoints import MergeResult, merge_checkpoints
from turnforge.merge.methods import MergeSpec
from turnforge.plots import save_figure, subplots
from turnforge.runs import run_config_of
from turnforge.types import EvalResult


@dataclass(frozen=True)
class EvalTarget:
    """An env merged models are evaluated on: the run config of one or more parents."""

    label: str  # the env id (with its first parent's index where two runs share an env id)
    config: Path  # RUN/config.yaml
    parents: tuple[int, ...]  # the parents from this run (indices into the merge's parents)


@dataclass(frozen=True)
class SweepPoint:
    t: float  # the second parent's weight
    model: str  # the merged model's directory
    results: dict[str, EvalResult]  # target label -> evaluation


def eval_targets(parents: Sequence[Path], labels: Sequence[str], *, required: bool = True) -> list[EvalTarget]:
    """One target per run directory the parents sit in (parents of one run share it; a
    ``--toward init`` base is not a parent here), in the order of their first parent. A parent
    outside a run directory: ``UserError`` when ``required``, else it has no target."""
    from turnforge.app.config import load_config

    runs: dict[Path, list[int]] = {}
    for i, (p, label) in enumerate(zip(parents, labels)):
        cfg_path = run_config_of(p)
        if cfg_path is None:
            if required:
                raise UserError(f"--sweep evaluates each merge on its parents' envs: {label} is not inside a run directory "
                                "(RUN/checkpoints/<name>/ next to RUN/config.yaml)")
            continue
        runs.setdefault(cfg_path, []).append(i)
    found = [(load_config(str(cfg)).env.id, cfg, tuple(ix)) for cfg, ix in runs.items()]
    ids = [env_id for env_id, _, _ in found]
    return [EvalTarget(env_id if ids.count(env_id) == 1 else f"{env_id}#{ix[0] + 1}", cfg, ix) for env_id, cfg, ix in found]


def grid(points: int) -> list[float]:
    """``points`` values of t from 0 to 1, evenly spaced (rounded to 6 decimals)."""
    return [round(j / (points - 1), 6) for j in range(points)]


def evaluate_on(model: Path, target: EvalTarget, episodes: int) -> EvalResult:
    """``turnforge eval`` of ``model`` with the target's run config and ``episodes`` episodes."""
    from turnforge.app.config import load_config
    from turnforge.rollout.engine import make_engine
    from turnforge.train.evaluate import evaluate, load_for_eval, prefill_cache

    cfg = load_config(str(target.config), [f"eval.episodes={episodes}", "memory.enabled=false", "memory.store=null"])
    policy = load_for_eval(cfg, model)
    e = cfg.eval
    with closing(make_engine(cfg, policy)) as engine:
        result, _ = evaluate(engine, policy, episodes=e.episodes, split=e.split, temperature=e.temperature, seed=cfg.seed,
                             prefills=prefill_cache(policy, e.prefill_cache_mb))
    return result


def run_sweep(parents: Sequence[Path], out: Path, spec: MergeSpec, base: Path | None, points: int, episodes: int,
              targets: Sequence[EvalTarget], labels: Sequence[str] | None = None, log=print) -> list[SweepPoint]:
    """Merge at every grid point into ``out/t=<t>/``, evaluate each on every target, then write
    ``sweep.json``, ``sweep.md`` and ``sweep.png`` in ``out``. A target is one run, so a
    point is evaluated once per run however many parents come from it."""
    rows: list[SweepPoint] = []
    out.mkdir(parents=True, exist_ok=True)
    for t in grid(points):
        model = out / f"t={t:g}"
        merged: MergeResult = merge_checkpoints(parents, model, replace(spec, weights=(1 - t, t)), base, labels)
        results = {target.label: evaluate_on(model, target, episodes) for target in targets}
        rows.append(SweepPoint(t, str(model), results))
        log(f"t={t:g} (merged in {merged.seconds:.1f} s): "
            + ", ".join(f"{k} {r.success_rate:.3f}" for k, r in results.items()))
    write_report(out, rows, spec, parents, base, episodes)
    return rows


def write_report(out: Path, rows: Sequence[SweepPoint], spec: MergeSpec, parents: Sequence[Path], base: Path | None,
                 episodes: int) -> None:
    labels = list(rows[0].results)
    record = {"method": spec.method, "parents": [str(p.resolve()) for p in parents],
              "base": None if base is None else str(base.resolve()), "episodes": episodes,
              "points": [{"t": r.t, "model": r.model, "results": {k: asdict(v) for k, v in r.results.items()}} for r in rows]}
    (out / "sweep.json").write_text(json.dumps(record, indent=2) + "\n")
    head = f"`{spec.method}` merges, weights (1 - t, t) of {', '.join(str(p) for p in parents)}; held-out success, {episodes} episodes per env"
    lines = [head, "", "| t | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    lines += [f"| {r.t:g} | " + " | ".join(f"{r.results[k].success_rate:.3f}" for k in labels) + " |" for r in rows]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    fig, ax = subplots(figsize=(5.5, 3.6))
    for k in labels:
        ax.plot([r.t for r in rows], [r.results[k].success_rate for r in rows], marker="o", label=k)
    ax.set_xlabel("t (weight of the second model)")
    ax.set_ylabel("held-out success")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"turnforge merge --method {spec.method} --sweep {len(rows)}")
    ax.legend()
    save_figure(fig, out / "sweep.png", dpi=120)
