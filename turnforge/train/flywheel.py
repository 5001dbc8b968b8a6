"""The data flywheel: rounds of collect -> filter -> train -> evaluate on the policy's own episodes.

Each round, top to bottom (``flywheel`` section of the config; the mechanisms of
``flywheel.mechanisms`` act at their hooks, in registry order: ``turnforge.train.mechanisms``):

1. collect, under an env-step budget (``env_steps_per_round``): the mechanisms' own episodes
   first (``curriculum``: from start states along earlier successes; ``anchor``: from states
   along the expert's solutions), then waves: the mechanisms' tasks (``evolve``: easier tasks
   derived from failed ones), then fresh train tasks:
   - ``allocation=uniform``: ``group_size`` rollouts per task;
   - ``allocation=adaptive`` (XRPO's idea, simplified): ``probe_rollouts`` per task first,
     the rest of ``group_size`` only where the outcome is uncertain (some probes succeeded,
     not all); solved and hopeless tasks get no more plain rollouts;
   - ``allocation=boundary`` (BroRL's idea, within the same budget): ``probe_rollouts`` per task
     first, then the wave's other ``(group_size - probe_rollouts) x tasks`` rollouts dealt by
     closeness to the boundary (``turnforge.algos.boundary.boundary_weight``: many on rarely
     solved tasks, few on always-solved ones), at most ``boundary_max_rollouts`` per task;
2. exploration aids on each wave's tasks no rollout solved (``retry``: more plain attempts;
   ``guidance``: re-attempts with the env's hints); the tasks still unsolved go to the
   mechanisms after collection (``anchor``: to the expert; ``evolve``: derived tasks);
3. filter (``turnforge.data.filters``) and route: the kept episodes go to rejection-sampling
   fine-tuning (``rft``: the loss on the policy's own action tokens; mechanisms may add samples,
   ``negatives`` failed turns pushed down by unlikelihood); a kept success on a
   task the plain policy mostly fails (plain success <= ``replay_max_success``) is a success
   on a hard task, which mechanisms keep (``replay``: trained on again in later rounds;
   ``curriculum``: a start state); with ``weighting=mc_awr`` (for stochastic envs) every turn
   of the round's episodes is trained on instead, weighted by its Monte-Carlo advantage from
   env-snapshot restarts made after each wave (``turnforge.train.awr``);
4. train: the stages in ``stages`` order: ``rft`` (supervised epochs on this round's kept
   samples plus the replayed ones), ``rl`` (one GRPO update on the round's plain groups,
   replayed samples added with the decoupled objective's truncated importance weights);
5. evaluate on ``eval_episodes`` held-out tasks (and, with ``pass_at_k``, measure pass@k:
   ``turnforge.train.boundary``), log a ``FlywheelRound`` record (each mechanism's part under
   its name), write the round's episodes to ``trajectories/flywheel_RRRRR.parquet``
   (``source`` column).

Every expert query is counted: hints that needed the env's solver (``FlywheelRound.expert_queries``)
and the expert's moves along anchored tasks (``FlywheelRound.anchor_expert_moves``). Departures from
the papers: XRPO allocates by a bandit over uncertainty and novelty, here by a two-stage probe (each
mechanism's docstring names its own).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from turnforge.algos import entropy_floor_penalty, signed_nll, weighted_nll
from turnforge.algos.boundary import boundary_allotment, boundary_weight, success_share
from turnforge.algos.estimators import ESTIMATORS
from turnforge.config import TrainConfig
from turnforge.data.filters import Candidate, FilterCount, FilterParams, apply_filters, kept_samples
from turnforge.data.store import write_trajectories
from turnforge.dist import masked_mean_over_ranks, micro_batches, sync_sampler
from turnforge.errors import RunStopped
from turnforge.optim import GuardedStep, set_lr
from turnforge.policy.generate import token_logprobs
from turnforge.policy.model import Policy
from turnforge.rollout.actors import Actor, PolicyActor
from turnforge.rollout.context import CONTEXTS
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine
from turnforge.seeding import generator, rng, stable_hash
from turnforge.train.awr import AWRRound
from turnforge.train.common import action_entropy, collate
from turnforge.train.credit import drop_void, sample_advantage
from turnforge.train.mechanisms import Mechanism, MechanismRecord, enabled
from turnforge.train.metrics import AWRStats, FlywheelRound, summary_stats, summary_text
from turnforge.train.rl import training_state
from turnforge.train.run_dir.checkpoint import keep_weights, save_resumable
from turnforge.train.run_dir.failures import check_trajectories
from turnforge.train.session import Session
from turnforge.train.update import ppo_update
from turnforge.types import Sample, Task, Trajectory


@dataclass
class FlywheelState:
    """What carries over from round to round (and through a resumable checkpoint)."""

    mechanisms: dict[str, Any] = field(default_factory=dict)  # each mechanism's state (Mechanism.state), by name
    start_entropy: float | None = None  # round 1's action entropy before its update (the entropy guard's reference)


class Collection:
    """One round's collection under its env-step budget: plays episodes (checking their
    infrastructure failures), counts their turns and keeps each with its source (``played``), in
    the order played. The round's waves and the mechanisms' hooks play through it."""

    def __init__(self, cfg: TrainConfig, r: int, engine: RolloutEngine, policy: Policy, snapshots: bool,
                 report: Callable[[int], None]) -> None:
        self.cfg, self.r, self.engine, self.policy, self.snapshots, self.report = cfg, r, engine, policy, snapshots, report
        self.played: list[tuple[Trajectory, str]] = []
        self.steps = 0  # env steps of the round so far
        self.thinking = [0, 0, 0]  # a reasoning template's thinking tokens, answer tokens, turns cut at the budget
        self.actor = self.policy_actor(cfg.flywheel.temperature, "flywheel")  # the round's plain sampler

    def policy_actor(self, temperature: float, stream: str) -> PolicyActor:
        """The policy at ``temperature``, with the round's random stream ``stream``."""
        return PolicyActor(self.policy, self.cfg.rollout.max_new_tokens, temperature, generator(self.cfg.seed, stream, self.r),
                           episode_seed=self.cfg.episode_seed(stream, self.r))

    def requests(self, tasks: list[Task], n: int, tag: str, offset: int = 0) -> list[EpisodeRequest]:
        """``n`` episodes of each task (group ``TAG-R-TASK``, rollouts ``offset`` on), seeded by the round."""
        cfg, r = self.cfg, self.r
        return [EpisodeRequest(t, stable_hash(cfg.seed, "flywheel", r, tag, t.task_id, g), f"{tag}-{r}-{t.task_id}",
                               f"{tag}-{r}-{t.task_id}-{g}") for t in tasks for g in range(offset, offset + n)]

    def play(self, requests: list[EpisodeRequest], source: str, actor: Actor | None = None, *,
             engine: RolloutEngine | None = None, snapshots: bool | None = None) -> list[Trajectory]:
        """Play ``requests`` (by the round's plain actor on the run's engine, unless told) and keep them as ``source``."""
        if not requests:
            return []
        engine = self.engine if engine is None else engine
        trajs, stats = engine.play(requests, self.actor if actor is None else actor,
                                   keep_snapshots=self.snapshots if snapshots is None else snapshots)
        check_trajectories(f"flywheel round {self.r + 1}", self.engine.env.env_id, trajs, self.cfg.max_failure_share,
                           kind=f"{source} episodes")
        self.played.extend((t, source) for t in trajs)
        self.add_steps(stats.turns)
        for i, n in enumerate((stats.thinking_tokens, stats.answer_tokens, stats.thinking_cuts)):
            self.thinking[i] += n
        return trajs

    def add_steps(self, n: int) -> None:
        self.steps += n
        self.report(min(self.steps, self.cfg.flywheel.env_steps_per_round))

    def count(self, source: str) -> tuple[int, int]:
        """(scored episodes, successes) the round played as ``source``."""
        got = [t for t, x in self.played if x == source and t.infra_failure is None]
        return len(got), _successes(got)


