"""The boundary of what a policy solves, measured on held-out tasks: pass@k and its friends.

``measure_boundary`` plays N samples on each of T held-out tasks (tasks ``0..T-1`` of
``eval.split``, the first of the evaluation's tasks) with the rollout engine and a ``PolicyActor``
at the collection temperature, and returns a ``BoundaryReport``: pass@k for each k of
``eval.pass_at_k`` (the unbiased estimator), the never-solved share at 8 and 64 samples, distinct
successful action sequences per task, the policy's entropy on the samples' action tokens, I(A; O)
of the first action for envs with a discrete action set, and the malformed-turn rate. The math is
in ``turnforge.algos.boundary``.

A run measures the start (after BC, or the model without BC) and the end, each after the other
evaluations of the same weights, with a random stream of its own (``generator(seed,
"pass-at-k", ...)``) and env seeds of its own, and writes no trajectories: enabling it changes no
other figure of the run. Its turns are not counted in the run's env steps (``BoundaryReport.turns``).
The stream depends on the seed and the plan, not on the stage, so ``turnforge eval
RUN/checkpoints/final --pass-at-k N`` repeats the run's ``boundary_after`` (same N and T).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from turnforge.algos.boundary import (distinct_successes, gained_and_lost, mean_pass_at_k, mutual_information,
                                      never_solved_share, softmax_rows)
from turnforge.config import TrainConfig
from turnforge.policy.generate import PrefillCache, pad_right, token_logprobs
from turnforge.batching import SCORING_BATCH, batches
from turnforge.policy.model import Policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import Engine, EpisodeRequest
from turnforge.seeding import generator, stable_hash
from turnforge.train.common import action_entropy, event_counts
from turnforge.train.metrics import BoundaryReport, PassAtK
from turnforge.train.run_dir.failures import check_trajectories
from turnforge.types import EvalResult, Sample, Trajectory


@dataclass(frozen=True)
class PassAtKPlan:
    """What to measure, derived from the config in one place (``plan``)."""

    split: str
    tasks: int  # T = min(eval.pass_at_k_tasks, eval.episodes)
    samples: int  # N
    ks: tuple[int, ...]
    temperature: float  # eval.pass_at_k_temperature, else rollout.temperature
    seed: int
    entropy_samples: int = 2048  # eval.pass_at_k_entropy_samples: the samples (evenly spread) the entropy is scored on
    episode_seed: int | None = None  # each episode's sampling draws from its own seed (rollout.noise), not a batch generator


def plan(cfg: TrainConfig) -> PassAtKPlan | None:
    """The measurement ``cfg`` asks for, or None (``eval.pass_at_k_samples=0``)."""
    e = cfg.eval
    if e.pass_at_k_samples == 0:
        return None
    temperature = e.pass_at_k_temperature if e.pass_at_k_temperature is not None else cfg.rollout.temperature
    return PassAtKPlan(e.split, min(e.pass_at_k_tasks, e.episodes), e.pass_at_k_samples, tuple(e.pass_at_k_list()),
                       temperature, cfg.seed, e.pass_at_k_entropy_samples,
                       cfg.episode_seed("pass-at-k", e.split, min(e.pass_at_k_tasks, e.episodes), e.pass_at_k_samples))


def measure_boundary(engine: Engine, policy: Policy, p: PassAtKPlan, *, tag: str, evaluation: EvalResult,
                     eval_temperature: float, prefills: PrefillCache | None = None, max_failure_share: float = 1.0,
                     on_progress: Callable[[int], None] | None = None) -> BoundaryReport:
    """Play ``p.samples`` episodes on each of ``p.tasks`` tasks and report (see the module
    docstring). ``evaluation``: the evaluation of the same weights at ``eval_temperature`` (its
    invalid-action rate is the report's ``eval_malformed_rate``). ``prefills``: a cache of the
    same weights (the N samples of a task, and the evaluations before, share the prompt's
    prefill). Raises ``RunStopped`` when more than ``max_failure_share`` of the episodes were
    infrastructure failures."""
    t0 = time.time()
    env = engine.env
    trajectories = play_samples(engine, policy, p, prefills, on_progress)
    failed = check_trajectories(f"pass@k {tag}", env.env_id, trajectories, max_failure_share, kind=f"{p.split} pass@k episodes")
    by_task = [[t for t in trajectories[i * p.samples:(i + 1) * p.samples] if t.infra_failure is None] for i in range(p.tasks)]
    ok = [t for group in by_task for t in group]

    counts = [(len(group), sum(t.success for t in group)) for group in by_task]
    results = []
    for k in p.ks:
        value, tasks = mean_pass_at_k(counts, k)
        results.append(PassAtK(k, value, tasks))
    successes = [[tuple(turn.action_text.strip() for turn in t.turns) for t in group if t.success] for group in by_task]
    samples = [x for t in ok for x in t.samples]
    spread = samples[::-(-len(samples) // p.entropy_samples)] if samples else []
    names = tuple(getattr(env, "action_names", ()) or ())
    mi = None
    if names:
        prompts = [_first_prompt(group[0].samples[0]) for group in by_task if group and group[0].samples]
        mi = mutual_information(first_action_probs(policy, prompts, names)) if prompts else None
    turns = sum(t.num_turns for t in ok)
    return BoundaryReport(
        tag=tag, split=p.split, tasks=p.tasks, samples_per_task=p.samples, temperature=p.temperature,
        pass_at_k=tuple(results),
        never_solved_at_8=never_solved_share(counts, 8) if p.samples >= 8 else None,
        never_solved_at_64=never_solved_share(counts, 64) if p.samples >= 64 else None,
        solved_tasks=sum(c > 0 for _, c in counts), distinct_successes=distinct_successes(successes),
        entropy=action_entropy(policy, spread, limit=len(spread)),
        action_mi=mi, action_mi_max=float(np.log(len(names))) if names else None,
        malformed_rate=sum(t.num_invalid for t in ok) / turns if turns else 0.0,
        eval_temperature=eval_temperature, eval_malformed_rate=evaluation.invalid_action_rate,
        episodes=len(ok), infra_failures=failed, turns=sum(t.num_turns for t in trajectories),
        seconds=round(time.time() - t0, 2), policy_version=policy.version, env_events=event_counts(ok),
        solved=tuple(i for i, (_, c) in enumerate(counts) if c > 0),
    )


def play_samples(engine: Engine, policy: Policy, p: PassAtKPlan, prefills: PrefillCache | None = None,
                 on_progress: Callable[[int], None] | None = None, keep_snapshots: bool = False) -> list[Trajectory]:
    """The ``p.samples`` episodes on each of ``p.tasks`` tasks, task by task (the j-th attempt at
    task i is ``trajectories[i * p.samples + j]``): the same episodes for the same plan, whoever
    asks (pass@k here, best-of-N selection in ``turnforge.scaling``; ``keep_snapshots`` for its
    Monte-Carlo selector, which does not change the episodes)."""
    env = engine.env
    actor = PolicyActor(policy, engine.cfg.max_new_tokens, p.temperature,
                        generator(p.seed, "pass-at-k", p.split, p.tasks, p.samples), prefills=prefills,
                        episode_seed=p.episode_seed)
    requests = [EpisodeRequest(env.task(p.split, i), stable_hash(p.seed, "pass-at-k", p.split, i, j), f"pass-at-k-{i}",
                               f"pass-at-k-{p.split}-{i}-{j}") for i in range(p.tasks) for j in range(p.samples)]
    trajectories, _ = engine.play(requests, actor, on_progress=on_progress, keep_snapshots=keep_snapshots)
    return trajectories


def _first_prompt(sample: Sample) -> tuple[int, ...]:
    """The context ids the first action was sampled after (the ids before the first action token)."""
    first = int(np.flatnonzero(sample.loss_mask)[0])
    return tuple(int(x) for x in sample.token_ids[:first])


@torch.no_grad()
def first_action_probs(policy: Policy, prompts: Sequence[Sequence[int]], names: Sequence[str],
                       batch_size: int = SCORING_BATCH) -> np.ndarray:
    """p(a | o) ``[O, A]``: the policy's probability (temperature 1) of each action name's tokens
    (the ids the engine writes for that action text, stop token included) after each prompt,
    normalised over the action set.

    Scored, not counted from the N sampled first actions: the scores are exact and cost one
    forward pass per (task, action), while the plug-in I(A; O) of N empirical draws per task is
    biased upward by about (A - 1) / 2N nats (0.09 at A=4, N=16: the size of the signal), and
    malformed samples fit no action. Temperature 1, the policy's own distribution: a sampling
    temperature sharpens or flattens every row and does not create or remove input dependence."""
    cands = [tuple(policy.chat.encode(n)) + (policy.stop_ids[0],) for n in names]
    rows = [(tuple(p) + c, len(p)) for p in prompts for c in cands]
    scores = np.zeros(len(rows), dtype=np.float64)
    for b, chunk in zip(range(0, len(rows), batch_size), batches(rows, batch_size)):
        ids, attention = pad_right([r for r, _ in chunk], policy.pad_id)
        positions = torch.zeros(ids.shape, dtype=torch.float32)  # [B, T], 1 on the action name's tokens
        for i, (r, start) in enumerate(chunk):
            positions[i, start:len(r)] = 1.0
        lp, _ = token_logprobs(policy.model, ids, attention, 1.0, positions=positions)
        scores[b:b + len(chunk)] = (lp * positions).sum(dim=1).double().numpy()
    return softmax_rows(scores.reshape(len(prompts), len(names)))


def format_boundary(r: BoundaryReport) -> str:
    """One line for the log: pass@k, never-solved share, distinct successes, entropy, I(A; O), malformed turns."""
    ks = " ".join(f"pass@{x.k}={x.value:.3f}" for x in r.pass_at_k if x.value is not None)
    parts = [f"pass@k {r.tag} ({r.tasks} {r.split} tasks x {r.samples_per_task} samples, T={r.temperature:g}): {ks}"]
    if r.never_solved_at_8 is not None:
        parts.append(f"never solved@8 {r.never_solved_at_8:.3f}")
    if r.never_solved_at_64 is not None:
        parts.append(f"@64 {r.never_solved_at_64:.3f}")
    if r.distinct_successes is not None:
        parts.append(f"distinct successes {r.distinct_successes:.2f}")
    if r.entropy is not None:
        parts.append(f"entropy {r.entropy:.3f}")
    if r.action_mi is not None:
        parts.append(f"I(A;O) {r.action_mi:.3f} of {r.action_mi_max:.3f} nats")
    parts.append(f"malformed {r.malformed_rate:.3f} (T={r.eval_temperature:g}: {r.eval_malformed_rate:.3f})")
    failures = f", {r.infra_failures} infrastructure failures left out" if r.infra_failures else ""
    return ", ".join(parts) + f" [{r.seconds:.0f}s{failures}]"


def format_levels(start: BoundaryReport, now: BoundaryReport) -> str | None:
    """One line for the log: the tasks solved at least once in N samples now against the start's,
    those gained and those lost (their indices); None when either report lacks them or they were
    measured on different tasks or sample counts."""
    if (start.tasks, start.samples_per_task, start.split) != (now.tasks, now.samples_per_task, now.split):
        return None
    if not start.solved and not now.solved:
        return None
    gained, lost = gained_and_lost(start.solved, now.solved)

    def ids(xs: tuple[int, ...]) -> str:
        return f" ({', '.join(map(str, xs))})" if xs else ""

    return (f"levels {now.tag} vs start ({now.tasks} {now.split} tasks, solved in {now.samples_per_task} samples): "
            f"{len(now.solved)} against {len(start.solved)}; gained {len(gained)}{ids(gained)}, lost {len(lost)}{ids(lost)}")
