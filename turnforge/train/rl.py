"""Stage 2, RL for multi-turn episodes: GRPO family, PPO with a critic, MC-GRPO.

Each iteration, top to bottom:

1. rollout: G episodes of each of ``tasks_per_iteration`` fresh train tasks, from the
   rollout engine's group stream (lock-step, or a rollout thread with bounded staleness);
2. credit (``rl.advantage``; ``turnforge.train.credit.assign_credit``), infrastructure
   failures excluded: critic-free group baselines (grpo, rloo, reinforce_pp, gigpo), GAE on
   learned and/or Monte-Carlo state values, or MC-GRPO's state groups; with
   ``rl.kl_mode=reward`` the KL to the reference (the BC policy) is a per-turn reward penalty;
3. policy update (``turnforge.train.update.ppo_update``): PPO-clip with the chosen loss
   aggregation, optional KL to the reference as a loss term (``rl.kl_mode=loss``), entropy
   bonus, dual clip; asynchronous or vLLM rollouts use the decoupled objective;
4. critic update (``gae`` with a learned critic): clipped value loss on the targets; every
   ``rl.reference_reset_every`` iterations (ProRL's hard reset) the KL reference becomes a
   frozen copy of the current policy and the optimizer's state is cleared;
5. log, evaluate, checkpoint.

Departures from the GRPO paper: the reward is the return of a multi-turn episode, not a
single response's score; the "old" logprobs of the ratio are the sampling logprobs
recorded at rollout time (on CPU in float32 they equal the trainer's to ~1e-6, a test
checks this). Groups whose advantages are all zero carry no signal; with
``skip_zero_variance_groups`` they are left out of the update (they would only dilute
the token mean), never replaced by duplicated samples.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from turnforge.algos import explained_variance
from turnforge.algos.estimators import ESTIMATORS
from turnforge.config import TrainConfig
from turnforge.critic.value import ValueModel, pretrain_critic, sample_targets, update_critic
from turnforge.data.store import write_trajectories
from turnforge.dist import optimizer_state, sync_sampler, sync_weights
from turnforge.errors import RunStopped
from turnforge.inference.client import ServerSampler, ServerStats
from turnforge.optim import GuardedStep, lr_factor, set_lr
from turnforge.policy.model import Policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.context import CONTEXTS
from turnforge.rollout.engine import EpisodeRequest, RolloutStats
from turnforge.rollout.episodic import EpisodicMemory
from turnforge.runs import RunDir
from turnforge.seeding import generator, rng, stable_hash
from turnforge.train.common import event_counts
from turnforge.train.credit import Credit, assign_credit, monte_carlo_returns
from turnforge.train.mc import MonteCarlo
from turnforge.train.policies import combined, policy_credit, policy_iterations, policy_updates
from turnforge.train.metrics import (
    CriticStats,
    IterationMetrics,
    RunWarning,
    UpdateStats,
    ValuePretrainStats,
    summary_stats,
    summary_text,
)
from turnforge.train.rehearsal import Rehearsal, load_or_play
from turnforge.train.rollouts import RolloutBatch, make_rollouts
from turnforge.train.run_dir.checkpoint import TrainingState, keep_weights, save_model, save_resumable
from turnforge.train.run_dir.failures import check_trajectories
from turnforge.train.session import Session
from turnforge.train.update import ppo_update
from turnforge.types import Trajectory


@dataclass
class Critic:
    """The learned value model and its optimizer (``critic.enabled``). ``model`` predicts; on
    several trainer ranks updates run through ``trainer``, a copy sharded with FSDP2 that the
    optimizer holds (``turnforge.dist.sharded_copy``), and ``sync`` copies its new weights back."""

    model: ValueModel
    optimizer: torch.optim.Optimizer
    trainer: torch.nn.Module | None = None

    @property
    def train_model(self) -> torch.nn.Module:
        return self.model if self.trainer is None else self.trainer

    def sync(self) -> None:
        sync_weights(self.trainer, self.model)


def run_rl(
    s: Session,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None,
    critic: Critic | None = None,
    bc_policy: Policy | None = None,
    stop_after: int | None = None,
) -> None:
    """RL iterations until ``rl.iterations`` (or ``stop_after`` in total, leaving a resumable
    checkpoint). ``reference``: frozen BC model for the KL term; ``bc_policy``: frozen BC
    policy for Monte-Carlo rollouts with ``critic.mc_policy=bc``."""
    cfg, rl = s.cfg, s.cfg.rl
    policy = s.policy
    step = GuardedStep(policy.train_model, optimizer, rl.max_grad_norm, rl.max_bad_steps)
    step.skipped = s.state.skipped_steps
    s.progress.stage("rl", rl.iterations)
    s.rl_started = time.time()
    uses_mc = ESTIMATORS[rl.advantage].monte_carlo(cfg)
    mc = MonteCarlo(s.rollout_engine, cfg, policy, bc_policy) if uses_mc else None

    # rehearsal toward the starting policy: its well-formed episodes, played once before the first update
    rehearsal = load_or_play(s) if rl.rehearsal_coef > 0 else None
    if rehearsal is not None and s.state.iteration == 0:
        s.state.env_steps += rehearsal.env_steps

    end = rl.iterations if stop_after is None else min(rl.iterations, stop_after)
    warned = False  # the generation-truncation warning is printed once
    with make_rollouts(s, keep_snapshots=uses_mc) as rollouts:
        while s.state.iteration < end and not budget_spent(s) and not s.stop_requested:
            it = s.state.iteration
            t0 = time.time()
            set_lr(optimizer, rl.lr * lr_factor(rl.lr_schedule, it, rl.iterations))  # from the iteration alone: a resumed run matches

            # 1. rollout: G episodes of each of tasks_per_iteration tasks (lock-step, or the
            #    oldest groups the asynchronous engine finished, each at most engine.eta versions old)
            #    (more than max_failure_share infrastructure failures stop the run, the batch written first)
            got = rollouts.next(it)
            ok = scored_rollouts(s, it, got.trajectories)
            t_rollout = time.time() - t0

            # 2. credit: per-turn advantages (plus critic targets for gae), or MC-GRPO's state groups
            t1 = time.time()
            if cfg.agent.policies:  # several policies: each one's advantages over its own view of the batch
                credit = policy_credit(ok, cfg, it, pad_id=policy.pad_id, reference=reference)
            else:
                credit = assign_credit(ok, cfg, it, pad_id=policy.pad_id, critic=critic.model if critic else None,
                                       reference=reference, mc=mc)
            write_rollouts(s.run, it, got.trajectories, credit.per_turn or None)  # (every rank holds them; rank 0 writes)
            s.remember(((t, "plain") for t in ok), "rl", it)  # episodic memory: the next iteration's episodes recall them
            t_credit = time.time() - t1

            # 3-4. policy update (each policy's through its adapter), then the critic's (``learn``)
            learned = learn(ok, credit, cfg, it, policy, step, reference=reference, critic=critic, rehearsal=rehearsal)
            policy.version += 1
            sync_sampler(policy)  # on several ranks: the sharded trainer's new weights into the sampling model
            rollouts.after_update()  # weight sync to the rollout worker (nothing to do when it shares the model)
            if reference is not None and reference_reset_due(it, rl.reference_reset_every):
                reference = reset_reference(policy.model, optimizer)
                save_model(s.run, policy, s.run.checkpoint("reference"))  # a resume's reference
                s.progress.message(f"rl iteration {it + 1}: the KL reference reset to the current policy, "
                                   "the optimizer's state cleared")

            # 5. log, evaluate, checkpoint
            s.state.iteration = it + 1
            s.state.env_steps += got.env_steps
            s.state.mc_env_steps += credit.mc.env_steps if credit.mc is not None else 0
            s.state.train_tokens += learned.update.tokens
            s.state.skipped_steps = step.skipped
            record = iteration_record(it, ok, got, credit, learned, rollout_seconds=t_rollout, credit_seconds=t_credit,
                                      lr=optimizer.param_groups[0]["lr"], skipped_steps=step.skipped,
                                      policy_version=policy.version, summarize=CONTEXTS[cfg.rollout.context].writes_summaries,
                                      inference=copy.deepcopy(policy.sampler.stats) if isinstance(policy.sampler, ServerSampler) else None,
                                      policies=cfg.agent.policies)
            warned = log_iteration(s, record, got.stats, started=t0, warned=warned)
            last = it + 1 == end or budget_spent(s) or s.stop_requested
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and not last and it + 1 < rl.iterations:
                s.evaluate(f"rl-{it + 1}")
            if (it + 1) % cfg.checkpoint_every == 0 or last:
                save_checkpoint(s, optimizer, critic)


def scored_rollouts(s: Session, it: int, trajectories: list[Trajectory]) -> list[Trajectory]:
    """Step 1's check of RL iteration ``it``'s episodes: those scored (infrastructure failures
    left out); more than ``max_failure_share`` failures stop the run (``RunStopped``), the batch
    written first."""
    try:
        check_trajectories(f"rl iteration {it + 1}", s.env.env_id, trajectories, s.cfg.max_failure_share,
                           kind="rollout episodes")
    except RunStopped:
        write_rollouts(s.run, it, trajectories)
        raise
    return [t for t in trajectories if t.infra_failure is None]


def write_rollouts(run: RunDir, it: int, trajectories: list[Trajectory],
                   advantages: dict[str, list[float]] | None = None) -> None:
    """RL iteration ``it``'s episodes (with their per-turn ``advantages``, once assigned) as
    ``trajectories/rl_<it>.parquet``; on several ranks every rank holds them all and rank 0 writes."""
    run.write(run.trajectory_file(f"rl_{it:05d}"), partial(write_trajectories, trajectories=trajectories, stage="rl",
                                                           iteration=it, advantages=advantages))


def log_iteration(s: Session, record: IterationMetrics, rstats: RolloutStats, *, started: float, warned: bool) -> bool:
    """Step 5's log of an iteration: its ``record`` into the metrics, a warning (once: ``warned``
    says whether it was given; returned updated) when more than half the actions were cut at
    ``rollout.max_new_tokens``, and the progress line (tokens/s since ``started``)."""
    s.metrics.log(record, s.state.env_steps)
    if rstats.turns and rstats.generation_truncations > rstats.turns / 2 and not warned:
        warned = True
        warning = RunWarning(
            f"iteration {record.iteration}: {rstats.generation_truncations} of {rstats.turns} actions hit "
            f"rollout.max_new_tokens={s.cfg.rollout.max_new_tokens} before a stop token; raise it if actions are longer"
        )
        s.progress.message(f"warning: {warning.message}")
        s.metrics.log(warning, s.state.env_steps)
    s.progress.update(
        record.iteration, reward=record.reward, success=record.success, loss=record.update.loss,
        tokens_per_s=(record.update.tokens + rstats.generated_tokens) / max(time.time() - started, 1e-9),
        **({"summaries": summary_text(record.summaries)} if record.summaries is not None else {}),
    )
    return warned


def save_checkpoint(s: Session, optimizer: torch.optim.Optimizer, critic: Critic | None) -> None:
    """Step 5's resumable checkpoint after the RL iterations done (``s.state.iteration``), and the
    weights ``keep_checkpoints`` keeps."""
    s.state.stage = "rl"
    s.state.wall_seconds = s.wall_seconds()
    save_resumable(s.run, s.policy, s.state, training_state(s.policy, optimizer, critic, s.memory))
    keep_weights(s.run, s.policy, f"rl-{s.state.iteration}", s.cfg.keep_checkpoints)


@dataclass(frozen=True)
class Learned:
    """Steps 3-4 of one RL iteration (``learn``)."""

    update: UpdateStats
    critic: CriticStats | None  # rl.advantage=gae: the critic update and the explained variance of the values used
    update_seconds: float
    by_policy: dict[str, UpdateStats] | None = None  # agent.policies: each policy's update (``update`` combines them)


def learn(ok: list[Trajectory], credit: Credit, cfg: TrainConfig, it: int, policy: Policy, step: GuardedStep, *,
          reference: torch.nn.Module | None = None, critic: Critic | None = None,
          rehearsal: Rehearsal | None = None) -> Learned:
    """The policy update and the critic update of iteration ``it`` from its trajectories
    (infrastructure failures left out) and their ``credit``: PPO-clip with ``rl.loss_agg``
    aggregation, minibatches in a seeded order (asynchronous rollouts and vLLM's, with other
    numerics, use the decoupled objective with the weights of engine.correction); then the critic
    (``gae``) on the GAE targets. Several policies: each one's update through its adapter
    (``turnforge.train.policies``)."""
    rl = cfg.rl
    t0 = time.time()
    if credit.by_policy is not None:
        by_policy = policy_updates(policy, credit, step, cfg, it, reference=reference if rl.kl_mode == "loss" else None)
        return Learned(combined(list(by_policy.values())), None, time.time() - t0, by_policy)
    update = ppo_update(policy, credit.samples, step, rl, temperature=cfg.rollout.temperature,
                        shuffle=rng(cfg.seed, "rl-shuffle", it), reference=reference if rl.kl_mode == "loss" else None,
                        decoupled=cfg.engine.mode == "async" or cfg.rollout.backend in ("vllm", "server"), engine=cfg.engine,
                        rehearsal=rehearsal, micro_batch_tokens=cfg.model.micro_batch_tokens)
    critic_stats = critic_update(ok, credit, cfg, it, critic, policy.pad_id) if ESTIMATORS[rl.advantage].reads_values else None
    return Learned(update, critic_stats, time.time() - t0)


def critic_update(ok: list[Trajectory], credit: Credit, cfg: TrainConfig, it: int, critic: Critic | None,
                  pad_id: int) -> CriticStats:
    """The learned critic (if any) regressed on the GAE targets (clipped value loss around its
    own rollout-time values), and the explained variance of the values GAE used (learned,
    Monte-Carlo or blended) on those targets."""
    upd = None
    if critic is not None and credit.critic_values is not None and credit.targets is not None:
        data = [(x, tgt, old) for (x, tgt), (_, old) in
                zip(sample_targets(ok, credit.targets), sample_targets(ok, credit.critic_values))]
        upd = update_critic(
            critic.train_model, critic.optimizer, data, pad_id, epochs=cfg.critic.epochs,
            minibatch_size=cfg.critic.minibatch_size, clip=cfg.critic.value_clip, max_grad_norm=cfg.rl.max_grad_norm,
            order_rng=rng(cfg.seed, "critic-shuffle", it), micro_batch_tokens=cfg.model.micro_batch_tokens,
        )
        critic.sync()
    used = None
    if credit.values is not None and credit.targets is not None and ok:
        v = np.concatenate([credit.values[t.trajectory_id] for t in ok])
        g = np.concatenate([credit.targets[t.trajectory_id] for t in ok])
        used = explained_variance(torch.as_tensor(v), torch.as_tensor(g))
    return CriticStats(upd.loss if upd else None, upd.explained_variance if upd else None, used)


def iteration_record(it: int, ok: list[Trajectory], got: RolloutBatch, credit: Credit, learned: Learned, *,
                     rollout_seconds: float, credit_seconds: float, lr: float, skipped_steps: int,
                     policy_version: int, summarize: bool = False, inference: ServerStats | None = None,
                     policies: list[str] | None = None) -> IterationMetrics:
    """The metrics record of iteration ``it`` (``rl_iter``): its episodes' figures (scored
    ones only), the update's, the timings; ``summarize``: the summaries' count and lengths too;
    ``policies``: each one's figures (``agent.policies``)."""
    update, rstats = learned.update, got.stats
    n_ok, n_turns = max(len(ok), 1), max(sum(t.num_turns for t in ok), 1)
    returns_by_group = {g: [t.episode_return for t in ok if t.group_id == g] for g in sorted({t.group_id for t in ok})}
    return IterationMetrics(
        iteration=it + 1,
        reward=sum(t.episode_return for t in ok) / n_ok,
        success=sum(t.success for t in ok) / n_ok,
        invalid_action_rate=sum(t.num_invalid for t in ok) / n_turns,
        mean_turns=sum(t.num_turns for t in ok) / n_ok,
        samples=len(credit.samples),
        lr=lr,
        zero_variance_groups=credit.flat_groups / max(credit.groups, 1),
        group_return_std=float(np.mean([np.std(r, ddof=1) for r in returns_by_group.values() if len(r) > 1] or [0.0])),
        action_tokens_per_turn=sum(x.num_action_tokens for t in ok for x in t.samples) / n_turns,
        update=update,
        rollout=rstats,
        stream=got.stream,
        rollout_seconds=round(rollout_seconds, 3),
        credit_seconds=round(credit_seconds, 3),
        update_seconds=round(learned.update_seconds, 3),
        gen_tokens_per_s=rstats.generated_tokens / max(rollout_seconds, 1e-9),
        train_tokens_per_s=update.tokens / max(learned.update_seconds, 1e-9),
        skipped_steps=skipped_steps,
        policy_version=policy_version,
        env_events=event_counts(ok),
        critic=learned.critic,
        mc=credit.mc,
        kl_penalty_per_turn=credit.kl_penalty,
        void_episodes=credit.void_episodes,
        overlong_episodes=credit.overlong_episodes,
        summaries=summary_stats(ok) if summarize else None,
        inference=inference,
        policies=policy_iterations(ok, credit, learned.by_policy, policies) if learned.by_policy and policies else None,
    )


