"""The learned critic: a value model, its per-turn predictions, its update, value pretraining.

Design choice: a **separate value model** (the policy's transformer trunk, copied after
BC or freshly initialised, plus a scalar head), not a value head on the policy's trunk.
A shared trunk lets the value loss move the policy's features: at the start of RL the
critic's errors are large, and their gradients would perturb the BC policy that RL
starts from. A separate model costs a second forward pass per turn and a second copy of
the weights, which is small for the models this runs on a CPU; for large models the
critic can be a smaller model of the same tokenizer (``critic.init=random`` with
another config is the hook for that). VAPO and verl's PPO also use separate critics.

Turn-level values: the agent acts once per turn, so the critic scores states, not
tokens. ``V(s_k)`` is read at the last context token before turn k's action: for a
per-turn (window) sample that is the end of its prompt; for a whole-episode sample it is
the token before the k-th run of action tokens. GAE then runs over the turns of an
episode (``turnforge.algos.estimators.gae_turn_advantages``). Departure from VAPO, which
estimates values per generated token: our actions are a few tokens and the reward
arrives per turn, so per-token values would add positions with nothing to learn.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from turnforge.algos import explained_variance, value_loss
from turnforge.batching import SCORING_BATCH, batches
from turnforge.dist import micro_batches, share_weighted
from turnforge.optim import GuardedStep
from turnforge.policy.generate import pad_right
from turnforge.seeding import stable_hash
from turnforge.types import Sample, Trajectory


class ValueModel(nn.Module):
    """A transformer trunk (``AutoModel``) and a linear head: one value per position."""

    def __init__(self, trunk: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # start from V = 0 everywhere: no spurious early advantages
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Values ``[B, T]``, computed on the critic's device, returned on ``ids``' device."""
        device = self.head.weight.device
        hidden = self.trunk(input_ids=ids.to(device), attention_mask=attention.to(device)).last_hidden_state
        # a fresh tensor, not a view: FSDP2 (turnforge.dist) hooks the output of a sharded critic
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).clone().to(ids.device)


def build_value_model(policy_model: nn.Module, init: str, seed: int) -> ValueModel:
    """A critic whose trunk is a copy of ``policy_model``'s (``init='policy'``) or the same
    architecture freshly initialised from ``seed`` (``init='random'``). Float32 always."""
    if init == "policy":
        trunk = copy.deepcopy(policy_model.base_model)
    elif init == "random":
        from transformers import AutoModel

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stable_hash(seed, "critic-init"))
            trunk = AutoModel.from_config(policy_model.config)
    else:
        raise ValueError(f"unknown critic init {init!r}; valid: 'policy', 'random'")
    trunk = trunk.float()
    for p in trunk.parameters():
        p.requires_grad_(True)
    return ValueModel(trunk, policy_model.config.hidden_size).to(next(policy_model.parameters()).device)


def value_positions(sample: Sample) -> np.ndarray:
    """Positions whose value is V(s_k): the last token before each run of action tokens."""
    mask = sample.loss_mask.astype(bool)
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    if len(starts) == 0 or starts[0] == 0:
        raise ValueError(f"sample {sample.trajectory_id!r}: an action run without a context token before it")
    return starts - 1


@dataclass(frozen=True)
class ValueBatch:
    ids: torch.Tensor  # [B, T]
    attention: torch.Tensor  # [B, T]
    where: torch.Tensor  # [B, T] 1 at value positions
    targets: torch.Tensor  # [B, T] return targets at value positions, 0 elsewhere
    old: torch.Tensor  # [B, T] critic values at rollout time, 0 elsewhere


def collate_values(
    samples: Sequence[Sample], pad_id: int, targets: Sequence[np.ndarray] | None = None, old: Sequence[np.ndarray] | None = None
) -> ValueBatch:
    """Right-pad samples and scatter per-turn targets / old values onto their value positions."""
    ids, attention = pad_right([s.token_ids for s in samples], pad_id)
    where = torch.zeros(ids.shape)
    tgt, prev = torch.zeros(ids.shape), torch.zeros(ids.shape)
    for i, s in enumerate(samples):
        pos = torch.as_tensor(value_positions(s))
        where[i, pos] = 1.0
        if targets is not None:
            tgt[i, pos] = torch.as_tensor(np.asarray(targets[i], np.float32))
        if old is not None:
            prev[i, pos] = torch.as_tensor(np.asarray(old[i], np.float32))
    return ValueBatch(ids, attention, where, tgt, prev)


@torch.no_grad()
def predict(critic: ValueModel, samples: Sequence[Sample], pad_id: int, batch_size: int = SCORING_BATCH) -> list[np.ndarray]:
    """Values at each sample's value positions (one array per sample)."""
    critic.eval()
    out: list[np.ndarray] = []
    for chunk in batches(samples, batch_size):
        batch = collate_values(chunk, pad_id)
        values = critic(batch.ids, batch.attention)
        for i, s in enumerate(chunk):
            out.append(values[i, torch.as_tensor(value_positions(s))].numpy().astype(np.float32))
    return out


def turn_values(critic: ValueModel, trajs: Sequence[Trajectory], pad_id: int) -> dict[str, np.ndarray]:
    """``V(s_k)`` for every turn of every trajectory: ``trajectory_id -> [num_turns]``."""
    samples = [x for t in trajs for x in t.samples]
    per_sample = predict(critic, samples, pad_id)
    out: dict[str, np.ndarray] = {t.trajectory_id: np.zeros(t.num_turns, np.float32) for t in trajs}
    for x, v in zip(samples, per_sample):
        if x.turn_index >= 0:
            out[x.trajectory_id][x.turn_index] = v[0]
        else:
            out[x.trajectory_id][:] = v[: len(out[x.trajectory_id])]
    return out