def run_flywheel(s: Session, optimizer: torch.optim.Optimizer, resumed: FlywheelState | None = None) -> list[FlywheelRound]:
    """``flywheel.rounds`` rounds (see the module docstring); returns the records of the rounds
    it played. After every round but the last it leaves a resumable checkpoint (the weights, the
    optimizer, the counters, this ``FlywheelState``): a resume (``resumed``, with the optimizer's
    state loaded) goes on with round ``s.state.flywheel_rounds_done + 1``, as an uninterrupted run
    would (every random stream is derived from the seed and the round)."""
    cfg, fw = s.cfg, s.cfg.flywheel
    state, records = resumed if resumed is not None else FlywheelState(), []
    mechs = [cls(cfg, state.mechanisms.get(cls.name)) for cls in enabled(fw.mechanisms)]
    state.mechanisms = {m.name: m.state for m in mechs}
    with ExitStack() as opened:
        for m in mechs:
            m.open(s.policy)
            opened.callback(m.close)
        step = GuardedStep(s.policy.train_model, optimizer, cfg.rl.max_grad_norm, cfg.rl.max_bad_steps)
        s.progress.stage("flywheel", fw.rounds)
        for r in range(s.state.flywheel_rounds_done, fw.rounds):
            records.append(_round(s, state, mechs, optimizer, step, r))
            keep_weights(s.run, s.policy, f"round-{r + 1}", cfg.keep_checkpoints)
            s.state.flywheel_rounds_done = r + 1
            if r + 1 < fw.rounds:  # the last round's checkpoint is the stage's own (train())
                s.state.wall_seconds = s.wall_seconds()
                save_resumable(s.run, s.policy, s.state, training_state(s.policy, optimizer, memory=s.memory, flywheel=state))
            s.progress.update(r + 1, success=records[-1].eval.success_rate)
    return records


