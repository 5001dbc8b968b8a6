"""Pieces the training stages share: collation, event counts, scoring samples in batches without gradients,
the policy's entropy on action tokens (the guarded optimizer step and learning-rate schedules: ``turnforge.optim``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from turnforge.batching import SCORING_BATCH, batches
from turnforge.policy.generate import pad_right, token_logprobs
from turnforge.policy.model import Policy
from turnforge.types import Sample, Trajectory


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T] right-padded token ids
    attention: torch.Tensor  # [B, T] 1 on real tokens
    mask: torch.Tensor  # [B, T] float, 1 on action tokens
    old_logprobs: torch.Tensor  # [B, T] sampling logprobs, 0 where not sampled
    advantages: torch.Tensor  # [B, T] the sample's advantage on its action tokens, 0 elsewhere
    vision: dict[str, torch.Tensor] | None = None  # pixel inputs of the rows' image blocks (vision policies)

    @property
    def num_tokens(self) -> int:
        return int(self.attention.sum())


def collate(samples: Sequence[Sample], pad_id: int, advantages: Sequence[float | np.ndarray] | None = None,
            vision=None) -> Batch:
    """Right-pad samples into tensors. ``advantages`` holds one entry per sample: a float
    (put on all its action tokens) or a per-token array of the sample's length. Samples with
    images need ``vision`` (the policy's ``Vision``): their pixels go with the batch."""
    ids, attention = pad_right([s.token_ids for s in samples], pad_id)
    mask = torch.zeros(ids.shape, dtype=torch.float32)
    old = torch.zeros(ids.shape, dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s)
        mask[i, :n] = torch.from_numpy(s.loss_mask.astype(np.float32))
        old[i, :n] = torch.from_numpy(np.nan_to_num(s.logprobs, nan=0.0))
    adv = torch.zeros(ids.shape, dtype=torch.float32)
    if advantages is not None:
        for i, (s, a) in enumerate(zip(samples, advantages)):
            adv[i, :len(s)] = torch.as_tensor(np.broadcast_to(np.asarray(a, np.float32), (len(s),)).copy())
        adv = adv * mask
    pixels = None
    if any(s.images for s in samples):
        if vision is None:
            raise ValueError("samples with images need the policy's vision processor (collate(..., vision=policy.vision))")
        pixels = vision.inputs([s.images for s in samples])
    return Batch(ids, attention, mask, old, adv, pixels)


def event_counts(trajectories: Sequence[Trajectory]) -> dict[str, int]:
    """Sums of the env's event counters (integer ``info`` values under ``n_*`` keys, e.g. a
    tool env's ``n_tool_errors``) over all turns, for the metrics."""
    out: dict[str, int] = {}
    for t in trajectories:
        for turn in t.turns:
            for key, value in turn.info.items():
                if key.startswith("n_") and isinstance(value, (int, bool)):
                    out[key] = out.get(key, 0) + int(value)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Scored:
    """One chunk of ``score_samples``: the samples, their collated batch, and the model's
    logprobs ``[B, T]`` (and entropies ``[B, T]`` when asked) at the batch's action positions."""

    samples: Sequence[Sample]
    batch: Batch
    logprobs: torch.Tensor
    entropy: torch.Tensor | None


@torch.no_grad()
def score_samples(model: torch.nn.Module, samples: Sequence[Sample], pad_id: int, temperature: float, *, vision=None,
                  with_entropy: bool = False, batch_size: int = SCORING_BATCH) -> Iterator[Scored]:
    """``model``'s logprobs of the samples' tokens at ``temperature``, a chunk of ``batch_size``
    samples per forward pass, computed on the action positions only (the LM head on those
    rows). ``vision``: the policy's, for samples with images."""
    for chunk in batches(samples, batch_size):
        batch = collate(chunk, pad_id, vision=vision)
        lp, ent = token_logprobs(model, batch.ids, batch.attention, temperature, with_entropy=with_entropy,
                                 positions=batch.mask, vision=batch.vision)
        yield Scored(chunk, batch, lp, ent)


def action_entropy(policy: Policy, samples: Sequence[Sample], limit: int = 512) -> float | None:
    """Mean entropy (nats) of the policy's next-token distribution at temperature 1 on the action
    tokens of the first ``limit`` samples (None for no sample): the flywheel's entropy per round
    (on its plain samples, before the round's update) and the boundary's (on the pass@k samples)."""
    if not samples:
        return None
    out, n = 0.0, 0
    for scored in score_samples(policy.model, samples[:limit], policy.pad_id, 1.0, vision=policy.vision, with_entropy=True):
        m = scored.batch.mask
        out += float((scored.entropy * m).sum())
        n += int(m.sum())
    return out / max(n, 1)
