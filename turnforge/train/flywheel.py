"""The data flywheel: rounds of collect -> filter -> train -> evaluate on the policy's own episodes.

Each round, top to bottom (``flywheel`` section of the config):

1. collect, under an env-step budget (``env_steps_per_round``), waves of fresh train tasks
   plus the live derived tasks (``evolve``):
   - ``allocation=uniform``: ``group_size`` rollouts per task;
   - ``allocation=adaptive`` (XRPO's idea, simplified): ``probe_rollouts`` per task first,
     the rest of ``group_size`` only where the outcome is uncertain (some probes succeeded,
     not all); solved and hopeless tasks get no more plain rollouts;
2. exploration aids on the tasks no plain rollout solved:
   - ``retry`` (pass@k-style search): ``retry_rollouts`` more plain attempts on each, at
     ``retry_temperature``; a task one of them solves leaves the list the aids below get, and
     its success, on a task the policy mostly fails, goes to RFT and the replay buffer;
   - ``guidance`` (Agent-RLVR): re-attempts with the env's hints (``guidance_level``) in the
     observations; the hints are stripped from the contexts before training
     (``turnforge.rollout.context.rerender``); with ``guided_training=is`` each guided
     sample is weighted by pi(a | unguided context) / mu(a | guided context), truncated at 1;
   - ``curriculum`` (start-state curriculum): unguided episodes started from env snapshots
     along earlier successes on hard tasks, ``depth`` turns before their end; the depth grows
     by one when the success at it reaches ``curriculum_advance``;
   - ``anchor`` (BREAD / R3): tasks no plain rollout solved are solved once by the env's
     expert; the policy plays on from a state along that solution, an anchor that moves back
     toward the real start, per task, as the policy's success at it rises
     (``turnforge.train.anchors``);
   - ``evolve`` (WebRL): the env derives easier tasks from each failed one
     (``Env.derive_tasks``); they are played in later rounds while informative and retired
     when a round solves all of their rollouts (or, unsolved, after three rounds);
3. filter (``turnforge.data.filters``) and route: the kept episodes go to rejection-sampling
   fine-tuning (``rft``: the loss on the policy's own action tokens); a kept success on a
   task the plain policy mostly fails (plain success <= ``replay_max_success``) also enters
   the replay buffer (``replay``), trained on again in later rounds; with ``weighting=mc_awr`` (for
   stochastic envs) every turn of the round's episodes is trained on instead, weighted by its
   Monte-Carlo advantage from env-snapshot restarts made after each wave (``turnforge.train.awr``);
4. train: the stages in ``stages`` order: ``rft`` (supervised epochs on this round's kept
   samples plus the replay buffer), ``rl`` (one GRPO update on the round's plain groups,
   replayed samples added with the decoupled objective's truncated importance weights);
5. evaluate on ``eval_episodes`` held-out tasks (and, with ``pass_at_k``, measure pass@k:
   ``turnforge.train.boundary``), log a ``FlywheelRound`` record, write the round's episodes to
   ``trajectories/flywheel_RRRRR.parquet`` (``source`` column).

Every expert query is counted: hints that needed the env's solver
(``FlywheelRound.expert_queries``) and the expert's moves along anchored tasks
(``FlywheelRound.anchor_expert_moves``). Departures from the papers: XRPO allocates by a bandit over uncertainty and
novelty, here by a two-stage probe; WebRL derives tasks with an LLM, here with an env hook;
Agent-RLVR trains guided trajectories with RL, here with RFT (or importance-weighted RFT).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from turnforge.algos import entropy_floor_penalty
from turnforge.config import TrainConfig
from turnforge.data.filters import Candidate, FilterCount, FilterParams, apply_filters, kept_samples
from turnforge.data.store import write_trajectories
from turnforge.envs.base import strip_guidance
from turnforge.errors import RunStopped
from turnforge.policy.generate import token_logprobs
from turnforge.rollout.actors import Actor, ExpertActor, PolicyActor
from turnforge.rollout.context import rerender
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine, make_engine
from turnforge.seeding import generator, rng, stable_hash
from turnforge.train import anchors
from turnforge.train.awr import AWRRound
from turnforge.train.common import GuardedStep, action_entropy, collate
from turnforge.train.credit import drop_void, sample_advantage, turn_advantages
from turnforge.train.metrics import FlywheelRound
from turnforge.train.rl import training_state
from turnforge.train.run_dir.checkpoint import keep_weights, save_resumable
from turnforge.train.run_dir.failures import check_trajectories
from turnforge.train.run_dir.session import Session
from turnforge.train.update import ppo_update
from turnforge.types import EnvSnapshot, Sample, Task, Trajectory


@dataclass
class _Start:
    """A curriculum start: a snapshot ``FlywheelState.depth`` turns before the end of a success."""

    task: Task
    snapshot: EnvSnapshot


@dataclass
class FlywheelState:
    """What carries over from round to round."""

    replay: list[Candidate] = field(default_factory=list)
    starts: list[tuple[Task, tuple[EnvSnapshot, ...]]] = field(default_factory=list)  # successes on hard tasks
    depth: int = 1
    evolved: dict[str, tuple[Task, int]] = field(default_factory=dict)  # task id -> (task, rounds played unsolved)
    retired: int = 0
    expert_queries: int = 0
    start_entropy: float | None = None  # round 1's action entropy before its update (the entropy guard's reference)
    anchors: anchors.AnchorPool = field(default_factory=anchors.AnchorPool)


def guided_config(cfg: TrainConfig) -> TrainConfig:
    """The run's config with the env's hints on (``flywheel.guidance_level``)."""
    out = cfg.model_copy(deep=True)
    out.env.kwargs = {**dict(cfg.env.kwargs), "guidance": cfg.flywheel.guidance_level}
    return out


def run_flywheel(s: Session, optimizer: torch.optim.Optimizer, resumed: FlywheelState | None = None) -> list[FlywheelRound]:
    """``flywheel.rounds`` rounds (see the module docstring); returns the records of the rounds
    it played. After every round but the last it leaves a resumable checkpoint (the weights, the
    optimizer, the counters, this ``FlywheelState``): a resume (``resumed``, with the optimizer's
    state loaded) goes on with round ``s.state.flywheel_rounds_done + 1``, as an uninterrupted run
    would (every random stream is derived from the seed and the round)."""
    cfg, fw = s.cfg, s.cfg.flywheel
    guided = make_engine(guided_config(cfg), s.policy) if "guidance" in fw.mechanisms else None
    state, records = resumed if resumed is not None else FlywheelState(), []
    step = GuardedStep(s.policy.model, optimizer, cfg.rl.max_grad_norm, cfg.rl.max_bad_steps)
    s.progress.stage("flywheel", fw.rounds)
    try:
        for r in range(s.state.flywheel_rounds_done, fw.rounds):
            records.append(_round(s, state, guided, optimizer, step, r))
            keep_weights(s.run_dir, s.policy, f"round-{r + 1}", cfg.keep_checkpoints)
            s.state.flywheel_rounds_done = r + 1
            if r + 1 < fw.rounds:  # the last round's checkpoint is the stage's own (train())
                s.state.wall_seconds = s.wall_seconds()
                save_resumable(s.run_dir, s.policy, s.state, training_state(s.policy, optimizer, memory=s.memory, flywheel=state))
            s.progress.update(r + 1, success=records[-1].eval.success_rate)
    finally:
        if guided is not None:
            guided.close()
    return records


def _round(s: Session, st: FlywheelState, guided: RolloutEngine | None, optimizer: torch.optim.Optimizer,
           step: GuardedStep, r: int) -> FlywheelRound:
    cfg, fw, policy, engine = s.cfg, s.cfg.flywheel, s.policy, s.rollout_engine
    env = engine.env
    t0 = time.time()
    actor = PolicyActor(policy, cfg.rollout.max_new_tokens, fw.temperature, generator(cfg.seed, "flywheel", r))
    keep = "curriculum" in fw.mechanisms or fw.weighting == "mc_awr"  # snapshots: curriculum starts, mc_awr restarts
    awr = AWRRound.start(s, r) if fw.weighting != "success" else None
    played: list[tuple[Trajectory, str]] = []
    steps = 0

    def play(engine: RolloutEngine, requests: list[EpisodeRequest], source: str, by: Actor = actor,
             snapshots: bool = keep) -> list[Trajectory]:
        nonlocal steps
        if not requests:
            return []
        trajs, stats = engine.play(requests, by, keep_snapshots=snapshots)
        check_trajectories(f"flywheel round {r + 1}", env.env_id, trajs, cfg.max_failure_share, kind=f"{source} episodes")
        steps += stats.turns
        played.extend((t, source) for t in trajs)
        report(min(steps, fw.env_steps_per_round))
        return trajs

    def requests(tasks: list[Task], n: int, tag: str, offset: int = 0) -> list[EpisodeRequest]:
        return [EpisodeRequest(t, stable_hash(cfg.seed, "flywheel", r, tag, t.task_id, g), f"{tag}-{r}-{t.task_id}",
                               f"{tag}-{r}-{t.task_id}-{g}") for t in tasks for g in range(offset, offset + n)]

    # 1.+2. collect under the step budget: the curriculum's starts and a wave of derived tasks
    #    first, then waves of fresh tasks; each wave's unsolved tasks get guided re-attempts
    with s.progress.activity(f"flywheel round {r + 1}: collect", fw.env_steps_per_round, "env steps") as report:
        plain: dict[str, list[Trajectory]] = {}
        retry = (PolicyActor(policy, cfg.rollout.max_new_tokens, fw.retry_temperature or fw.temperature,
                             generator(cfg.seed, "flywheel-retry", r)) if "retry" in fw.mechanisms else None)
        unsolved: list[Task] = []
        guided_trajs: list[Trajectory] = []
        depth_success = None
        if "curriculum" in fw.mechanisms and st.starts:
            starts = _curriculum_starts(st, fw.curriculum_starts, rng(cfg.seed, "flywheel-curriculum", r))
            reqs = [EpisodeRequest(x.task, stable_hash(cfg.seed, "flywheel", r, "c", i, g), f"c-{r}-{i}", f"c-{r}-{i}-{g}",
                                   start=x.snapshot) for i, x in enumerate(starts) for g in range(fw.curriculum_rollouts)]
            ok = [t for t in play(engine, reqs, "curriculum") if t.infra_failure is None]
            depth_success = _successes(ok) / max(len(ok), 1)
            if depth_success >= fw.curriculum_advance:
                st.depth += 1
        if "anchor" in fw.mechanisms:  # last round's unsolved tasks to the expert, then the anchored episodes
            anchors.admit(st.anchors, cfg, lambda reqs: play(engine, reqs, "demo", ExpertActor(), True), r)
            got = play(engine, anchors.requests(st.anchors, cfg, r, engine.caps.reseed), "anchor")
            anchors.update(st.anchors, got, cfg)
        pool = [t for t, _ in st.evolved.values()]
        evolved = [pool[int(i)] for i in rng(cfg.seed, "flywheel-evolved", r).permutation(len(pool))[:fw.tasks_per_wave]]
        wave = 0
        while steps < fw.env_steps_per_round:
            if wave == 0 and evolved:
                tasks, source = evolved, "evolved"
            else:
                ids = rng(cfg.seed, "flywheel-tasks", r, wave).integers(0, 2**31 - 1, fw.tasks_per_wave)
                tasks, source = [env.task("train", int(i)) for i in ids], "plain"
            wave += 1
            first = fw.probe_rollouts if fw.allocation == "adaptive" else fw.group_size
            for t in play(engine, requests(tasks, first, "p"), source):
                plain.setdefault(t.task.task_id, []).append(t)
            if fw.allocation == "adaptive" and fw.group_size > first:
                unsure = [t for t in tasks if 0 < _successes(plain[t.task_id]) < len(plain[t.task_id])]
                for t in play(engine, requests(unsure, fw.group_size - first, "p", first), source):
                    plain[t.task.task_id].append(t)
            if awr is not None:  # mc_awr: Q and V of the wave's states; the restarts count in the round's budget
                steps += awr.estimate([x for t in tasks for x in plain[t.task_id]])
                report(min(steps, fw.env_steps_per_round))
            failed = [t for t in tasks if _successes(plain[t.task_id]) == 0 and any(x.infra_failure is None for x in plain[t.task_id])]
            if retry is not None and failed:  # more attempts on the tasks no rollout solved; a success takes them off the list
                got = play(engine, requests(failed, fw.retry_rollouts, "r"), "retry", retry)
                solved = {t.task.task_id for t in got if t.success and t.infra_failure is None}
                failed = [t for t in failed if t.task_id not in solved]
            unsolved += failed
            if guided is not None and failed:
                got = play(guided, requests(failed, fw.guided_rollouts, "g"), "guided")
                guided_trajs += got
                st.expert_queries += sum(int(turn.info.get("n_expert_queries", 0)) for t in got for turn in t.turns)
    rate = {k: _successes(v) / max(sum(t.infra_failure is None for t in v), 1) for k, v in plain.items()}
    if "anchor" in fw.mechanisms:
        anchors.wait(st.anchors, unsolved, cfg)
    if "evolve" in fw.mechanisms:
        _evolve(s, st, plain, unsolved, r)

    remembered = s.remember(played, "flywheel", r)  # episodic memory: the evaluation and later rounds recall them

    # 3. filter and route
    params = FilterParams(fw.min_reward, fw.max_length, fw.per_task_cap)
    candidates = [Candidate.of(t, src) for t, src in played if src not in ("guided", "demo")]
    candidates += [c for c in (_unguided(s, t) for t in guided_trajs) if c is not None]
    kept, counts = apply_filters(candidates, fw.filters, params)
    hard = [c for c in kept if c.trajectory.success and c.source != "curriculum"
            and rate.get(c.trajectory.task.task_id, 0.0) <= fw.replay_max_success]
    if "curriculum" in fw.mechanisms:  # successes on hard tasks seed later start states (snapshots kept in memory)
        st.starts.extend((c.trajectory.task, tuple(c.trajectory.snapshots[i] for i in c.turns)) for c in hard
                         if c.source in ("plain", "guided") and c.trajectory.snapshots)
        st.starts = st.starts[-fw.replay_size:]
    replayed = list(st.replay) if "replay" in fw.mechanisms else []
    if "replay" in fw.mechanisms:
        st.replay = (st.replay + hard)[-fw.replay_size:]  # with their own source (guided ones keep their IS weights)

    # 4. train
    entropy = action_entropy(s.policy, [x for group in plain.values() for t in group for x in t.samples],
                             limit=fw.entropy_samples)
    if st.start_entropy is None:
        st.start_entropy = entropy
    rft_samples, awr_stats = 0, None
    for stage in fw.stages:
        if stage == "rft":
            data = kept + replayed
            if awr is not None:  # every turn of the round's episodes, weighted by its Monte-Carlo advantage
                samples, weights, awr_stats = awr.training_data()
            else:
                samples, weights = _rft_data(s, data)
            if not samples:
                raise RunStopped(f"flywheel round {r + 1}: no episode passed the filters ({_funnel(counts)}); "
                                 "nothing to train on (loosen flywheel.filters or raise flywheel.env_steps_per_round)")
            rft_samples = len(samples)
            floor = fw.entropy_floor * (st.start_entropy or 0.0)
            _rft(s, step, samples, weights, r, floor)
        else:
            _grpo(s, optimizer, step, [t for v in plain.values() for t in v], replayed, r)
        policy.version += 1

    # 5. record, evaluate
    sources: dict[str, str] = {t.trajectory_id: src for t, src in played}
    write_trajectories(s.run_dir / "trajectories" / f"flywheel_{r:05d}.parquet", [t for t, _ in played],
                       stage="flywheel", iteration=r, sources=sources)
    s.state.env_steps += steps
    prefills = s.prefills()
    result = s.evaluate(f"flywheel-{r + 1}", episodes=fw.eval_episodes, prefills=prefills)
    boundary = s.boundary(f"flywheel-{r + 1}", result, prefills) if fw.pass_at_k else None

    def count(src: str) -> tuple[int, int]:
        got = [t for t, x in played if x == src and t.infra_failure is None]
        return len(got), _successes(got)

    record = FlywheelRound(
        round=r + 1, round_env_steps=steps, tasks=len(plain), plain=count("plain"), retry=count("retry"), guided=count("guided"),
        curriculum=count("curriculum"), evolved=count("evolved"), unsolved_tasks=len(unsolved),
        filters=counts, rft_samples=rft_samples, replay_size=len(st.replay), curriculum_depth=st.depth,
        curriculum_success=depth_success, evolved_live=len(st.evolved), evolved_retired=st.retired,
        expert_queries=st.expert_queries, entropy=entropy, eval=result, seconds=round(time.time() - t0, 2),
        boundary=boundary, awr=awr_stats, anchor=count("anchor"), anchor_live=len(st.anchors.anchors),
        anchor_graduated=st.anchors.graduated, anchor_dropped=st.anchors.dropped,
        anchor_expert_share=st.anchors.expert_share(), anchor_expert_moves=st.anchors.expert_moves,
        memory_entries=len(s.memory) if s.memory is not None else 0, memory_added=remembered,
        memory_recalls=sum(1 for t, _ in played if t.memory_tokens),
    )
    s.metrics.log(record, s.state.env_steps)
    s.progress.message(
        f"flywheel round {r + 1}: {steps} env steps, plain {record.plain[1]}/{record.plain[0]}, "
        + (f"retried {record.retry[1]}/{record.retry[0]}, " if "retry" in fw.mechanisms else "")
        + f"guided "
        f"{record.guided[1]}/{record.guided[0]}, curriculum {record.curriculum[1]}/{record.curriculum[0]}, evolved "
        f"{record.evolved[1]}/{record.evolved[0]}"
        + (f", anchored {record.anchor[1]}/{record.anchor[0]} ({record.anchor_live} tasks in the pool, "
           f"{record.anchor_graduated} graduated)" if "anchor" in fw.mechanisms else "")
        + f"; kept {len(kept)} episodes, {rft_samples} samples; "
        + (f"{cfg.flywheel.weighting}: {awr_stats.states} states, {awr_stats.env_steps} restart steps, "
           f"ESS {awr_stats.ess:.2f}; " if awr_stats else "")
        + (f"memory {record.memory_entries} tasks (+{remembered}), recalled in {record.memory_recalls} episodes; "
           if s.memory is not None else "")
        + f"held-out success {result.success_rate:.3f}"
    )
    return record


def _funnel(counts: list[FilterCount]) -> str:
    """'120 episodes -> infra 120 -> success 0' for a message."""
    if not counts:
        return "no filters"
    return " -> ".join([f"{counts[0].episodes_in} episodes"] + [f"{c.name} {c.episodes_out}" for c in counts])


def _successes(trajs: list[Trajectory]) -> int:
    return sum(t.success for t in trajs if t.infra_failure is None)


def _curriculum_starts(st: FlywheelState, n: int, gen: np.random.Generator) -> list[_Start]:
    """Up to ``n`` starts, ``st.depth`` kept turns before the end of a stored success (its
    first state when it is shorter): the real start is reached as the depth grows."""
    picks = gen.permutation(len(st.starts))[:n]
    out = []
    for i in picks:
        task, snaps = st.starts[int(i)]
        k = max(len(snaps) - st.depth, 0)
        if k > 0:  # k == 0 is the task's own start, which plain collection already plays
            out.append(_Start(task, snaps[k]))
    return out


def _evolve(s: Session, st: FlywheelState, plain: dict[str, list[Trajectory]], unsolved: list[Task], r: int) -> None:
    """Retire derived tasks that were solved every time (or stayed unsolved three rounds);
    derive new ones from this round's unsolved tasks."""
    fw = s.cfg.flywheel
    for key, (task, age) in list(st.evolved.items()):
        got = [t for t in plain.get(key, []) if t.infra_failure is None]
        if got and _successes(got) == len(got):
            del st.evolved[key]
            st.retired += 1
        elif got and _successes(got) == 0:
            if age + 1 >= 3:
                del st.evolved[key]
                st.retired += 1
            else:
                st.evolved[key] = (task, age + 1)
    for task in unsolved:
        if len(st.evolved) >= fw.evolve_pool or task.task_id in st.evolved:
            continue
        for new in s.rollout_engine.env.derive_tasks(task, fw.evolve_per_task, stable_hash(s.cfg.seed, "evolve", r, task.task_id)):
            if len(st.evolved) < fw.evolve_pool:
                st.evolved.setdefault(new.task_id, (new, 0))