def _round(s: Session, st: FlywheelState, mechs: list[Mechanism], optimizer: torch.optim.Optimizer,
           step: GuardedStep, r: int) -> FlywheelRound:
    cfg, fw = s.cfg, s.cfg.flywheel
    t0 = time.time()
    awr = AWRRound.start(s, r) if fw.weighting != "success" else None

    # 1.+2. collect under the step budget: the mechanisms' episodes, then waves, each wave's unsolved tasks to the aids
    with s.progress.activity(f"flywheel round {r + 1}: collect", fw.env_steps_per_round, "env steps") as report:
        snapshots = any(m.keeps_snapshots for m in mechs) or fw.weighting == "mc_awr"  # curriculum starts, mc_awr restarts
        col = Collection(cfg, r, s.rollout_engine, s.policy, snapshots, report)
        plain, unsolved = collect(col, mechs, awr)
    for m in mechs:
        m.after_collection(col, plain, unsolved)
    remembered = s.remember(col.played, "flywheel", r)  # episodic memory: the evaluation and later rounds recall them

    # 3. filter and route
    rate = {k: _successes(v) / max(sum(t.infra_failure is None for t in v), 1) for k, v in plain.items()}
    offered = [c for m in mechs for c in m.candidates(col)]
    kept, counts, replayed = route(col.played, offered, mechs, rate, cfg)

    # 4. train
    entropy = action_entropy(s.policy, [x for group in plain.values() for t in group for x in t.samples],
                             limit=fw.entropy_samples)
    if st.start_entropy is None:
        st.start_entropy = entropy
    rft_samples, awr_stats, dropped = 0, None, 0
    for stage in fw.stages:
        if stage == "rft":
            if awr is not None:  # every turn of the round's episodes, weighted by its Monte-Carlo advantage
                samples, weights, awr_stats = awr.training_data()
            else:
                shares = pass_k_shares(kept, plain, fw.pass_k) + [1.0] * len(replayed)
                trained = [(c, w) for c, w in zip(kept + replayed, shares) if w > 0]
                dropped = len(kept) + len(replayed) - len(trained)
                samples, weights = rft_data(s.policy, [c for c, _ in trained], mechs, [w for _, w in trained])
            if not samples:
                why = f"; flywheel.pass_k={fw.pass_k} weighs {dropped} of them 0" if dropped else ""
                raise RunStopped(f"flywheel round {r + 1}: no episode passed the filters ({_funnel(counts)}{why}); "
                                 "nothing to train on (loosen flywheel.filters or raise flywheel.env_steps_per_round)")
            if awr is None:  # the mechanisms' own samples (negatives: failed turns, weight < 0)
                for m in mechs:
                    more, w = m.rft_extra(col)
                    samples, weights = samples + more, weights + w
            rft_samples = len(samples)
            _rft(s, step, samples, weights, r, fw.entropy_floor * (st.start_entropy or 0.0))
        else:
            _grpo(s, optimizer, step, [t for v in plain.values() for t in v], replayed, r)
        s.policy.version += 1
        sync_sampler(s.policy)  # on several ranks: the sharded trainer's new weights into the sampling model

    # 5. record (on several ranks every rank played the round alike; rank 0 writes it), evaluate
    s.run.write(s.run.trajectory_file(f"flywheel_{r:05d}"), partial(
        write_trajectories, trajectories=[t for t, _ in col.played], stage="flywheel", iteration=r,
        sources={t.trajectory_id: src for t, src in col.played}))
    s.state.env_steps += col.steps
    prefills = s.prefills()
    result = s.evaluate(f"flywheel-{r + 1}", episodes=fw.eval_episodes, prefills=prefills)
    boundary = s.boundary(f"flywheel-{r + 1}", result, prefills) if fw.pass_at_k else None
    expert = [m.expert_use() for m in mechs]
    record = FlywheelRound(
        round=r + 1, round_env_steps=col.steps, tasks=len(plain), plain=col.count("plain"), unsolved_tasks=len(unsolved),
        filters=counts, rft_samples=rft_samples, entropy=entropy, eval=result, seconds=round(time.time() - t0, 2),
        mechanisms=mechanism_records(col, mechs),
        expert_queries=sum(x.hints for x in expert), anchor_expert_moves=sum(x.moves for x in expert),
        boundary=boundary, awr=awr_stats, pass_k_dropped=dropped, memory_entries=len(s.memory) if s.memory is not None else 0,
        memory_added=remembered, memory_recalls=sum(1 for t, _ in col.played if t.memory_tokens),
        summaries=summary_stats([t for t, _ in col.played]) if CONTEXTS[cfg.rollout.context].writes_summaries else None,
        thinking_tokens=col.thinking[0], answer_tokens=col.thinking[1], thinking_cuts=col.thinking[2],
    )
    s.metrics.log(record, s.state.env_steps)
    s.progress.message(_message(record, mechs, len(kept), awr_stats, cfg, s.memory is not None))
    return record


