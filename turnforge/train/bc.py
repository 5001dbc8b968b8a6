"""Stage 1, behaviour cloning: supervised fine-tuning on expert demonstrations.

The demonstrations are played by the env's expert on the rollout engine, through the same
context code as RL (``ExpertActor``), so BC trains on exactly the prompts the policy will see.
The loss covers the action tokens only (action text + stop token); prompts, observations
and template tokens are context.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial

import numpy as np
import torch

from turnforge.algos import sft_loss
from turnforge.config import TrainConfig
from turnforge.data.store import write_trajectories
from turnforge.dist import all_sum, attach_trainer, micro_batches, share_weighted, sync_weights
from turnforge.errors import RunStopped
from turnforge.optim import GuardedStep, lr_factor
from turnforge.policy.generate import token_logprobs
from turnforge.policy.lora import trainable_parameters
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.seeding import rng, stable_hash
from turnforge.train.common import collate
from turnforge.train.metrics import BCEpoch, BCStats
from turnforge.train.run_dir.failures import check_trajectories
from turnforge.train.session import Session
from turnforge.types import Trajectory

#: The budget that ends an episode with each truncation reason (``turnforge.rollout.engine``).
BUDGET_KEYS = {"max_turns": "rollout.max_turns", "context_budget": "rollout.max_context_tokens",
               "summary_limit": "rollout.max_summaries"}


def run_bc(s: Session) -> BCStats:
    cfg, bc = s.cfg, s.cfg.bc
    policy, env = s.policy, s.env

    # 1. demonstrations: the expert (with bc.expert_noise, an imperfect one) plays distinct train tasks
    expert = ExpertActor(bc.expert_noise, seed=cfg.seed, action_names=env.action_names)
    requests = [EpisodeRequest(env.task("train", i), stable_hash(cfg.seed, "demo", i), f"demo-{i}", f"demo-{i}")
                for i in range(bc.num_demos)]
    #    (all written, failures included; more than max_failure_share of them failing stops the run)
    #    (with episodic memory that remembers demonstrations, in memory.demo_waves waves: each wave's
    #    demonstrations enter the memory before the next is played, so BC learns prompts with a memory block)
    waves = cfg.memory.demo_waves if s.memory is not None and "demo" in cfg.memory.sources and not s.memory.frozen else 1
    bounds = np.linspace(0, len(requests), waves + 1).astype(int)
    trajs = []
    with s.progress.activity("bc demonstrations", len(requests)) as advance:
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            got, _ = s.engine.play(requests[lo:hi], expert, on_progress=lambda n, lo=lo: advance(int(lo) + n))
            s.remember(((t, "demo") for t in got), "bc", 0)
            trajs += got
    # (each rank played its share of the demonstrations and holds them all; rank 0 writes them)
    s.run.write(s.run.trajectory_file("bc_demos"), partial(write_trajectories, trajectories=trajs, stage="bc", iteration=0))
    failed = check_trajectories("bc", env.env_id, trajs, cfg.max_failure_share, kind="demonstration episodes")
    demos = [t for t in trajs if t.infra_failure is None]
    samples = [x for t in demos for x in t.samples]
    check_demonstrations(demos, len(samples), cfg)
    demo_steps, random_actions = sum(t.num_turns for t in demos), int(all_sum([expert.random_actions])[0])  # (over the ranks)
    s.state.env_steps += demo_steps
    demo_success = sum(t.success for t in demos) / len(demos)
    s.progress.message(
        f"bc: {len(demos)} demonstrations, {demo_steps} steps ({random_actions} random), {len(samples)} samples, "
        f"demonstrator success {demo_success:.2f}" + (f", {failed} infrastructure failures left out" if failed else "")
    )

    # 2. supervised fine-tuning on action tokens (on several ranks: each takes its share of every
    #    minibatch, its loss weighted by its share of the minibatch's action tokens; turnforge.dist)
    attach_trainer(policy)
    model = policy.train_model
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=bc.lr, weight_decay=0.0)
    step = GuardedStep(model, optimizer, cfg.rl.max_grad_norm, cfg.rl.max_bad_steps)
    steps_per_epoch = -(-len(samples) // bc.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(bc.lr_schedule, i, bc.epochs * steps_per_epoch))
    s.progress.stage("bc", bc.epochs * steps_per_epoch)
    model.train()
    n, loss_value, t0 = 0, float("nan"), time.time()
    for epoch in range(bc.epochs):
        order = rng(cfg.seed, "bc", epoch).permutation(len(samples))
        loss_sum, loss_tokens = 0.0, 0  # the epoch's loss: its minibatches' losses weighted by their action tokens
        for b in range(steps_per_epoch):
            chunk = [samples[i] for i in order[b * bc.batch_size:(b + 1) * bc.batch_size]]
            s.state.train_tokens += sum(len(x) for x in chunk)
            rank_loss = 0.0  # this rank's passes' losses, each times its factor
            for part in micro_batches(chunk, lambda x: x.num_action_tokens, len, cfg.model.micro_batch_tokens):
                batch = collate(part.rows, policy.pad_id, vision=policy.vision)
                logprobs, _ = token_logprobs(model, batch.ids, batch.attention, positions=batch.mask, vision=batch.vision)
                loss = sft_loss(logprobs, batch.mask)
                step.backward(loss if part.factor == 1.0 else loss * part.factor)
                rank_loss += loss.item() * part.factor
            step.step()
            scheduler.step()
            n += 1
            ((loss_value,),) = share_weighted([[rank_loss]], [1.0])  # the minibatch's loss over all ranks
            tokens = sum(x.num_action_tokens for x in chunk)  # the whole minibatch's (every rank holds its rows)
            loss_sum, loss_tokens = loss_sum + loss_value * tokens, loss_tokens + tokens
            s.progress.update(n, loss=loss_value, tokens_per_s=s.state.train_tokens / (time.time() - t0))
        s.metrics.log(BCEpoch(epoch, loss_sum / loss_tokens if loss_tokens else float("nan")), s.state.env_steps)
    model.eval()
    sync_weights(policy.trainer, policy.model)  # on several ranks: into the sampling model (freeze_bc pushes it)

    # 3. record
    stats = BCStats(
        demonstrations=len(demos), demo_env_steps=demo_steps, demo_samples=len(samples),
        demo_infra_failures=failed, expert_success_rate=demo_success, expert_noise=bc.expert_noise,
        demo_random_actions=random_actions, final_loss=loss_value, optimizer_steps=n, skipped_steps=step.skipped,
    )
    return s.metrics.log(stats, s.state.env_steps)


def check_demonstrations(demos: list[Trajectory], samples: int, cfg: TrainConfig) -> None:
    """Stop before BC trains on nothing worth cloning: no demonstration succeeded, or none left a
    sample (``samples``: their count). One ``RunStopped`` line naming what to change: the budget
    that cut most of them (``BUDGET_KEYS``), else the demonstrator's noise, else the expert."""
    if samples and any(t.success for t in demos):
        return
    cut = Counter(t.truncation_reason for t in demos if t.truncation_reason in BUDGET_KEYS)
    if cut:
        reason, n = cut.most_common(1)[0]
        key = BUDGET_KEYS[reason]
        why = f"{n} ended at {key}={getattr(cfg.rollout, key.split('.')[1])}: raise {key}"
    elif cfg.bc.expert_noise > 0:
        why = f"the demonstrator plays random actions (bc.expert_noise={cfg.bc.expert_noise:g}): lower bc.expert_noise"
    else:
        why = "the env's expert won none: check its expert_action(), or set bc.enabled=false"
    what = "succeeded" if samples else "left a sample to train on"
    raise RunStopped(f"bc: none of the {len(demos)} demonstrations {what} ({why}); nothing worth cloning, so no training")