def budget_spent(s: Session) -> bool:
    """``rl.max_env_steps`` or ``rl.max_seconds`` (RL-stage wall clock of this process) reached."""
    rl = s.cfg.rl
    if rl.max_seconds is not None and s.rl_started is not None and time.time() - s.rl_started >= rl.max_seconds:
        return True
    return rl.max_env_steps is not None and s.state.env_steps >= rl.max_env_steps


def pretrain_values(s: Session, critic: Critic) -> ValuePretrainStats:
    """Value pretraining: the BC policy plays ``critic.pretrain_episodes`` train episodes
    (sampled at the rollout temperature); the critic regresses their discounted returns
    until the held-back explained variance reaches ``critic.pretrain_target_ev`` or the
    step budget runs out. The episodes count as env steps."""
    cfg, c, policy = s.cfg, s.cfg.critic, s.policy
    engine = s.rollout_engine
    chunk = engine.num_envs  # tasks are drawn per wave of the engine, so they do not depend on the episode count
    requests = []
    for start in range(0, c.pretrain_episodes, chunk):
        idx = range(start, min(c.pretrain_episodes, start + chunk))
        task_ids = rng(cfg.seed, "value-pretrain-tasks", start).integers(0, 2**31 - 1, len(idx))
        requests += [
            EpisodeRequest(s.env.task("train", int(t)), stable_hash(cfg.seed, "value-pretrain", i), f"vp-{i}", f"vp-{i}")
            for i, t in zip(idx, task_ids)
        ]
    actor = PolicyActor(policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature, generator(cfg.seed, "value-pretrain", 0),
                        episode_seed=cfg.episode_seed("value-pretrain"))

    def reseed(wave: int) -> None:
        actor.generator = generator(cfg.seed, "value-pretrain", wave * chunk)

    out, rstats = engine.play(requests, actor, on_wave=reseed)
    failed = check_trajectories("value pretraining", s.env.env_id, out, cfg.max_failure_share, kind="BC-policy episodes")
    trajs = [t for t in out if t.infra_failure is None]
    s.state.env_steps += rstats.turns
    s.progress.message(f"value pretraining on {len(trajs)} BC episodes ({sum(t.num_turns for t in trajs)} states)"
                       + (f", {failed} infrastructure failures left out" if failed else ""))
    stats = pretrain_critic(
        critic.train_model, critic.optimizer, sample_targets(trajs, monte_carlo_returns(trajs, cfg.rl)), policy.pad_id,
        max_steps=c.pretrain_max_steps, target_ev=c.pretrain_target_ev, minibatch_size=c.minibatch_size,
        max_grad_norm=cfg.rl.max_grad_norm, seed=cfg.seed, micro_batch_tokens=cfg.model.micro_batch_tokens,
    )
    critic.sync()
    result = s.metrics.log(ValuePretrainStats(**stats, episodes=len(trajs), infra_failures=failed), s.state.env_steps)
    s.progress.message(f"value pretraining: explained variance {result.explained_variance:.3f} after {result.steps} steps")
    return result