def sample_targets(trajs: Sequence[Trajectory], per_turn: dict[str, np.ndarray]) -> list[tuple[Sample, np.ndarray]]:
    """Each sample with its slice of a per-turn array (one value for a turn sample, all
    the episode's for a whole-episode sample)."""
    out = []
    for t in trajs:
        for x in t.samples:
            arr = per_turn[t.trajectory_id]
            out.append((x, arr[x.turn_index:x.turn_index + 1] if x.turn_index >= 0 else arr))
    return out


@dataclass(frozen=True)
class CriticUpdate:
    loss: float
    explained_variance: float  # of the rollout-time values against the targets (before this update)
    steps: int
    tokens: int


def update_critic(
    critic: ValueModel,
    optimizer: torch.optim.Optimizer,
    data: Sequence[tuple[Sample, np.ndarray, np.ndarray]],
    pad_id: int,
    *,
    epochs: int,
    minibatch_size: int,
    clip: float | None,
    max_grad_norm: float,
    order_rng: np.random.Generator,
    max_steps: int | None = None,
    micro_batch_tokens: int = 0,
) -> CriticUpdate:
    """Clipped value-loss updates on ``(sample, targets, old_values)`` triples (at most
    ``max_steps`` optimizer steps when given). A step with a non-finite loss or gradient is
    skipped. On several trainer ranks ``critic`` is the sharded copy (``turnforge.dist``): each
    rank takes its share of every minibatch, weighted by its value positions, so the step is the
    one a single process takes on the whole minibatch; a minibatch over ``micro_batch_tokens`` padded
    tokens runs in several passes (``turnforge.dist.micro_batches``)."""
    step = GuardedStep(critic, optimizer, max_grad_norm, max_bad=sys.maxsize)  # skipped steps are not fatal here
    critic.train()
    figures, steps, tokens = [], 0, 0
    for _ in range(epochs):
        order = order_rng.permutation(len(data)).tolist()
        for b in range(0, len(order), minibatch_size):
            if max_steps is not None and steps >= max_steps:
                break
            chunk = [data[i] for i in order[b:b + minibatch_size]]
            tokens += sum(len(x) for x, _, _ in chunk)
            rank_loss = 0.0  # this rank's passes' losses, each times its factor
            for part in micro_batches(chunk, lambda row: len(value_positions(row[0])), lambda row: len(row[0]),
                                      micro_batch_tokens):
                batch = collate_values([x for x, _, _ in part.rows], pad_id, [t for _, t, _ in part.rows],
                                       [o for _, _, o in part.rows])
                values = critic(batch.ids, batch.attention)
                loss = value_loss(values, batch.old, batch.targets, batch.where, clip)
                step.backward(loss if part.factor == 1.0 else loss * part.factor)
                rank_loss += float(loss.detach()) * part.factor
            step.step()
            figures.append([rank_loss])
            steps += 1
    losses = [row[0] for row in share_weighted(figures, [1.0] * len(figures))]
    critic.eval()
    old = np.concatenate([o for _, _, o in data]) if data else np.zeros(0)
    tgt = np.concatenate([t for _, t, _ in data]) if data else np.zeros(0)
    ev = explained_variance(torch.as_tensor(old), torch.as_tensor(tgt))
    return CriticUpdate(float(np.mean(losses)) if losses else float("nan"), ev, steps, tokens)


def pretrain_critic(
    critic: ValueModel,
    optimizer: torch.optim.Optimizer,
    data: Sequence[tuple[Sample, np.ndarray]],
    pad_id: int,
    *,
    max_steps: int,
    target_ev: float,
    minibatch_size: int,
    max_grad_norm: float,
    seed: int,
    micro_batch_tokens: int = 0,
) -> dict[str, float]:
    """Value pretraining: regress Monte-Carlo returns of the BC policy (plain squared error)
    until the explained variance on a held-back 20% of the samples reaches ``target_ev``
    (checked after every pass over the rest) or ``max_steps`` optimizer steps are done."""
    rng = np.random.default_rng(stable_hash(seed, "critic-pretrain"))
    order = rng.permutation(len(data))
    n_val = max(1, len(data) // 5)
    val, fit = [data[i] for i in order[:n_val]], [data[i] for i in order[n_val:]]
    val_targets = np.concatenate([t for _, t in val])

    def held_back_ev() -> float:
        pred = np.concatenate(predict(critic, [x for x, _ in val], pad_id, minibatch_size))
        return explained_variance(torch.as_tensor(pred), torch.as_tensor(val_targets))

    ev, steps, passes = held_back_ev(), 0, 0
    while steps < max_steps and not ev >= target_ev and fit:
        result = update_critic(
            critic, optimizer, [(x, t, np.zeros_like(t)) for x, t in fit], pad_id, epochs=1,
            minibatch_size=minibatch_size, clip=None, max_grad_norm=max_grad_norm, order_rng=rng, max_steps=max_steps - steps,
            micro_batch_tokens=micro_batch_tokens,
        )
        steps += result.steps
        passes += 1
        ev = held_back_ev()
    return {"steps": steps, "passes": passes, "explained_variance": ev, "states": len(data), "held_back": n_val}
