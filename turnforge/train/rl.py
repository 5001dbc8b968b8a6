"""Stage 2, RL for multi-turn episodes: GRPO family, PPO with a critic, MC-GRPO.

Each iteration, top to bottom:

1. rollout: G episodes of each of ``tasks_per_iteration`` fresh train tasks, from the
   rollout engine's group stream (lock-step, or a rollout thread with bounded staleness);
2. credit (``rl.advantage``), infrastructure failures excluded:
   - critic-free (``turnforge.train.credit.turn_advantages``): ``grpo`` normalises the
     episode return within its group and puts it on every turn; ``gigpo`` adds a
     step-level term from the turns of the group that acted in the same env state;
     ``rloo`` and ``reinforce_pp`` change the baseline and scale;
   - ``gae``: state values V(s_k) per turn from the learned critic, Monte-Carlo
     rollouts from env snapshots, or their blend (``critic`` section), then GAE over
     the turns of each episode (decoupled lambdas, optionally length-adaptive);
   - ``mc_grpo``: the rollouts only supply states; at ``mc_grpo_states`` of them the
     policy samples G actions, each scored by ``Q_MC(s, a) = r + gamma V_MC(s')``
     from env snapshots, normalised within the state's group (``turnforge.train.mc``);
3. policy update: PPO-clip with the chosen loss aggregation, optional KL to the
   reference (the BC policy) as a loss term or, with ``rl.kl_mode=reward``, as a per-turn
   reward penalty applied in step 2; entropy bonus, dual clip;
4. critic update (``gae`` with a learned critic): clipped value loss on the targets;
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

import numpy as np
import torch

from turnforge.algos import (
    aggregation_weights, decoupled_ppo_loss, explained_variance, importance_weights, kl_estimate, masked_mean,
    ppo_clip_loss,
)
from turnforge.critic.value import ValueModel, pretrain_critic, sample_targets, turn_values, update_critic
from turnforge.data.store import write_trajectories
from turnforge.envs.base import stable_hash
from turnforge.errors import RunStopped
from turnforge.policy.generate import token_logprobs
from turnforge.policy.model import Policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.train.rollouts import make_rollouts
from turnforge.train.checkpoint import TrainingState, save_resumable
from turnforge.train.common import GuardedStep, collate, event_counts, generator, lr_factor, rng
from turnforge.train.failures import check_trajectories
from turnforge.train.credit import action_turns, gae_turn_advantages, monte_carlo_returns, sample_advantage, turn_advantages
from turnforge.critic.mc import blend
from turnforge.train.mc import mc_grpo_batch, mc_turn_values
from turnforge.train.merge import MergedSample, merge_samples, minibatches
from turnforge.train.metrics import (
    CriticStats, IterationMetrics, MCStats, OffPolicyStats, RunWarning, UpdateStats, ValuePretrainStats,
)
from turnforge.train.session import Session
from turnforge.types import Sample, Trajectory


@dataclass
class Critic:
    """The learned value model and its optimizer (``critic.enabled``)."""

    model: ValueModel
    optimizer: torch.optim.Optimizer


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
    step = GuardedStep(policy.model, optimizer, rl.max_grad_norm, rl.max_bad_steps)
    step.skipped = s.state.skipped_steps
    s.progress.stage("rl", rl.iterations)
    s.rl_started = time.time()
    uses_mc = rl.advantage == "mc_grpo" or (rl.advantage == "gae" and cfg.critic.mc_weight > 0)

    end = rl.iterations if stop_after is None else min(rl.iterations, stop_after)
    warned = False  # the generation-truncation warning is printed once
    with make_rollouts(s, keep_snapshots=uses_mc) as rollouts:
        while s.state.iteration < end and not budget_spent(s) and not s.stop_requested:
            it = s.state.iteration
            t0 = time.time()
            for group in optimizer.param_groups:  # from the iteration alone, so a resumed run matches
                group["lr"] = rl.lr * lr_factor(rl.lr_schedule, it, rl.iterations)

            # 1. rollout: G episodes of each of tasks_per_iteration tasks (lock-step, or the
            #    oldest groups the asynchronous engine finished, each at most engine.eta versions old)
            #    (more than max_failure_share infrastructure failures stop the run, the batch written first)
            got = rollouts.next(it)
            trajs, rstats = got.trajectories, got.stats
            try:
                check_trajectories(f"rl iteration {it + 1}", s.env.env_id, trajs, cfg.max_failure_share, kind="rollout episodes")
            except RunStopped:
                write_trajectories(s.run_dir / "trajectories" / f"rl_{it:05d}.parquet", trajs, stage="rl", iteration=it)
                raise
            ok = [t for t in trajs if t.infra_failure is None]
            t_rollout = time.time() - t0

            # 2. credit: per-turn advantages (plus critic targets for gae), or MC-GRPO's state groups
            t1 = time.time()
            mc_stats: MCStats | None = None
            v_phi = values = targets = None
            penalties = None
            if reference is not None and rl.kl_mode == "reward":
                penalties = kl_penalties(reference, ok, policy.pad_id, cfg.rollout.temperature, rl.kl_estimator, rl.kl_coef)
            if rl.advantage == "gae":
                v_phi = turn_values(critic.model, ok, policy.pad_id) if critic else None
                values, mc_stats = state_values(s, ok, it, v_phi, bc_policy)
                per_turn, targets = gae_turn_advantages(ok, values, rl, cfg.critic, penalties)
            elif rl.advantage == "mc_grpo":
                per_turn = {}
                batch_samples, group_of, mc_stats = mc_grpo_batch(s, ok, it, bc_policy)
            else:
                per_turn = turn_advantages(ok, rl, penalties)
            kl_penalty = float(np.mean(np.concatenate([penalties[t.trajectory_id] for t in ok]))) if penalties and ok else None
            if rl.advantage != "mc_grpo":
                batch_samples = [(x, sample_advantage(x, per_turn[t.trajectory_id])) for t in ok for x in t.samples]
                group_of = {x.trajectory_id: t.group_id for t in ok for x in t.samples}
            groups = set(group_of.values())
            flat = {g for g in groups if all(np.all(np.abs(a) < 1e-8) for x, a in batch_samples if group_of[x.trajectory_id] == g)}
            samples = [(x, a) for x, a in batch_samples if not (rl.skip_zero_variance_groups and group_of[x.trajectory_id] in flat)]
            write_trajectories(s.run_dir / "trajectories" / f"rl_{it:05d}.parquet", trajs, stage="rl", iteration=it, advantages=per_turn or None)
            t_credit = time.time() - t1

            # 3. policy update: PPO-clip with rl.loss_agg aggregation, minibatches in a seeded order;
            #    asynchronous rollouts and vLLM's (other numerics) use the decoupled objective with
            #    truncated importance weights
            t2 = time.time()
            update = ppo_update(s, samples, optimizer, step, reference if rl.kl_mode == "loss" else None, it,
                                decoupled=cfg.engine.mode == "async" or cfg.rollout.backend == "vllm")
            policy.version += 1
            rollouts.after_update()  # weight sync to the rollout worker (nothing to do when it shares the model)

            # 4. critic update on the GAE targets (clipped value loss around its own rollout-time values)
            critic_stats = None
            if rl.advantage == "gae":
                upd = None
                if critic is not None and v_phi is not None and targets is not None:
                    data = [(x, tgt, old) for (x, tgt), (_, old) in zip(sample_targets(ok, targets), sample_targets(ok, v_phi))]
                    upd = update_critic(
                        critic.model, critic.optimizer, data, policy.pad_id, epochs=cfg.critic.epochs,
                        minibatch_size=cfg.critic.minibatch_size, clip=cfg.critic.value_clip, max_grad_norm=rl.max_grad_norm,
                        order_rng=rng(cfg.seed, "critic-shuffle", it),
                    )
                used = None
                if values is not None and targets is not None and ok:  # of the values GAE used (blended or MC-only)
                    v = np.concatenate([values[t.trajectory_id] for t in ok])
                    g = np.concatenate([targets[t.trajectory_id] for t in ok])
                    used = explained_variance(torch.as_tensor(v), torch.as_tensor(g))
                critic_stats = CriticStats(upd.loss if upd else None, upd.explained_variance if upd else None, used)
            t_update = time.time() - t2

            # 5. log, evaluate, checkpoint
            s.state.iteration = it + 1
            s.state.env_steps += got.env_steps
            s.state.mc_env_steps += mc_stats.env_steps if mc_stats is not None else 0
            s.state.train_tokens += update.tokens
            s.state.skipped_steps = step.skipped
            n_ok, n_turns = max(len(ok), 1), max(sum(t.num_turns for t in ok), 1)
            returns_by_group = {g: [t.episode_return for t in ok if t.group_id == g] for g in sorted({t.group_id for t in ok})}
            record = IterationMetrics(
                iteration=it + 1,
                reward=sum(t.episode_return for t in ok) / n_ok,
                success=sum(t.success for t in ok) / n_ok,
                invalid_action_rate=sum(t.num_invalid for t in ok) / n_turns,
                mean_turns=sum(t.num_turns for t in ok) / n_ok,
                samples=len(samples),
                lr=optimizer.param_groups[0]["lr"],
                zero_variance_groups=len(flat) / max(len(groups), 1),
                group_return_std=float(np.mean([np.std(r, ddof=1) for r in returns_by_group.values() if len(r) > 1] or [0.0])),
                action_tokens_per_turn=sum(x.num_action_tokens for t in ok for x in t.samples) / n_turns,
                update=update,
                rollout=rstats,
                stream=got.stream,
                rollout_seconds=round(t_rollout, 3),
                credit_seconds=round(t_credit, 3),
                update_seconds=round(t_update, 3),
                gen_tokens_per_s=rstats.generated_tokens / max(t_rollout, 1e-9),
                train_tokens_per_s=update.tokens / max(t_update, 1e-9),
                skipped_steps=step.skipped,
                policy_version=policy.version,
                env_events=event_counts(ok),
                critic=critic_stats,
                mc=mc_stats,
                kl_penalty_per_turn=kl_penalty,
            )
            s.metrics.log(record, s.state.env_steps)
            if rstats.turns and rstats.generation_truncations > rstats.turns / 2 and not warned:
                warned = True
                warning = RunWarning(
                    f"iteration {it + 1}: {rstats.generation_truncations} of {rstats.turns} actions hit "
                    f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} before a stop token; raise it if actions are longer"
                )
                s.progress.message(f"warning: {warning.message}")
                s.metrics.log(warning, s.state.env_steps)
            s.progress.update(
                it + 1, reward=record.reward, success=record.success, loss=update.loss,
                tokens_per_s=(update.tokens + rstats.generated_tokens) / max(time.time() - t0, 1e-9),
            )
            last = it + 1 == end or budget_spent(s) or s.stop_requested
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and not last and it + 1 < rl.iterations:
                s.evaluate(f"rl-{it + 1}")
            if (it + 1) % cfg.checkpoint_every == 0 or last:
                s.state.stage = "rl"
                s.state.wall_seconds = s.wall_seconds()
                save_resumable(s.run_dir, policy, s.state, training_state(policy, optimizer, critic))


def state_values(
    s: Session, trajs: list[Trajectory], it: int, v_phi: dict[str, np.ndarray] | None, bc_policy: Policy | None
) -> tuple[dict[str, np.ndarray], MCStats | None]:
    """V(s_k) per turn for GAE: the learned critic's, Monte-Carlo values, or the blend
    ``(1 - w) V_phi + w V_MC`` (``critic.mc_weight``); plus the Monte-Carlo counters."""
    w = s.cfg.critic.mc_weight
    if w == 0:
        assert v_phi is not None  # the config guarantees a value source
        return v_phi, None
    v_mc, stats = mc_turn_values(s, trajs, it, bc_policy)
    if v_phi is None:
        return v_mc, stats
    return {k: np.asarray(blend(v_phi[k], v_mc[k], w), np.float32) for k in v_phi}, stats


@torch.no_grad()
def kl_penalties(
    reference: torch.nn.Module, trajs: list[Trajectory], pad_id: int, temperature: float, estimator: str, coef: float,
    batch_size: int = 128,
) -> dict[str, np.ndarray]:
    """``rl.kl_mode=reward``: per turn, ``coef`` times the KL estimate to the reference
    summed over the turn's action tokens (sampling logprobs against the reference's)."""
    out = {t.trajectory_id: np.zeros(t.num_turns) for t in trajs}
    samples = [x for t in trajs for x in t.samples]
    for b in range(0, len(samples), batch_size):
        chunk = samples[b:b + batch_size]
        batch = collate(chunk, pad_id)
        ref, _ = token_logprobs(reference, batch.ids, batch.attention, temperature, positions=batch.mask)
        kl = (kl_estimate(batch.old_logprobs, ref, estimator) * batch.mask).numpy()
        for i, x in enumerate(chunk):
            turn = action_turns(x)
            np.add.at(out[x.trajectory_id], turn[turn >= 0], coef * kl[i, : len(x)][turn >= 0])
    return out


def budget_spent(s: Session) -> bool:
    """``rl.max_env_steps`` or ``rl.max_seconds`` (RL-stage wall clock of this process) reached."""
    rl = s.cfg.rl
    if rl.max_seconds is not None and s.rl_started is not None and time.time() - s.rl_started >= rl.max_seconds:
        return True
    return rl.max_env_steps is not None and s.state.env_steps >= rl.max_env_steps


def ppo_update(
    s: Session,
    samples: list[tuple[Sample, float | np.ndarray]],
    optimizer: torch.optim.Optimizer,
    step: GuardedStep,
    reference: torch.nn.Module | None,
    it: int,
    decoupled: bool = False,
) -> UpdateStats:
    """``rl.epochs`` passes of PPO-clip minibatch steps over ``(sample, advantage)`` pairs.

    ``decoupled`` (asynchronous rollouts): the trust region is around the proximal policy,
    the weights before this update, whose logprobs are recomputed here once; the gap to
    the behaviour policy (the sampling logprobs of whatever version sampled each token) is
    a truncated importance weight, capped at ``engine.is_cap``.

    With ``rl.merge_duplicates`` repeated samples are scored once (``turnforge.train.merge``);
    minibatches still hold ``rl.minibatch_size`` sampled copies each."""
    cfg, rl, policy = s.cfg, s.cfg.rl, s.policy
    episode_tokens: dict[str, int] = {}
    for x, _ in samples:
        episode_tokens[x.trajectory_id] = episode_tokens.get(x.trajectory_id, 0) + x.num_action_tokens
    weights = aggregation_weights(
        rl.loss_agg,
        torch.tensor([x.num_action_tokens for x, _ in samples]),
        torch.tensor([episode_tokens[x.trajectory_id] for x, _ in samples]),
    ).tolist()
    if rl.merge_duplicates:  # repeated (prompt, action) samples are scored once (turnforge.train.merge)
        rows = merge_samples(samples, weights)
    else:
        rows = [MergedSample(x, a, w, 1) for (x, a), w in zip(samples, weights)]
    prox, offpolicy = (proximal_logprobs(s, [r.sample for r in rows]) if decoupled else (None, None))
    policy.model.train()
    order = rng(cfg.seed, "rl-shuffle", it).permutation(len(rows)).tolist()
    losses, clip_fracs, kls, norms, entropies, ref_kls, tokens = [], [], [], [], [], [], 0
    for _ in range(rl.epochs):
        for idx in minibatches(rows, order, rl.minibatch_size):
            chunk = [rows[i] for i in idx]
            batch = collate([r.sample for r in chunk], policy.pad_id, [r.advantage for r in chunk])
            counts = torch.tensor([r.count for r in chunk], dtype=torch.float32)
            logprobs, entropy = token_logprobs(policy.model, batch.ids, batch.attention, cfg.rollout.temperature,
                                               with_entropy=True, positions=batch.mask)
            ref = None
            if reference is not None:
                with torch.no_grad():
                    ref, _ = token_logprobs(reference, batch.ids, batch.attention, cfg.rollout.temperature, positions=batch.mask)
            ppo_kwargs = dict(
                clip_low=rl.clip_low, clip_high=rl.clip_high, ref_logprobs=ref, kl_coef=rl.kl_coef,
                weights=torch.tensor([r.weight for r in chunk], dtype=torch.float32), dual_clip=rl.dual_clip,
                kl_estimator=rl.kl_estimator, entropy=entropy, entropy_coef=rl.entropy_coef, counts=counts,
            )
            if prox is None:
                out = ppo_clip_loss(logprobs, batch.old_logprobs, batch.advantages, batch.mask, **ppo_kwargs)
            else:
                prox_b = torch.zeros_like(batch.old_logprobs)
                for r, i in enumerate(idx):
                    prox_b[r, : len(prox[i])] = prox[i]
                out, _ = decoupled_ppo_loss(logprobs, prox_b, batch.old_logprobs, batch.advantages, batch.mask,
                                            is_cap=cfg.engine.is_cap, **ppo_kwargs)
            norm = step(out.loss)
            if norm is not None:
                norms.append(norm)
            losses.append(out.loss.item())
            clip_fracs.append(out.clip_fraction)
            kls.append(out.approx_kl)
            entropies.append(float(masked_mean(entropy.detach(), batch.mask * counts[:, None])))
            ref_kls.append(out.kl_ref)
            tokens += int((batch.attention.sum(dim=1) * counts).sum())
    policy.model.eval()

    def mean(xs: list[float]) -> float:
        return sum(xs) / max(len(xs), 1)

    return UpdateStats(
        loss=mean(losses), clip_fraction=mean(clip_fracs), approx_kl=mean(kls), kl_ref=mean(ref_kls),
        entropy=mean(entropies), grad_norm=mean(norms), tokens=tokens,
        merged_row_fraction=len(rows) / max(len(samples), 1), offpolicy=offpolicy,
    )


@torch.no_grad()
def proximal_logprobs(s: Session, samples: list[Sample], batch_size: int = 128) -> tuple[list[torch.Tensor], OffPolicyStats]:
    """Logprobs of every sample under the current weights (the proximal policy of the
    decoupled loss), one ``[T]`` row per sample, plus off-policy diagnostics over all action
    tokens: the share sampled by an older version, the truncated importance weights
    ``min(pi_prox / pi_behav, engine.is_cap)`` (mean, largest raw, truncated share), and the
    rollout-vs-trainer mismatch ``|p_trainer - p_rollout|`` and ``|logp_trainer - logp_rollout|``
    on tokens the current version sampled (numerics only: the KV-cache sampler, or vLLM,
    against the trainer's forward pass)."""
    policy, temperature, cap = s.policy, s.cfg.rollout.temperature, s.cfg.engine.is_cap
    policy.model.eval()
    rows: list[torch.Tensor] = []
    stale, weights, raw_max, truncated, diffs, log_diffs = 0, [], 1.0, 0, [], []
    for b in range(0, len(samples), batch_size):
        chunk = samples[b:b + batch_size]
        batch = collate(chunk, policy.pad_id)
        lp, _ = token_logprobs(policy.model, batch.ids, batch.attention, temperature, positions=batch.mask)
        w, st = importance_weights(lp, batch.old_logprobs, batch.mask, cap)
        on = batch.mask.bool()
        weights.append(w[on])
        raw_max = max(raw_max, st.max)
        truncated += round(st.truncated_fraction * int(on.sum()))
        for i, x in enumerate(chunk):
            rows.append(lp[i, : len(x)].clone())
            acted = x.loss_mask.astype(bool)
            stale += int((x.versions[acted] < policy.version).sum())
            fresh = acted & (x.versions == policy.version)
            if fresh.any():
                trainer, rollout = lp[i, : len(x)][torch.from_numpy(fresh)], torch.from_numpy(x.logprobs[fresh])
                diffs.append((trainer.exp() - rollout.exp()).abs())
                log_diffs.append((trainer - rollout).abs())
    w = torch.cat(weights) if weights else torch.ones(1)
    d = torch.cat(diffs) if diffs else torch.zeros(1)
    ld = torch.cat(log_diffs) if log_diffs else torch.zeros(1)
    n = max(int(w.numel()), 1)
    return rows, OffPolicyStats(
        offpolicy_token_fraction=stale / n, is_weight_mean=float(w.mean()), is_weight_max=raw_max,
        is_truncated_fraction=truncated / n, logprob_mismatch_max=float(d.max()), logprob_mismatch_mean=float(d.mean()),
        log_ratio_abs_max=float(ld.max()), log_ratio_abs_mean=float(ld.mean()),
    )


def pretrain_values(s: Session, critic: Critic) -> ValuePretrainStats:
    """Value pretraining: the BC policy plays ``critic.pretrain_episodes`` train episodes
    (sampled at the rollout temperature); the critic regresses their discounted returns
    until the held-back explained variance reaches ``critic.pretrain_target_ev`` or the
    step budget runs out. The episodes count as env steps."""
    cfg, c, policy = s.cfg, s.cfg.critic, s.policy
    chunk = s.engine.num_envs  # tasks are drawn per wave of the engine, so they do not depend on the episode count
    requests = []
    for start in range(0, c.pretrain_episodes, chunk):
        idx = range(start, min(c.pretrain_episodes, start + chunk))
        task_ids = rng(cfg.seed, "value-pretrain-tasks", start).integers(0, 2**31 - 1, len(idx))
        requests += [
            EpisodeRequest(s.env.task("train", int(t)), stable_hash(cfg.seed, "value-pretrain", i), f"vp-{i}", f"vp-{i}")
            for i, t in zip(idx, task_ids)
        ]
    actor = PolicyActor(policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature, generator(cfg.seed, "value-pretrain", 0))

    def reseed(wave: int) -> None:
        actor.generator = generator(cfg.seed, "value-pretrain", wave * chunk)

    out, rstats = s.engine.play(requests, actor, on_wave=reseed)
    failed = check_trajectories("value pretraining", s.env.env_id, out, cfg.max_failure_share, kind="BC-policy episodes")
    trajs = [t for t in out if t.infra_failure is None]
    s.state.env_steps += rstats.turns
    s.progress.message(f"value pretraining on {len(trajs)} BC episodes ({sum(t.num_turns for t in trajs)} states)"
                       + (f", {failed} infrastructure failures left out" if failed else ""))
    stats = pretrain_critic(
        critic.model, critic.optimizer, sample_targets(trajs, monte_carlo_returns(trajs, cfg.rl)), policy.pad_id,
        max_steps=c.pretrain_max_steps, target_ev=c.pretrain_target_ev, minibatch_size=c.minibatch_size,
        max_grad_norm=cfg.rl.max_grad_norm, seed=cfg.seed,
    )
    result = s.metrics.log(ValuePretrainStats(**stats, episodes=len(trajs), infra_failures=failed), s.state.env_steps)
    s.progress.message(f"value pretraining: explained variance {result.explained_variance:.3f} after {result.steps} steps")
    return result


def training_state(policy: Policy, optimizer: torch.optim.Optimizer, critic: Critic | None) -> TrainingState:
    """What a resumable checkpoint keeps besides the weights."""
    return TrainingState(
        version=policy.version, optimizer=optimizer.state_dict(),
        critic=critic.model.state_dict() if critic is not None else None,
        critic_optimizer=critic.optimizer.state_dict() if critic is not None else None,
    )


def make_reference(policy_model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the current policy (the BC policy) for the KL term."""
    ref = copy.deepcopy(policy_model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
