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

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache


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
    prefills: PrefillCache | None = None,
) -> list[Generation]:
    """Sample continuations of ``prompts`` (lists of ids). ``temperature == 0`` is greedy
    (its logprobs are then those of the temperature-1 distribution). ``prefills``: prompts
    already prefilled at the same padded width (by the same weights) are not prefilled again;
    the result is the same bit for bit."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    out: list[Generation] = []
    for start in range(0, len(prompts), max_batch):
        gens, _ = _sample_batch(model, prompts[start:start + max_batch], max_new_tokens, stop_ids, pad_id, temperature,
                                generator, prefills=prefills)
        out.extend(gens)
    return out


class PrefillCache:
    """Prefills of repeated prompts, computed once, for weights that do not change while it lives.

    The same held-out tasks played several times by one policy (the evaluations of the BC
    policy at each of ``eval.bc_temperatures``) prefill the same prompts again and again: every
    episode's first observation, and, for a policy with a short history window, every state
    it revisits. A prefill's result for one row (its last-position logits and its KV cache)
    depends only on the row's ids and the padded width of its batch, not on the other rows or
    their number, so an entry keyed by ``(ids, width)`` stands in for the forward pass exactly:
    sampling with the cache gives the same tokens and logprobs bit for bit (tested). Entries
    are kept until ``max_bytes`` is reached, then no more are added. Built-in sampler, plain
    path only (not with ``rollout.prefix_cache``, whose per-episode caches do the same job
    differently, nor with vLLM)."""

    def __init__(self, max_bytes: int, version: int) -> None:
        self.max_bytes, self.version = max_bytes, version
        self.entries: dict[tuple[tuple[int, ...], int], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.bytes = 0
        self.hits = 0  # rows not prefilled by the model (an entry, or another row of the same batch)
        self.misses = 0  # rows prefilled by the model

    def check(self, version: int) -> None:
        if version != self.version:
            raise RuntimeError(f"a PrefillCache of policy version {self.version} used with version {version}")

    def prefill(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], ids: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
        """The prefill of left-padded ``ids [B, W]`` (``mask``, ``positions`` alike): last-position
        logits ``[B, V]`` (float32) and the KV cache, from the entries of rows seen before and one
        forward pass over the others (each distinct row once)."""
        width = ids.shape[1]
        keys = [(tuple(int(t) for t in p), width) for p in prompts]
        missing = list(dict.fromkeys(k for k in keys if k not in self.entries))
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        computed = {}
        if missing:
            first = {k: i for i, k in reversed(list(enumerate(keys)))}  # the first row of each key
            rows = torch.as_tensor([first[k] for k in missing])
            out = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=positions[rows], use_cache=True)
            logits = out.logits[:, -1, :].float()
            for j, k in enumerate(missing):
                computed[k] = (logits[j].clone(), [(layer.keys[j].clone(), layer.values[j].clone()) for layer in out.past_key_values.layers])
                size = sum(t.numel() * t.element_size() for kv in computed[k][1] for t in kv) + computed[k][0].numel() * 4
                if self.bytes + size <= self.max_bytes:
                    self.entries[k] = computed[k]
                    self.bytes += size
        got = [self.entries.get(k) or computed[k] for k in keys]
        layers = [(torch.stack([g[1][i][0] for g in got]), torch.stack([g[1][i][1] for g in got])) for i in range(len(got[0][1]))]
        return torch.stack([g[0] for g in got]), DynamicCache(ddp_cache_data=layers)


@dataclass
class RowCache:
    """The KV cache of one token sequence, compact (no padding): per layer (keys, values),
    each ``[kv_heads, len(ids), head_dim]``, computed by the policy at ``version``."""

    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    version: int

    def prefix(self, n: int) -> "RowCache":
        return RowCache(self.ids[:n], [(k[:, :n], v[:, :n]) for k, v in self.layers], self.version)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0])


class PrefixCache:
    """Prefill only what is new (``rollout.prefix_cache``).

    Keeps, per episode, the KV cache of its last prompt and the tokens it sampled. When the
    episode's next prompt starts with those ids (full-history mode: the prompt grows by the
    template's closing text and the new observation), only the new tokens are prefilled; in
    window mode the reusable part is whatever prefix still matches (the system prompt, at
    least). A new episode reuses the longest matching prefix of the row stored last (the
    shared system prompt). Identical prompts in one batch (a GRPO group's first turn) are
    prefilled once. Entries belong to one policy version: a weight update makes them all
    stale, and an episode that does not act in a call is dropped (it has ended).

    Logprobs equal those of a full prefill up to float rounding (the matmul shapes differ);
    the trainer re-scores every sample anyway."""

    def __init__(self) -> None:
        self.entries: dict[str, RowCache] = {}
        self.last: RowCache | None = None
        self.prefilled_tokens = 0  # prompt tokens the model prefilled
        self.reused_tokens = 0  # prompt tokens whose KV came from the cache or from a duplicate prompt

    def _lookup(self, key: str, prompt: Sequence[int], version: int) -> RowCache | None:
        for cand in (self.entries.get(key), self.last):
            if cand is None or cand.version != version:
                continue
            n = min(common_prefix(cand.ids, prompt), len(prompt) - 1)  # at least one token to prefill: its logits
            if n > 0:
                return cand if n == len(cand.ids) else cand.prefix(n)
        return None

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, keys: Sequence[str], prompts: Sequence[Sequence[int]], version: int, *,
               max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, temperature: float = 1.0,
               generator: torch.Generator | None = None) -> list[Generation]:
        past = [self._lookup(k, p, version) for k, p in zip(keys, prompts)]
        gens, rows = _sample_batch(model, prompts, max_new_tokens, stop_ids, pad_id, temperature, generator,
                                   past=past, keep=True, version=version, counters=self)
        self.entries = dict(zip(keys, rows))
        self.last = rows[-1] if rows else self.last
        return gens


def _past_cache(reused: list[RowCache | None], device) -> tuple[DynamicCache | None, torch.Tensor]:
    """The reused prefixes as one left-padded ``DynamicCache`` and its attention mask ``[rows, P]``."""
    lengths = [0 if c is None else len(c.ids) for c in reused]
    width = max(lengths)
    mask = torch.zeros((len(reused), width), dtype=torch.long)
    if width == 0:
        return None, mask
    data = []
    for layer, (k0, v0) in enumerate(next(c for c in reused if c is not None).layers):
        k = k0.new_zeros((len(reused), k0.shape[0], width, k0.shape[2]))
        v = v0.new_zeros((len(reused), v0.shape[0], width, v0.shape[2]))
        for r, c in enumerate(reused):
            if c is not None:
                k[r, :, width - len(c.ids):], v[r, :, width - len(c.ids):] = c.layers[layer]
        data.append((k.to(device), v.to(device)))
    for r, n in enumerate(lengths):
        mask[r, width - n:] = 1
    return DynamicCache(ddp_cache_data=data), mask


def _sample_batch(model, prompts, max_new_tokens, stop_ids, pad_id, temperature, generator, *, past=None, keep=False,
                  version=0, counters=None, prefills=None) -> tuple[list[Generation], list[RowCache]]:
    """Sample a batch. ``past``: per prompt, a ``RowCache`` of a prefix of it whose KV is
    reused (or None); identical prompts are then also prefilled once. ``keep``: return each
    row's ``RowCache`` (its prompt and the sampled ids that were fed back). ``prefills``: a
    ``PrefillCache`` for the plain path (no ``past``)."""
    device = next(model.parameters()).device
    batch = len(prompts)
    if past is not None:  # one prefill row per distinct prompt
        index: dict[tuple[int, ...], int] = {}
        inverse = [index.setdefault(tuple(p), len(index)) for p in prompts]
        rows = [inverse.index(u) for u in range(len(index))]
        reused = [past[i] for i in rows]
    else:
        rows, inverse, reused = list(range(batch)), list(range(batch)), [None] * batch
    cache, past_mask = _past_cache(reused, device)
    p_len = past_mask.sum(-1)
    new_ids, new_mask = _left_pad([prompts[i][int(n):] for i, n in zip(rows, p_len)], pad_id)
    mask = torch.cat([past_mask, new_mask], dim=1).to(device)
    positions = (p_len[:, None] + new_mask.cumsum(-1) - 1).clamp(min=0).to(device)
    if counters is not None:
        counters.prefilled_tokens += int(new_mask.sum())
        counters.reused_tokens += sum(len(p) for p in prompts) - int(new_mask.sum())

    # with the prefix cache, only the last position's logits are computed (as HF generate does); the plain
    # path keeps computing all of them so that the tiny recipes' figures stay bit-identical
    extra = {"logits_to_keep": 1} if past is not None else {}
    if prefills is not None and past is None:
        logits, past_kv = prefills.prefill(model, prompts, new_ids.to(device), mask, positions)  # [rows, V]
    else:
        out = model(input_ids=new_ids.to(device), attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, **extra)
        past_kv = out.past_key_values
        logits = out.logits[:, -1, :].float()  # [rows, V]
    next_pos = positions[:, -1:] + 1  # [rows, 1]
    if len(rows) < batch:  # each distinct prompt's prefill, copied to its duplicates
        expand = torch.as_tensor(inverse, device=device)
        past_kv.batch_select_indices(expand)
        logits, mask, next_pos = logits[expand], mask[expand], next_pos[expand]
    prompt_width = mask.shape[1]
    stop = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    sampled = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    fed = 0  # sampled tokens fed back through the model (their KV is in the cache)
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
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=past_kv, use_cache=True)
        past_kv = out.past_key_values
        logits = out.logits[:, -1, :].float()
        next_pos = next_pos + 1
        fed += 1

    result = []
    sampled_l, logps_l, lengths_l, stopped_l = sampled.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()
    for i in range(batch):
        n = lengths_l[i]
        result.append(Generation(tuple(sampled_l[i][:n]), tuple(logps_l[i][:n]), bool(stopped_l[i])))
    kept: list[RowCache] = []
    if keep:
        prompt_mask = mask[:, :prompt_width].cpu()
        for i in range(batch):
            k_i = min(lengths_l[i], fed)
            where = torch.cat([prompt_mask[i].nonzero().squeeze(-1), prompt_width + torch.arange(k_i)]).to(device)
            layers = [(layer.keys[i].index_select(1, where), layer.values[i].index_select(1, where)) for layer in past_kv.layers]
            kept.append(RowCache(tuple(prompts[i]) + tuple(sampled_l[i][:k_i]), layers, version))
    return result, kept


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id sequences: ``(ids [B, T], attention_mask [B, T])``."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)  # a copy: arrays from Ray are read-only
        mask[i, : len(s)] = 1
    return ids, mask


def _keeps_selected_logits(model: torch.nn.Module) -> bool:
    """Whether ``model`` (an HF causal LM, possibly under peft or ``FrozenBase``) accepts a
    boolean ``[B, T]`` ``logits_to_keep`` and applies its head to those positions only."""
    import inspect

    from transformers import modeling_utils

    inner = getattr(model, "_peft", model)  # FrozenBase
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PeftModel
    return hasattr(modeling_utils, "slice_logits_to_keep") and "logits_to_keep" in inspect.signature(inner.forward).parameters


def token_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each token given the tokens before it, for right-padded ``ids``.

    Returns ``logprobs [B, T]`` (position 0 is 0: nothing predicts the first token) and,
    if asked, the entropy of each predictive distribution ``[B, T]`` (same alignment).

    ``positions`` (``[B, T]``, nonzero on the tokens to score, e.g. a batch's action mask):
    only those tokens are scored and every other entry is 0. The LM head and the
    vocabulary-wide softmax then run on those positions alone (``logits_to_keep`` with a
    boolean mask), not on every prompt position: on SmolLM2 the head is 28 M of 135 M
    parameters and a 49,152-wide row per position, so this saves most of the memory of a
    multi-turn batch. Models without that argument get full logits, then the selection.
    """
    if positions is None:
        logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1, :].float()  # [B, T-1, V]
        targets = ids[:, 1:]
        keep = None
    else:
        keep = positions[:, 1:] != 0  # [B, T-1]: token t is predicted at position t-1
        if _keeps_selected_logits(model):
            head = F.pad(keep, (0, 1), value=False)  # [B, T]
            logits = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=head).logits.float()  # [N, V]
        else:
            logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1, :][keep].float()
        targets = ids[:, 1:][keep]
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets[..., None]).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    if keep is not None:  # back to [B, T-1], zeros where nothing was scored
        picked = torch.zeros(keep.shape, dtype=picked.dtype, device=picked.device).masked_scatter(keep, picked)
        if entropy is not None:
            entropy = torch.zeros(keep.shape, dtype=entropy.dtype, device=entropy.device).masked_scatter(keep, entropy)
    return F.pad(picked, (1, 0)), (F.pad(entropy, (1, 0)) if entropy is not None else None)
