"""Stage 2, GRPO-family RL for multi-turn episodes.

Each iteration: G rollouts of each of ``tasks_per_iteration`` fresh train tasks; a
critic-free estimator (``rl.advantage``) scores each turn against the group: ``grpo``
normalises the episode return within its group (``turnforge.algos.grpo``) and puts that
advantage on every action token of the episode (all turns); ``gigpo`` adds a step-level
term from the turns of the group that acted in the same env state; ``rloo`` and
``reinforce_pp`` change the baseline and scale. Then PPO-clip updates with the chosen
loss aggregation, optionally with a k3 KL term to the reference (the BC policy).

Departures from the GRPO paper: the reward is the episode return of a multi-turn
episode, not a single response's score; the "old" logprobs of the ratio are the
sampling logprobs recorded at rollout time (on CPU in float32 they equal the trainer's
to ~1e-6, a test checks this); episodes that failed for infrastructure reasons are
dropped from the group before normalising. Groups whose returns are all equal have zero
advantage everywhere; with ``skip_zero_variance_groups`` they are left out of the update
(they would only dilute the token mean), never replaced by duplicated samples.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from turnforge.algos import aggregation_weights, masked_mean, ppo_clip_loss
from turnforge.data.store import write_trajectories
from turnforge.envs.base import stable_hash
from turnforge.policy.generate import token_logprobs
from turnforge.rollout.runner import EpisodeRequest, PolicyActor, rollout
from turnforge.train.checkpoint import save_resumable
from turnforge.train.common import GuardedStep, collate, generator, rng
from turnforge.train.credit import sample_advantage, turn_advantages
from turnforge.train.session import Session


def run_grpo(
    s: Session, optimizer: torch.optim.Optimizer, reference: torch.nn.Module | None, stop_after: int | None = None
) -> None:
    """GRPO iterations until ``rl.iterations`` (or ``stop_after`` in total, leaving a resumable checkpoint)."""
    cfg, rl = s.cfg, s.cfg.rl
    policy, envs = s.policy, s.envs
    step = GuardedStep(policy.model, optimizer, rl.max_grad_norm, rl.max_bad_steps)
    step.skipped = s.state.skipped_steps
    s.progress.stage("rl", rl.iterations)

    end = rl.iterations if stop_after is None else min(rl.iterations, stop_after)
    while s.state.iteration < end:
        it = s.state.iteration
        t0 = time.time()

        # 1. rollout: G episodes of each task, all with distinct env seeds
        task_ids = rng(cfg.seed, "rl-tasks", it).integers(0, 2**31 - 1, rl.tasks_per_iteration)
        requests = [
            EpisodeRequest(envs[0].task("train", int(t)), stable_hash(cfg.seed, "rl", it, k, g), f"{it}-{k}", f"rl-{it}-{k}-{g}")
            for k, t in enumerate(task_ids)
            for g in range(rl.group_size)
        ]
        actor = PolicyActor(policy, cfg.rollout.max_new_tokens, cfg.rollout.temperature, generator(cfg.seed, "rl-sample", it))
        trajs, rstats = rollout(actor, envs, requests, cfg.rollout, policy)
        t_rollout = time.time() - t0

        # 2. advantages per turn (turnforge.train.credit), infra failures excluded; groups
        #    whose advantages are all zero carry no signal and may be left out
        ok = [t for t in trajs if t.infra_failure is None]
        per_turn = turn_advantages(ok, rl)
        groups = {t.group_id for t in ok}
        flat = {g for g in groups if all(np.all(np.abs(per_turn[t.trajectory_id]) < 1e-8) for t in ok if t.group_id == g)}
        episode_tokens = {t.trajectory_id: sum(x.num_action_tokens for x in t.samples) for t in ok}
        trained = [t for t in ok if not (rl.skip_zero_variance_groups and t.group_id in flat)]
        samples = [(x, sample_advantage(x, per_turn[t.trajectory_id])) for t in trained for x in t.samples]
        write_trajectories(s.run_dir / "trajectories" / f"rl_{it:05d}.parquet", trajs, stage="rl", iteration=it, advantages=per_turn)

        # 3. update: PPO-clip with rl.loss_agg aggregation, minibatches in a seeded order
        policy.model.train()
        t1 = time.time()
        order = rng(cfg.seed, "rl-shuffle", it).permutation(len(samples)).tolist()
        losses, clip_fracs, kls, norms, entropies, ref_kls, tokens = [], [], [], [], [], [], 0
        for _ in range(rl.epochs):
            for b in range(0, len(order), rl.minibatch_size):
                chunk = [samples[i] for i in order[b:b + rl.minibatch_size]]
                batch = collate([x for x, _ in chunk], policy.pad_id, [a for _, a in chunk])
                logprobs, entropy = token_logprobs(
                    policy.model, batch.ids, batch.attention, cfg.rollout.temperature, with_entropy=True
                )
                ref = None
                if reference is not None:
                    with torch.no_grad():
                        ref, _ = token_logprobs(reference, batch.ids, batch.attention, cfg.rollout.temperature)
                weights = aggregation_weights(
                    rl.loss_agg,
                    torch.tensor([x.num_action_tokens for x, _ in chunk]),
                    torch.tensor([episode_tokens[x.trajectory_id] for x, _ in chunk]),
                )
                out = ppo_clip_loss(
                    logprobs, batch.old_logprobs, batch.advantages, batch.mask,
                    rl.clip_low, rl.clip_high, ref_logprobs=ref, kl_coef=rl.kl_coef, weights=weights,
                    dual_clip=rl.dual_clip, kl_estimator=rl.kl_estimator, entropy=entropy, entropy_coef=rl.entropy_coef,
                )
                norm = step(out.loss)
                if norm is not None:
                    norms.append(norm)
                losses.append(out.loss.item())
                clip_fracs.append(out.clip_fraction)
                kls.append(out.approx_kl)
                entropies.append(float(masked_mean(entropy.detach(), batch.mask)))
                ref_kls.append(out.kl_ref)
                tokens += batch.num_tokens
        policy.model.eval()
        policy.version += 1
        t_update = time.time() - t1

        # 4. log, evaluate, checkpoint
        s.state.iteration = it + 1
        s.state.env_steps += rstats.turns
        s.state.train_tokens += tokens
        s.state.skipped_steps = step.skipped
        n_ok = max(len(ok), 1)
        record = {
            "iteration": it + 1,
            "reward": sum(t.episode_return for t in ok) / n_ok,
            "success": sum(t.success for t in ok) / n_ok,
            "invalid_action_rate": sum(t.num_invalid for t in ok) / max(sum(t.num_turns for t in ok), 1),
            "mean_turns": sum(t.num_turns for t in ok) / n_ok,
            "loss": sum(losses) / max(len(losses), 1),
            "clip_fraction": sum(clip_fracs) / max(len(clip_fracs), 1),
            "approx_kl": sum(kls) / max(len(kls), 1),
            "kl_ref": sum(ref_kls) / max(len(ref_kls), 1),
            "entropy": sum(entropies) / max(len(entropies), 1),
            "grad_norm": sum(norms) / max(len(norms), 1),
            "samples": len(samples),
            "zero_variance_groups": len(flat) / max(len(groups), 1),
            "group_return_std": float(np.mean([np.std([t.episode_return for t in ok if t.group_id == g], ddof=1) for g in groups]))
            if groups else 0.0,
            "action_tokens_per_turn": sum(episode_tokens.values()) / max(sum(t.num_turns for t in ok), 1),
            "rollout_seconds": round(t_rollout, 3),
            "update_seconds": round(t_update, 3),
            "gen_tokens_per_s": rstats.generated_tokens / max(t_rollout, 1e-9),
            "train_tokens_per_s": tokens / max(t_update, 1e-9),
            "obs_truncations": rstats.obs_truncations,
            "context_overflows": rstats.context_overflows,
            "generation_truncations": rstats.generation_truncations,
            "infra_failures": rstats.infra_failures,
            "skipped_steps": step.skipped,
            "policy_version": policy.version,
        }
        s.metrics.log("rl_iter", s.state.env_steps, **record)
        s.progress.update(
            it + 1, reward=record["reward"], success=record["success"], loss=record["loss"],
            tokens_per_s=(tokens + rstats.generated_tokens) / max(time.time() - t0, 1e-9),
        )
        if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < rl.iterations:
            s.evaluate(f"rl-{it + 1}")
        if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == end:
            s.state.stage = "rl"
            s.state.wall_seconds = s.wall_seconds()
            save_resumable(s.run_dir, policy, optimizer, s.state)


def make_reference(policy_model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the current policy (the BC policy) for the KL term."""
    ref = copy.deepcopy(policy_model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
