"""Batched sampling and scoring with any HF causal LM (the CPU backend).

``sample`` generates continuations for a batch of token-id prompts with a KV cache and
returns, per prompt, the sampled ids and the log-probability of each sampled id under
the distribution it was drawn from (softmax of logits / temperature). Nothing is
decoded and re-encoded: the ids are the record.

``token_logprobs`` re-scores stored sequences in one forward pass; it is what the
trainer uses, so a stored sampling logprob and a re-scored one differ only by float
error (checked in tests).

Departure from HF ``generate``: only temperature sampling or greedy decoding. Top-p /
top-k would make the sampling distribution differ from the one the trainer scores,
which biases the PPO ratio; they are left out on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Generation:
    """One sampled continuation."""

    ids: tuple[int, ...]  # sampled ids, including the stop token if one was sampled
    logprobs: tuple[float, ...]  # log p(id) under the sampling distribution, same length as ids
    stopped: bool  # True if a stop id ended it, False if max_new_tokens did


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    max_batch: int = 256,
) -> list[Generation]:
    """Sample continuations of ``prompts`` (lists of ids). ``temperature == 0`` is greedy
    (its logprobs are then those of the temperature-1 distribution)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    out: list[Generation] = []
    for start in range(0, len(prompts), max_batch):
        out.extend(
            _sample_batch(model, prompts[start:start + max_batch], max_new_tokens, stop_ids, pad_id, temperature, generator)
        )
    return out


def _sample_batch(model, prompts, max_new_tokens, stop_ids, pad_id, temperature, generator) -> list[Generation]:
    device = next(model.parameters()).device
    ids, mask = _left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    batch = ids.shape[0]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stop = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    sampled = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)

    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    past = out.past_key_values
    logits = out.logits[:, -1, :].float()  # [B, V]
    next_pos = positions[:, -1:] + 1  # [B, 1]
    for t in range(max_new_tokens):
        logp_full = F.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)  # [B, V]
        if temperature > 0:
            tok = torch.multinomial(logp_full.exp(), 1, generator=generator).squeeze(-1)  # [B]
        else:
            tok = logp_full.argmax(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        sampled[:, t] = tok
        logps[:, t] = logp_full.gather(-1, tok[:, None]).squeeze(-1)
        hit = torch.isin(tok, stop) & ~done
        stopped |= hit
        lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
        done |= hit
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()
        next_pos = next_pos + 1

    result = []
    sampled_l, logps_l, lengths_l, stopped_l = sampled.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()
    for i in range(batch):
        n = lengths_l[i]
        result.append(Generation(tuple(sampled_l[i][:n]), tuple(logps_l[i][:n]), bool(stopped_l[i])))
    return result


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id sequences: ``(ids [B, T], attention_mask [B, T])``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)  # a copy: arrays from Ray are read-only
        mask[i, : len(s)] = 1
    return ids, mask


def token_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each token given the tokens before it, for right-padded ``ids``.

    Returns ``logprobs [B, T]`` (position 0 is 0: nothing predicts the first token) and,
    if asked, the entropy of each predictive distribution ``[B, T]`` (same alignment).
    """
    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1, :].float()  # [B, T-1, V]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # [B, T-1]
    picked = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logz  # [B, T-1]
    logprobs = F.pad(picked, (1, 0))
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = F.pad(logz - (probs * logits).sum(-1), (1, 0))
    return logprobs, entropy