def collect(col: Collection, mechs: list[Mechanism], awr: AWRRound | None) -> tuple[dict[str, list[Trajectory]], list[Task]]:
    """Steps 1 and 2 of a round: the mechanisms' own episodes (``begin``), then waves until the
    budget is spent, the mechanisms' tasks (``first_wave``) before fresh ones; after each wave,
    the tasks none of whose rollouts succeeded go through the mechanisms' ``after_wave``. Returns
    the plain episodes by task id (fresh and mechanisms' tasks) and the tasks left unsolved."""
    cfg, fw = col.cfg, col.cfg.flywheel
    for m in mechs:
        m.begin(col)
    firsts = [(m.source, tasks) for m in mechs if (tasks := m.first_wave(col))]
    plain: dict[str, list[Trajectory]] = {}
    unsolved: list[Task] = []
    wave = 0
    while col.steps < fw.env_steps_per_round:
        if wave < len(firsts):
            source, tasks = firsts[wave]
        else:
            ids = rng(cfg.seed, "flywheel-tasks", col.r, wave).integers(0, 2**31 - 1, fw.tasks_per_wave)
            source, tasks = "plain", [col.engine.env.task("train", int(i)) for i in ids]
        wave += 1
        _play_groups(col, tasks, source, plain)
        if awr is not None:  # mc_awr: Q and V of the wave's states; the restarts count in the round's budget
            col.add_steps(awr.estimate([x for t in tasks for x in plain[t.task_id]]))
        failed = [t for t in tasks if _successes(plain[t.task_id]) == 0 and any(x.infra_failure is None for x in plain[t.task_id])]
        for m in mechs:
            failed = m.after_wave(col, failed)
        unsolved += failed
    return plain, unsolved


def _play_groups(col: Collection, tasks: list[Task], source: str, plain: dict[str, list[Trajectory]]) -> None:
    """A wave's groups (``flywheel.allocation``), added to ``plain`` by task id."""
    fw = col.cfg.flywheel
    first = fw.group_size if fw.allocation == "uniform" else fw.probe_rollouts
    for t in col.play(col.requests(tasks, first, "p"), source):
        plain.setdefault(t.task.task_id, []).append(t)
    if fw.allocation == "adaptive" and fw.group_size > first:
        unsure = [t for t in tasks if 0 < _successes(plain[t.task_id]) < len(plain[t.task_id])]
        for t in col.play(col.requests(unsure, fw.group_size - first, "p", first), source):
            plain[t.task.task_id].append(t)
    if fw.allocation == "boundary" and fw.group_size > first:  # the wave's uniform budget, dealt by closeness to the boundary
        weights = [boundary_weight(len(ok := [x for x in plain[t.task_id] if x.infra_failure is None]), _successes(ok))
                   for t in tasks]
        more = boundary_allotment(weights, (fw.group_size - first) * len(tasks), fw.boundary_max_rollouts - first)
        reqs = [q for t, n in zip(tasks, more) if n for q in col.requests([t], n, "p", first)]
        for t in col.play(reqs, source):
            plain[t.task.task_id].append(t)