def _unguided(s: Session, traj: Trajectory) -> Candidate | None:
    """A guided episode as training data: its samples re-written with the hints stripped
    from every observation (same action tokens and sampling logprobs)."""
    if traj.infra_failure is not None or not traj.samples:
        return None
    engine = s.rollout_engine
    samples = rerender(traj, [strip_guidance(t.observation) for t in traj.turns], s.policy.chat, s.cfg.rollout,
                       engine.prompt, engine.marker)
    if samples is None:
        return None
    turns = tuple(replace(t, observation=strip_guidance(t.observation)) for t in traj.turns)
    return Candidate.of(replace(traj, samples=tuple(samples), turns=turns), "guided")


def _rft_data(s: Session, data: list[Candidate]) -> tuple[list[Sample], list[float]]:
    """The samples of the kept turns and their weights: 1, or for guided samples with
    ``guided_training=is`` the truncated ratio pi(a | unguided) / mu(a | guided)."""
    samples, weights = [], []
    for c in data:
        xs = kept_samples([c])
        samples.extend(xs)
        if c.source == "guided" and s.cfg.flywheel.guided_training == "is":
            weights.extend(_is_weights(s, xs))
        else:
            weights.extend([1.0] * len(xs))
    return samples, weights


@torch.no_grad()
def _is_weights(s: Session, samples: list[Sample]) -> list[float]:
    if not samples:
        return []
    batch = collate(samples, s.policy.pad_id, vision=s.policy.vision)
    lp, _ = token_logprobs(s.policy.model, batch.ids, batch.attention, s.cfg.flywheel.temperature, positions=batch.mask,
                           vision=batch.vision)
    log_ratio = ((lp - batch.old_logprobs) * batch.mask).sum(dim=1)
    return torch.exp(log_ratio).clamp(max=1.0).tolist()


