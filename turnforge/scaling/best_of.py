"""Best-of-N at evaluation (``turnforge eval CKPT --best-of 1,2,4,8,16 --select ...``).

N attempts per held-out task, played once with the rollout engine (the episodes of
``--pass-at-k N``: the same plan gives the same attempts, so the oracle's curve is the run's
pass@k), then each selector scores every attempt and picks one per task; its success at n <= N is
the exact expectation over n-subsets of the attempts (``turnforge.scaling.select``). Selectors:

- ``oracle``: the env's own success (the ceiling: pass@n);
- ``logprob``: the mean sampling logprob of the attempt's action tokens;
- ``vote``: the majority final answer (envs with ``final_answer``, e.g. the tool envs' ``<answer>``);
- ``critic``: the learned value model of the checkpoint's run (``critic.enabled``), saved in
  ``RUN/checkpoints/last`` with these same weights; an attempt's score is the mean of its turns'
  predicted values V(s_k). Departure from Digi-Q, which ranks candidate actions by a Q function
  at each step: whole attempts are ranked here; per-step selection is lookahead's job.
- ``mc``: the critic's score with Monte-Carlo values for the learned ones (ProAct's MC critic):
  V(s_k) of every state the attempt acted in (the env snapshots before its actions) is the mean
  return of ``rollouts`` episodes of at most ``horizon`` turns played from there by the policy at
  the evaluation temperature (``turnforge.critic.mc``). The attempt's own outcome is never looked
  at, only the simulator's futures of the states it reached; identical states of one task (same
  snapshot, same turns left) are estimated once. Costs env steps, reported with the curve.
- ``judge``: a judge model (the ``reward.judge`` settings; ``model=policy`` is the evaluated
  checkpoint itself, self-verification) scores each attempt's transcript. The reference answer
  is never shown to it (that would be the oracle): the rubric's ``{reference}`` reads "none
  given". An attempt it gives no score in range is ranked below every scored one and counted.

The report gives success against n per selector, the share of the pass@1 -> pass@N gap each
closes, the ROC AUC of scoring selectors as classifiers of success, and the cost per task
(attempts x generated tokens, env steps and seconds of one attempt).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from turnforge.envs.base import capabilities
from turnforge.errors import UserError
from turnforge.plots import save_figure, subplots
from turnforge.runs import RunDir
from turnforge.scaling.select import best_of_n, gap_closed, roc_auc, vote_of_n
from turnforge.types import Trajectory

SELECTORS: tuple[str, ...] = ("oracle", "logprob", "vote", "critic", "mc", "judge")


@dataclass(frozen=True)
class SelectorCurve:
    selector: str
    success: tuple[float, ...]  # expected success of its pick at each n of ``BestOfReport.ns``
    gap_closed: float | None  # at the largest n: (success - pass@1) / (pass@N - pass@1); None without a gap
    auc: float | None  # its scores as a classifier of success over all attempts (None: oracle, vote)
    seconds: float  # scoring time (the critic's forward passes, the Monte-Carlo rollouts, the judge)
    env_steps: int = 0  # env steps the selector itself played (mc: its rollouts), over all attempts
    unscored: int = 0  # attempts it could not score (judge: no score in range; mc: every rollout failed), ranked last


@dataclass(frozen=True)
class BestOfReport:
    env_id: str
    split: str
    tasks: int  # tasks scored (those with an infrastructure failure among their attempts left out)
    attempts: int  # N per task
    ns: tuple[int, ...]
    temperature: float
    seed: int
    curves: tuple[SelectorCurve, ...]
    tokens_per_attempt: float  # generated tokens (actions, summaries)
    env_steps_per_attempt: float
    seconds_per_attempt: float  # wall seconds of playing, per attempt
    infra_failures: int  # attempts that failed (their tasks left out)


def parse_ns(text: str) -> tuple[int, ...]:
    """``--best-of 1,2,4,8`` as sorted distinct ints >= 1, or one ``UserError`` line."""
    try:
        ns = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise UserError(f"--best-of {text!r}: give comma-separated attempt counts, e.g. 1,2,4,8,16") from None
    if not ns or ns[0] < 1:
        raise UserError(f"--best-of {text!r}: every N must be >= 1 (N attempts per task, one picked)")
    return ns


def parse_selectors(text: str, env, critic_problem: str = "") -> tuple[str, ...]:
    """``--select oracle,logprob`` checked against what the env and the checkpoint's run support
    (``critic_problem``: why the run's value model cannot be used, "" when it can); a selector
    this run cannot use is one ``UserError`` line naming those it can."""
    chosen = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    for name in chosen:
        if name not in SELECTORS:
            raise UserError(f"unknown selector {name!r}; valid selectors: {', '.join(SELECTORS)}")
    if not chosen:
        raise UserError(f"--select {text!r}: name at least one of {', '.join(SELECTORS)}")
    caps = capabilities(env)
    why_not = {
        "vote": "" if caps.final_answer else f"--select vote compares final answers: env {env.env_id!r} has none (it "
                "needs final_answer(action_text))",
        "mc": "" if caps.snapshot else f"--select mc estimates values from env snapshots: env {env.env_id!r} has no "
              "snapshot() and restore(snapshot)",
        "critic": critic_problem and f"--select critic needs the run's learned value model: {critic_problem}",
    }
    for name in chosen:
        if why_not.get(name):
            usable = [s for s in SELECTORS if not why_not.get(s)]
            raise UserError(f"{why_not[name]}; selectors this evaluation can use: {', '.join(usable)}")
    return chosen


@dataclass
class MCScorer:
    """What the ``mc`` selector plays its rollouts with: ``actor`` on ``engine`` (free while it
    scores), ``rollouts`` episodes of at most ``horizon`` turns (and the episode's turns left) per state."""

    engine: object  # turnforge.rollout.engine.RolloutEngine
    actor: object  # turnforge.rollout.actors.PolicyActor
    rollouts: int
    horizon: int
    max_turns: int
    seed: int


def mc_scores(groups: Sequence[Sequence[Trajectory]], scorer: MCScorer) -> tuple[list[list[float]], int, int]:
    """(per attempt: the mean Monte-Carlo V(s_k) over the states it acted in, env steps played,
    attempts left unscored). Every state of a task is estimated once (same snapshot, same turns
    left), all of them in one batched ``engine.play``; an attempt whose states all failed gets -inf."""
    import pickle

    from turnforge.critic.mc import MCStart, estimate
    from turnforge.seeding import stable_hash

    starts: list[MCStart] = []
    index: dict[tuple, int] = {}
    owned: list[list[list[int]]] = []  # per group, per attempt: the starts of its states
    for gi, g in enumerate(groups):
        owned.append([])
        for t in g:
            if len(t.snapshots) != t.num_turns:
                raise ValueError(f"attempt {t.trajectory_id} kept {len(t.snapshots)} snapshots for {t.num_turns} turns "
                                 "(play the attempts with keep_snapshots=True)")
            mine = []
            for k, snap in enumerate(t.snapshots):
                budget = max(1, min(scorer.horizon, scorer.max_turns - k))
                key = (gi, hashlib.sha256(pickle.dumps(snap.payload)).hexdigest(), budget)
                if key not in index:
                    index[key] = len(starts)
                    starts.append(MCStart(t.task, snap, budget))
                mine.append(index[key])
            owned[-1].append(mine)
    est = estimate(scorer.engine, starts, scorer.actor, rollouts=scorer.rollouts, gamma=1.0,  # type: ignore[arg-type]
                   seed=stable_hash(scorer.seed, "best-of", "mc"), prefix="best-of-mc")
    scores, unscored = [], 0
    for g in owned:
        row = []
        for mine in g:
            v = est.values[mine]
            v = v[~np.isnan(v)]
            unscored += v.size == 0
            row.append(float(v.mean()) if v.size else float("-inf"))
        scores.append(row)
    return scores, est.env_steps, unscored


def judge_scores(groups: Sequence[Sequence[Trajectory]], judge) -> tuple[list[list[float]], int]:
    """(per attempt: the judge's score of its transcript, the reference answer withheld; attempts
    it gave no score in range, scored -inf)."""
    flat = [t for g in groups for t in g]
    records = judge.judge(flat, with_reference=False) if flat else []
    it = iter(float("-inf") if r.score is None else float(r.score) for r in records)
    scores = [[next(it) for _ in g] for g in groups]
    return scores, sum(r.score is None for r in records)


def _mean_logprob(t: Trajectory) -> float:
    lps = [x.logprobs[(x.loss_mask == 1) & (x.versions >= 0)] for x in t.samples]
    flat = np.concatenate(lps) if lps else np.zeros(0, np.float32)
    return float(flat.mean()) if flat.size else float("-inf")


def _generated(t: Trajectory) -> int:
    return int(sum(((x.loss_mask == 1) & (x.versions >= 0)).sum() for x in t.samples))


def run_best_of(trajectories: Sequence[Trajectory], attempts: int, ns: Sequence[int], selectors: Sequence[str], env, *,
                split: str, temperature: float, seed: int, play_seconds: float, critic=None, pad_id: int = 0,
                mc: MCScorer | None = None, judge=None) -> BestOfReport:
    """Score the attempts (task by task, ``attempts`` each) with every selector; see the module docstring."""
    tasks = len(trajectories) // attempts
    groups = [list(trajectories[i * attempts:(i + 1) * attempts]) for i in range(tasks)]
    failed = sum(t.infra_failure is not None for t in trajectories)
    groups = [g for g in groups if all(t.infra_failure is None for t in g)]
    if not groups:
        raise UserError("every task had an attempt that failed (infrastructure failures): nothing to select from")
    success = [[bool(t.success) for t in g] for g in groups]
    flat_ok = [s for g in success for s in g]
    pass1, pass_n = (float(np.mean([best_of_n([float(s) for s in g], g, n) for g in success])) for n in (1, max(ns)))
    curves = []
    for name in selectors:
        t0 = time.perf_counter()
        auc, steps, unscored = None, 0, 0
        if name == "vote":
            answers = [[env.final_answer(t.turns[-1].action_text) if t.turns else None for t in g] for g in groups]
            values = [float(np.mean([vote_of_n(a, s, n, seed=seed) for a, s in zip(answers, success)])) for n in ns]
        else:
            if name == "oracle":
                scores = [[float(s) for s in g] for g in success]
            elif name == "logprob":
                scores = [[_mean_logprob(t) for t in g] for g in groups]
            elif name == "critic":
                from turnforge.critic.value import turn_values

                values_by_id = turn_values(critic, [t for g in groups for t in g], pad_id)
                scores = [[float(values_by_id[t.trajectory_id].mean()) if t.num_turns else 0.0 for t in g] for g in groups]
            elif name == "mc":
                if mc is None:
                    raise ValueError("the mc selector needs an MCScorer (mc=...)")
                scores, steps, unscored = mc_scores(groups, mc)
            else:  # judge
                if judge is None:
                    raise ValueError("the judge selector needs a Judge (judge=...)")
                scores, unscored = judge_scores(groups, judge)
            if name != "oracle":
                auc = roc_auc([x for g in scores for x in g], flat_ok)
            values = [float(np.mean([best_of_n(sc, s, n) for sc, s in zip(scores, success)])) for n in ns]
        curves.append(SelectorCurve(name, tuple(values), gap_closed(values[-1], pass1, pass_n), auc,
                                    round(time.perf_counter() - t0, 3), steps, unscored))
    ok = [t for g in groups for t in g]
    return BestOfReport(
        env_id=env.env_id, split=split, tasks=len(groups), attempts=attempts, ns=tuple(ns), temperature=temperature,
        seed=seed, curves=tuple(curves), tokens_per_attempt=float(np.mean([_generated(t) for t in ok])),
        env_steps_per_attempt=float(np.mean([t.num_turns for t in ok])),
        seconds_per_attempt=play_seconds / max(1, len(trajectories)), infra_failures=failed)


def format_best_of(r: BestOfReport) -> str:
    """The report as a Markdown table (success per selector and n, then cost per task)."""
    head = (f"best-of-N on {r.tasks} {r.split} tasks of {r.env_id}, {r.attempts} attempts each at T={r.temperature:g} "
            f"(seed {r.seed}); success of the picked attempt, exact over n-subsets")
    lines = [head, "", "| selector | " + " | ".join(f"N={n}" for n in r.ns) + " | gap closed at N=" + str(r.ns[-1]) + " | AUC |",
             "|---|" + "---|" * (len(r.ns) + 2)]
    for c in r.curves:
        gap = "" if c.gap_closed is None else f"{100 * c.gap_closed:.0f}%"
        auc = "" if c.auc is None else f"{c.auc:.3f}"
        lines.append(f"| {c.selector} | " + " | ".join(f"{v:.3f}" for v in c.success) + f" | {gap} | {auc} |")
    for c in r.curves:
        if c.env_steps or c.unscored or c.selector in ("mc", "judge", "critic"):
            lines.append(f"\n{c.selector}: scoring took {c.seconds:.1f} s" + (
                f", {c.env_steps / r.tasks:.0f} env steps of rollouts per task (for its {r.attempts} attempts)" if c.env_steps else "")
                + (f"; {c.unscored} attempts unscored (ranked last)" if c.unscored else ""))
    lines += ["", "| N | generated tokens per task | env steps per task | seconds per task |", "|---|---|---|---|"]
    lines += [f"| {n} | {n * r.tokens_per_attempt:.0f} | {n * r.env_steps_per_attempt:.1f} | {n * r.seconds_per_attempt:.2f} |"
              for n in r.ns]
    if r.infra_failures:
        lines.append(f"\n{r.infra_failures} attempts failed (infrastructure); their tasks are left out.")
    return "\n".join(lines)


def write_best_of(r: BestOfReport, path: Path, settings: dict) -> None:
    """``path`` (JSON: the report and the settings), and beside it ``.md`` and ``.png``."""
    from turnforge.paths import write_json

    write_json(path, {**asdict(r), "settings": settings})
    path.with_suffix(".md").write_text(format_best_of(r) + "\n")
    fig, ax = subplots(figsize=(5.5, 3.6))
    for c in r.curves:
        ax.plot(r.ns, c.success, marker="o", label=c.selector, linestyle="--" if c.selector == "oracle" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(r.ns, [str(n) for n in r.ns])
    ax.set_xlabel("N (attempts per task)")
    ax.set_ylabel("held-out success of the pick")
    ax.set_title(f"best-of-N, {r.env_id}")
    ax.legend()
    save_figure(fig, path.with_suffix(".png"), dpi=120)


def run_critic_problem(checkpoint: Path, run_config: Path | None, cfg) -> str:
    """Why the checkpoint's run has no learned value model to use ("" when it has one): it is in
    ``RUN/checkpoints/last/trainer_state.pt`` and counts only when ``last`` holds the same weights
    as ``checkpoint``. Quick (no model is loaded), so ``--select`` is checked before any work."""
    if run_config is None:
        return f"checkpoint {str(checkpoint)!r} is not inside a run directory"
    if not cfg.critic.enabled:
        return "the run trained no critic (critic.enabled=false)"
    last = RunDir(run_config.parent).checkpoint("last")
    state_file = last / "trainer_state.pt"
    if not state_file.is_file():
        return f"{state_file} does not exist"
    if _weights_digest(last) != _weights_digest(checkpoint):
        return f"{last} (where the critic is saved) holds other weights than {str(checkpoint)!r}"
    return ""


def load_run_critic(checkpoint: Path, run_config: Path, cfg, policy):
    """The learned value model of the checkpoint's run (``run_critic_problem`` found it), or a
    ``UserError`` when its trainer state holds none."""
    import torch

    from turnforge.critic.value import build_value_model

    state_file = RunDir(run_config.parent).checkpoint("last") / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    if not state.get("critic"):
        raise UserError(f"--select critic needs the run's learned value model: {state_file} holds no critic")
    model = build_value_model(policy.model, cfg.critic.init, cfg.seed)
    model.load_state_dict(state["critic"])
    return model


def _weights_digest(directory: Path) -> str | None:
    """The sha256 of ``model.safetensors`` (from the manifest when sealed)."""
    manifest = directory / "manifest.json"
    if manifest.is_file():
        entry = json.loads(manifest.read_text())["files"].get("model.safetensors")
        if entry:
            return entry["sha256"]
    weights = directory / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