def route(played: list[tuple[Trajectory, str]], offered: list[Candidate], mechs: list[Mechanism],
          rate: dict[str, float], cfg: TrainConfig) -> tuple[list[Candidate], list[FilterCount], list[Candidate]]:
    """Step 3: the played episodes of the sources trained as played, then the mechanisms'
    ``offered`` candidates, through ``flywheel.filters``; the kept successes on hard tasks (plain
    success ``rate`` at most ``replay_max_success``) go to the mechanisms' ``route``. Returns the
    kept candidates, the filter counts and the earlier episodes the mechanisms give back to train on."""
    fw = cfg.flywheel
    as_played = {"plain"} | {m.source for m in mechs if m.source and m.trains_as_played}
    candidates = [Candidate.of(t, src) for t, src in played if src in as_played] + offered
    kept, counts = apply_filters(candidates, fw.filters, FilterParams(fw.min_reward, fw.max_length, fw.per_task_cap))
    not_hard = {m.source for m in mechs if not m.counts_as_hard}
    hard = [c for c in kept if c.trajectory.success and c.source not in not_hard
            and rate.get(c.trajectory.task.task_id, 0.0) <= fw.replay_max_success]
    replayed = [c for m in mechs for c in m.route(hard)]
    return kept, counts, replayed


def rft_data(policy: Policy, data: list[Candidate], mechs: list[Mechanism],
             scale: list[float] | None = None) -> tuple[list[Sample], list[float]]:
    """The samples of the kept turns and their weights: 1, or what the mechanism whose source
    the candidate has says (``guidance`` with ``guided_training=is``: importance weights), times
    the candidate's ``scale`` (``pass_k_shares``)."""
    owner = {m.source: m for m in mechs if m.source}
    samples, weights = [], []
    for i, c in enumerate(data):
        xs = kept_samples([c])
        samples.extend(xs)
        w = owner[c.source].sample_weights(policy, xs) if c.source in owner else None
        f = 1.0 if scale is None else scale[i]
        weights.extend([f] * len(xs) if w is None else [f * x for x in w])
    return samples, weights


def pass_k_shares(kept: list[Candidate], plain: dict[str, list[Trajectory]], k: int) -> list[float]:
    """Each kept candidate's weight under ``flywheel.pass_k``: a success of the plain rollouts
    weighs what it adds to its task's pass@k among them (``turnforge.algos.success_share``: 0 on
    a task every k of whose rollouts hold another success); other sources, and every candidate
    at k = 1, weigh 1."""
    out = []
    for c in kept:
        group = [t for t in plain.get(c.trajectory.task.task_id, []) if t.infra_failure is None]
        plain_success = k > 1 and c.source == "plain" and c.trajectory.success and group
        out.append(success_share(len(group), _successes(group), k) if plain_success else 1.0)
    return out


def mechanism_records(col: Collection, mechs: list[Mechanism]) -> dict[str, MechanismRecord]:
    """Each mechanism's part of the round's record, by name, with its source's episodes."""
    return {m.name: m.record(col.count(m.source) if m.source else None) for m in mechs}


def _message(record: FlywheelRound, mechs: list[Mechanism], kept: int, awr: AWRStats | None, cfg: TrainConfig,
             memory: bool) -> str:
    parts = [f"plain {record.plain[1]}/{record.plain[0]}"]
    parts += [text for m in mechs if (text := m.summary(record.mechanisms[m.name]))]
    return (f"flywheel round {record.round}: {record.round_env_steps} env steps, {', '.join(parts)}; "
            f"kept {kept} episodes"
            + (f" ({record.pass_k_dropped} weigh 0 at pass@{cfg.flywheel.pass_k}: too few failures beside them)"
               if cfg.flywheel.pass_k > 1 else "")
            + f", {record.rft_samples} samples; "
            + (f"{cfg.flywheel.weighting}: {awr.states} states, {awr.env_steps} restart steps, ESS {awr.ess:.2f}; "
               if awr else "")
            + (f"memory {record.memory_entries} tasks (+{record.memory_added}), recalled in {record.memory_recalls} "
               "episodes; " if memory else "")
            + (f"summaries {summary_text(record.summaries)}; " if record.summaries is not None else "")
            + f"held-out success {record.eval.success_rate:.3f}")


def _funnel(counts: list[FilterCount]) -> str:
    """'120 episodes -> infra 120 -> success 0' for a message."""
    if not counts:
        return "no filters"
    return " -> ".join([f"{counts[0].episodes_in} episodes"] + [f"{c.name} {c.episodes_out}" for c in counts])