def training_state(policy: Policy, optimizer: torch.optim.Optimizer | None, critic: Critic | None = None,
                   memory: EpisodicMemory | None = None, flywheel=None) -> TrainingState:
    """What a resumable checkpoint keeps besides the weights (``flywheel``: the flywheel's
    ``FlywheelState`` after a round)."""
    return TrainingState(
        version=policy.version, optimizer=optimizer_state(policy.train_model, optimizer) if optimizer is not None else None,
        critic=critic.model.state_dict() if critic is not None else None,
        critic_optimizer=optimizer_state(critic.train_model, critic.optimizer) if critic is not None else None,
        memory=memory.state() if memory is not None else None, flywheel=flywheel,
    )


def reference_reset_due(iteration: int, every: int) -> bool:
    """Whether the reference resets after (0-based) ``iteration``: after every ``every``-th one
    (iterations ``every - 1``, ``2 every - 1``, ...); never with ``every`` 0."""
    return every > 0 and (iteration + 1) % every == 0


def reset_reference(policy_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    """ProRL's hard reset: a frozen copy of the current policy as the new KL reference, and the
    optimizer's moments and step counts cleared (the learning rate stays the schedule's)."""
    optimizer.state.clear()
    return make_reference(policy_model)


def make_reference(policy_model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the current policy (the BC policy) for the KL term."""
    ref = copy.deepcopy(policy_model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