def _rft(s: Session, step: GuardedStep, samples: list[Sample], weights: list[float], r: int, floor: float = 0.0) -> None:
    """Supervised epochs on the kept samples' action tokens (weighted per sample). With an
    entropy ``floor`` > 0 (the guard), a batch whose mean action entropy is below it adds
    ``entropy_guard_coef x (floor - entropy)`` to the loss: fine-tuning on the policy's own
    successes then sharpens it only down to the floor (an entropy-targeting hinge, in the spirit
    of clip-higher and Clip-Cov, which act on the PPO ratio instead)."""
    fw, policy = s.cfg.flywheel, s.policy
    for group in step.optimizer.param_groups:
        group["lr"] = fw.rft_lr
    w_all = torch.tensor(weights, dtype=torch.float32)
    policy.model.train()
    per_epoch = -(-len(samples) // fw.rft_batch_size)
    with s.progress.activity(f"flywheel round {r + 1}: fine-tune", fw.rft_epochs * per_epoch, "steps") as report:
        for epoch in range(fw.rft_epochs):
            order = rng(s.cfg.seed, "flywheel-rft", r, epoch).permutation(len(samples))
            for k, b in enumerate(range(0, len(samples), fw.rft_batch_size)):
                idx = order[b:b + fw.rft_batch_size]
                batch = collate([samples[i] for i in idx], policy.pad_id, vision=policy.vision)
                lp, ent = token_logprobs(policy.model, batch.ids, batch.attention, with_entropy=floor > 0,
                                         positions=batch.mask, vision=batch.vision)
                mask = batch.mask * w_all[idx][:, None]
                loss = -(lp * mask).sum() / batch.mask.sum().clamp(min=1)
                if floor > 0:
                    loss = loss + entropy_floor_penalty(ent, batch.mask, floor, fw.entropy_guard_coef)
                step(loss)
                s.state.train_tokens += batch.num_tokens
                report(epoch * per_epoch + k + 1)
    policy.model.eval()


def _grpo(s: Session, optimizer: torch.optim.Optimizer, step: GuardedStep, trajs: list[Trajectory],
          replayed: list[Candidate], r: int) -> None:
    """One GRPO update on the round's plain groups (rl section's advantage settings, rl.malformed); the
    replayed successes join with advantage 1 and the decoupled objective's truncated
    importance weights (they were sampled by older policies)."""
    ok, _ = drop_void([t for t in trajs if t.infra_failure is None], s.cfg.rl)
    per_turn = turn_advantages(ok, s.cfg.rl)
    pairs = [(x, sample_advantage(x, per_turn[t.trajectory_id])) for t in ok for x in t.samples]
    pairs += [(x, 1.0) for c in replayed for x in kept_samples([c])]
    if pairs:
        for group in optimizer.param_groups:
            group["lr"] = s.cfg.rl.lr
        ppo_update(s.policy, pairs, step, s.cfg.rl, temperature=s.cfg.rollout.temperature,
                   shuffle=rng(s.cfg.seed, "rl-shuffle", stable_hash("flywheel", r)), decoupled=bool(replayed),
                   is_cap=s.cfg.engine.is_cap)


__all__ = ["FlywheelState", "guided_config", "run_flywheel"]


def write_flywheel_report(run_dir, summary) -> None:
    """``RUN/flywheel_report.md`` and ``RUN/flywheel.png``: held-out success per round, where
    the successes came from (plain, guided, curriculum, evolved), what each filter kept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from turnforge.paths import write_atomic
    from turnforge.train.metrics import read_metrics

    rounds = read_metrics(run_dir).flywheel
    if not rounds:
        return
    per_round = any(x.boundary is not None for x in rounds)
    xs = [0] + [x.round for x in rounds]
    before = summary.eval_before_rl.success_rate
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ax1.plot(xs, [before] + [x.eval.success_rate for x in rounds], marker="o", label=f"held-out (T={summary_temperature(run_dir)})")
    best = summary.eval_bc_best_temperature
    if best is not None:
        ax1.axhline(best.eval.success_rate, color="tab:red", linestyle="--", label=f"BC at its best T={best.temperature}")
    ax1.axhline(summary.eval_after_rl.success_rate, color="tab:green", linestyle=":", label="final (after RL)")
    ax1.set(xlabel="round (0 = after BC)", ylabel="held-out success", ylim=(-0.02, 1.02), title="held-out success per round")
    ax1.legend(loc="lower right")
    bottom = np.zeros(len(rounds))
    for src in ("plain", "retry", "guided", "curriculum", "anchor", "evolved"):
        ys = np.array([getattr(x, src)[1] for x in rounds], dtype=float)
        ax2.bar(xs[1:], ys, bottom=bottom, label=src)
        bottom += ys
    ax2.set(xlabel="round", ylabel="successful episodes", title="where successes came from")
    ax2.legend()
    names = [f.name for f in rounds[0].filters]
    kept = [sum(x.filters[i].episodes_out for x in rounds) for i in range(len(names))]
    offered = sum(x.filters[0].episodes_in for x in rounds) if names else 0
    ax3.bar(["offered"] + names, [offered] + kept, color="tab:gray")
    ax3.set(ylabel="episodes (all rounds)", title="what each filter kept")
    ax3.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(run_dir / "flywheel.png", dpi=100)
    plt.close(fig)

    lines = [f"# Flywheel report: {summary.recipe} (seed {summary.seed})", "",
             f"Held-out success ({summary.eval_after_rl.episodes} episodes): after BC {before:.3f}"
             + (f", BC at its best temperature (T={best.temperature}) {best.eval.success_rate:.3f}" if best else "")
             + f", final {summary.eval_after_rl.success_rate:.3f}"
             + (f" ({summary.gain_over_bc_best_points:+.1f} points over BC at its best temperature)" if best else "") + ".",
             f"Expert queries: {summary.expert_queries.total} ({summary.expert_queries.demonstration_actions} demonstration "
             f"moves, {summary.expert_queries.hints} hints, {summary.expert_queries.anchor_moves} moves along anchored tasks).", "",
             "![flywheel](flywheel.png)", "",
             "| round | env steps | plain | retried | guided | curriculum | evolved | unsolved tasks | RFT samples | replay | "
             "depth | entropy | held-out |" + (" pass@1 | pass@N | never solved@8 |" if per_round else ""),
             "|" + "---|" * (16 if per_round else 13)]
    for x in rounds:
        def pair(p: tuple[int, int]) -> str:
            return f"{p[1]}/{p[0]}"
        ent = "" if x.entropy is None else f"{x.entropy:.3f}"
        lines.append(f"| {x.round} | {x.round_env_steps} | {pair(x.plain)} | {pair(x.retry)} | {pair(x.guided)} | {pair(x.curriculum)} | "
                     f"{pair(x.evolved)} | {x.unsolved_tasks} | {x.rft_samples} | {x.replay_size} | {x.curriculum_depth} | "
                     f"{ent} | {x.eval.success_rate:.3f} ({x.eval.episodes}) |" + (_round_boundary(x.boundary) if per_round else ""))
    last = rounds[-1]
    if any(x.anchor[0] for x in rounds):
        share = "" if last.anchor_expert_share is None else f", the expert's share of their solutions {last.anchor_expert_share:.2f}"
        lines += ["", f"Anchored tasks (never solved by plain rollouts; the policy plays on from a state along the expert's "
                  f"solution): {sum(x.anchor[1] for x in rounds)}/{sum(x.anchor[0] for x in rounds)} anchored episodes "
                  f"succeeded; {last.anchor_graduated} tasks graduated (solved from their real start), {last.anchor_live} "
                  f"left in the pool{share}, {last.anchor_dropped} dropped; {last.anchor_expert_moves} expert moves."]
    lines += ["", "Filters (episodes in -> out, kept turns in -> out, all rounds):", ""]
    for i, name in enumerate(names):
        f = [x.filters[i] for x in rounds]
        lines.append(f"- `{name}`: {sum(c.episodes_in for c in f)} -> {sum(c.episodes_out for c in f)} episodes, "
                     f"{sum(c.turns_in for c in f)} -> {sum(c.turns_out for c in f)} turns")
    lines += boundary_lines(summary)
    if any(x.awr is not None for x in rounds):  # flywheel.weighting=mc_awr or group_awr
        lines += ["", "## Advantage-weighted regression (turnforge.train.awr)", "",
                  "| round | states | (s, a) pairs | restart steps | samples | mean abs A | A > 0 | mean weight | clipped | ESS |",
                  "|" + "---|" * 10]
        lines += [f"| {x.round} | {a.states} | {a.actions} | {a.env_steps} | {a.samples} | {a.mean_abs_advantage:.3f} | "
                  f"{a.positive_share:.2f} | {a.mean_weight:.2f} | {a.clipped_share:.2f} | {a.ess:.2f} |"
                  for x in rounds if (a := x.awr) is not None]
    lines += ["", "Query the episodes: `turnforge data RUN \"SELECT * FROM success_by_source\"`.", ""]
    write_atomic(run_dir / "flywheel_report.md", "\n".join(lines))


def _round_boundary(b) -> str:
    """A round's pass@1, pass@N and never-solved share as table cells (empty without a measurement)."""
    if b is None or not b.pass_at_k:
        return " | | |"
    cells = [b.pass_at_k[0].value, b.pass_at_k[-1].value, b.never_solved_at_8]
    return "".join(f" {'' if v is None else f'{v:.3f}'} |" for v in cells)


def boundary_lines(summary) -> list[str]:
    """The report's section on what the policy solves: pass@k of the start and after training
    (``summary.json``'s ``boundary_start``, ``boundary_after``) and ``pass_at_k.png``."""
    reports = [(name, r) for name, r in (("after BC", summary.boundary_start), ("final", summary.boundary_after)) if r is not None]
    if not reports:
        return []
    ks = sorted({p.k for _, r in reports for p in r.pass_at_k})
    first = reports[0][1]
    lines = ["", f"## The boundary: pass@k on {first.tasks} {first.split} tasks x {first.samples_per_task} samples "
             f"(T={first.temperature:g})", "",
             "Sharpening (the policy concentrates on tasks it already solves) raises pass@1 only; expansion (it solves "
             "tasks it never solved) raises pass@k at large k too and lowers the never-solved share.", "",
             "![pass@k](pass_at_k.png)", "",
             "| policy | " + " | ".join(f"pass@{k}" for k in ks) + " | never solved@8 | distinct successes | entropy | "
             "I(A;O) | malformed (T={:g}) | malformed (eval) |".format(first.temperature),
             "|" + "---|" * (len(ks) + 7)]

    def fmt(x: float | None, digits: int = 3) -> str:
        return "" if x is None else f"{x:.{digits}f}"

    for name, r in reports:
        lines.append(f"| {name} | " + " | ".join(fmt(r.at(k)) for k in ks) + f" | {fmt(r.never_solved_at_8)} | "
                     f"{fmt(r.distinct_successes, 2)} | {fmt(r.entropy)} | {fmt(r.action_mi)} | {r.malformed_rate:.3f} | "
                     f"{r.eval_malformed_rate:.3f} |")
    return lines


def summary_temperature(run_dir) -> float:
    import yaml

    return float(yaml.safe_load((run_dir / "config.yaml").read_text())["eval"]["temperature"])