def _successes(trajs: list[Trajectory]) -> int:
    return sum(t.success for t in trajs if t.infra_failure is None)


def _rft(s: Session, step: GuardedStep, samples: list[Sample], weights: list[float], r: int, floor: float = 0.0) -> None:
    """Supervised epochs on the kept samples' action tokens (weighted per sample). With an
    entropy ``floor`` > 0 (the guard), a batch whose mean action entropy is below it adds
    ``entropy_guard_coef x (floor - entropy)`` to the loss: fine-tuning on the policy's own
    successes then sharpens it only down to the floor (an entropy-targeting hinge, in the spirit
    of clip-higher and Clip-Cov, which act on the PPO ratio instead). On several trainer ranks
    each takes its share of every minibatch (``turnforge.dist``), the floor on the whole
    minibatch's entropy. A minibatch over ``model.micro_batch_tokens`` padded tokens runs in
    several passes (``turnforge.dist.micro_batches``); the floor then holds each pass's mean
    entropy, weighted by the pass's share of the tokens (a departure: the hinge is not a sum over rows)."""
    fw, policy = s.cfg.flywheel, s.policy
    set_lr(step.optimizer, fw.rft_lr)
    w_all = torch.tensor(weights, dtype=torch.float32)
    model = policy.train_model
    model.train()
    per_epoch = -(-len(samples) // fw.rft_batch_size)
    with s.progress.activity(f"flywheel round {r + 1}: fine-tune", fw.rft_epochs * per_epoch, "steps") as report:
        for epoch in range(fw.rft_epochs):
            order = rng(s.cfg.seed, "flywheel-rft", r, epoch).permutation(len(samples))
            for k, b in enumerate(range(0, len(samples), fw.rft_batch_size)):
                idx = order[b:b + fw.rft_batch_size].tolist()
                s.state.train_tokens += sum(len(samples[i]) for i in idx)
                for part in micro_batches(idx, lambda i: samples[i].num_action_tokens, lambda i: len(samples[i]),
                                          s.cfg.model.micro_batch_tokens):
                    batch = collate([samples[i] for i in part.rows], policy.pad_id, vision=policy.vision)
                    lp, ent = token_logprobs(model, batch.ids, batch.attention, with_entropy=floor > 0,
                                             positions=batch.mask, vision=batch.vision)
                    w = w_all[part.rows]
                    loss = signed_nll(lp, batch.mask, w) if bool((w < 0).any()) else weighted_nll(lp, batch.mask, w)
                    if part.factor != 1.0:
                        loss = loss * part.factor
                    if floor > 0:
                        hinge = entropy_floor_penalty(ent, batch.mask * (part.factor > 0), floor, fw.entropy_guard_coef,
                                                      mean=masked_mean_over_ranks)
                        loss = loss + (hinge if part.fraction == 1.0 else hinge * part.fraction)
                    step.backward(loss)
                step.step()
                report(epoch * per_epoch + k + 1)
    model.eval()


def _grpo(s: Session, optimizer: torch.optim.Optimizer, step: GuardedStep, trajs: list[Trajectory],
          replayed: list[Candidate], r: int) -> None:
    """One GRPO update on the round's plain groups (rl section's advantage settings, rl.malformed); the
    replayed successes join with advantage 1 and the decoupled objective's off-policy weights
    (engine.correction: they were sampled by older policies)."""
    ok, _ = drop_void([t for t in trajs if t.infra_failure is None], s.cfg.rl)
    per_turn = ESTIMATORS[s.cfg.rl.advantage].turn_advantages(ok, s.cfg.rl)
    pairs = [(x, sample_advantage(x, per_turn[t.trajectory_id])) for t in ok for x in t.samples]
    pairs += [(x, 1.0) for c in replayed for x in kept_samples([c])]
    if pairs:
        set_lr(optimizer, s.cfg.rl.lr)
        ppo_update(s.policy, pairs, step, s.cfg.rl, temperature=s.cfg.rollout.temperature,
                   shuffle=rng(s.cfg.seed, "rl-shuffle", stable_hash("flywheel", r)), decoupled=bool(replayed),
                   engine=s.cfg.engine, micro_batch_tokens=s.cfg.model.micro_batch_tokens)


__all__ = ["Collection", "FlywheelState", "collect", "mechanism_records", "pass_k_shares", "rft_data", "route", "run_flywheel"]
