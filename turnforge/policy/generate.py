"""Batched sampling and scoring with any HF causal LM (the CPU backend).

``sample`` generates continuations for a batch of token-id prompts with a KV cache and
returns, per prompt, the sampled ids and the log-probability of each sampled id under
the distribution it was drawn from (softmax of logits / temperature). Nothing is
decoded and re-encoded: the ids are the record.

``PrefixCache`` samples the same way while keeping each episode's KV cache between turns
(``rollout.prefix_cache``), the prefix all rows share held once, within a memory budget
(``rollout.kv_cache_gib``); its caches are laid out by ``turnforge.policy.kvcache``.

``token_logprobs`` re-scores stored sequences in one forward pass; it is what the
trainer uses, so a stored sampling logprob and a re-scored one differ only by float
error (checked in tests).

Departure from HF ``generate``: only temperature sampling or greedy decoding. Top-p /
top-k would make the sampling distribution differ from the one the trainer scores,
which biases the PPO ratio; they are left out on purpose.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from turnforge.policy.kvcache import BatchKV, RowCache, default_budget_bytes, kv_bytes_per_token, num_layers


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


class _Noise:
    """The random draws of one batch's decoding steps, replayable for any chunk of its rows.

    ``torch.multinomial(probs, 1)`` draws ``q ~ Exp(1)`` of the shape of ``probs`` and returns
    ``argmax(probs / q)``; on CPU the draw is serial, so the first ``k`` rows of a draw are the
    draw of ``k`` rows from the same generator state. Keeping the generator state before each
    step, a chunk of rows ``[lo, hi)`` draws exactly the noise those rows get when the whole
    batch is sampled at once, and ``finish`` leaves the generator where the whole batch leaves
    it: sampling in chunks (``rollout.kv_cache_gib``) gives the same tokens."""

    def __init__(self, generator: torch.Generator | None, rows: int) -> None:
        self.gen = torch.default_generator if generator is None else generator
        self.rows = rows
        self.states = [self.gen.get_state()]  # states[t]: before step t's draw

    def draw(self, step: int, lo: int, hi: int, vocab: int) -> torch.Tensor:
        """The noise of rows ``[lo, hi)`` at decoding step ``step``: ``[hi - lo, vocab]``."""
        self.gen.set_state(self.states[step])
        if step + 1 == len(self.states):  # the first time this step is drawn: draw it whole, keep the state after it
            q = torch.empty((self.rows, vocab), dtype=torch.float32).exponential_(1, generator=self.gen)
            self.states.append(self.gen.get_state())
            return q[lo:hi]
        return torch.empty((hi, vocab), dtype=torch.float32).exponential_(1, generator=self.gen)[lo:]

    def draw_rows(self, step: int, lo: int, hi: int, vocab: int, active: torch.Tensor) -> torch.Tensor:
        """``draw`` (``active`` is unused: every row of the batch draws at every step)."""
        return self.draw(step, lo, hi, vocab)

    def finish(self, steps: int) -> None:
        """Leave the generator as sampling the whole batch for ``steps`` steps would."""
        self.gen.set_state(self.states[steps])


class _RowNoise:
    """Per-row random draws (``row_seeds``): row ``i``'s noise at its ``k``-th decoding step is
    the ``k``-th ``[vocab]`` ``Exp(1)`` draw of ``torch.Generator().manual_seed(row_seeds[i])``.

    Where it departs from ``_Noise``: a row's draws do not depend on the other rows of its
    batch, their number or lengths, nor on chunking; a row that has stopped draws nothing
    more; no shared generator is read or advanced."""

    def __init__(self, row_seeds: Sequence[int]) -> None:
        self.gens = [torch.Generator().manual_seed(int(s)) for s in row_seeds]
        self.drawn = [0] * len(self.gens)  # draws made per row

    def draw_rows(self, step: int, lo: int, hi: int, vocab: int, active: torch.Tensor) -> torch.Tensor:
        """The noise of rows ``[lo, hi)`` at decoding step ``step``, ``[hi - lo, vocab]``: their own
        next draw for the ``active`` ones (bool ``[hi - lo]``), ones for the others."""
        q = torch.ones((hi - lo, vocab), dtype=torch.float32)
        for j in torch.nonzero(active.cpu()).flatten().tolist():
            i = lo + j
            if self.drawn[i] != step:
                raise RuntimeError(f"row {i} drew {self.drawn[i]} times before step {step}")
            q[j] = torch.empty(vocab, dtype=torch.float32).exponential_(1, generator=self.gens[i])
            self.drawn[i] += 1
        return q

    def finish(self, steps: int) -> None:
        """Nothing to restore (no shared generator)."""


def _make_noise(temperature: float, generator: torch.Generator | None, row_seeds: Sequence[int] | None,
                rows: int) -> _Noise | _RowNoise | None:
    if temperature <= 0:
        return None
    return _Noise(generator, rows) if row_seeds is None else _RowNoise(row_seeds)


def _check_seeds(generator: torch.Generator | None, row_seeds: Sequence[int] | None, rows: int) -> None:
    if row_seeds is None:
        return
    if generator is not None:
        raise ValueError("pass either generator or row_seeds, not both")
    if len(row_seeds) != rows:
        raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {rows} prompts")


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
    vision: dict[str, torch.Tensor] | None = None,
    row_seeds: Sequence[int] | None = None,
) -> list[Generation]:
    """Sample continuations of ``prompts`` (lists of ids), ``max_batch`` prompts per batch.
    ``temperature == 0`` is greedy (its logprobs are then those of the temperature-1 distribution).
    ``prefills``: prompts already prefilled at the same padded width (by the same weights) are
    not prefilled again; the result is the same bit for bit. ``vision``: the pixel inputs of
    the prompts' image blocks (``Vision.inputs``), passed to the prefill; all prompts are then
    one batch and no prefill is reused. ``row_seeds`` (one per prompt; not with ``generator``):
    each row draws from its own generator (``_RowNoise``), so its tokens do not depend on the
    other rows; without them the batch draws from ``generator`` (``_Noise``)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _check_seeds(generator, row_seeds, len(prompts))
    if vision:
        noise = _make_noise(temperature, generator, row_seeds, len(prompts))
        gens, _, steps = _sample_rows(model, prompts, max_new_tokens, stop_ids, pad_id, temperature, noise, vision=vision)
        if noise is not None:
            noise.finish(steps)
        return gens
    out: list[Generation] = []
    for start in range(0, len(prompts), max_batch):
        block = prompts[start:start + max_batch]
        seeds = None if row_seeds is None else row_seeds[start:start + max_batch]
        noise = _make_noise(temperature, generator, seeds, len(block))
        gens, _, steps = _sample_rows(model, block, max_new_tokens, stop_ids, pad_id, temperature, noise,
                                      prefills=prefills)
        if noise is not None:
            noise.finish(steps)
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
                positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The prefill of left-padded ``ids [B, W]`` (``mask``, ``positions`` alike): last-position
        logits ``[B, V]`` (float32) and per layer the keys and values ``[B, kv_heads, W, head_dim]``,
        from the entries of rows seen before and one forward pass over the others (each distinct
        row once)."""
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
        return torch.stack([g[0] for g in got]), layers


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    return int(np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0])


class PrefixCache:
    """Prefill only what is new (``rollout.prefix_cache``), within a memory budget
    (``rollout.kv_cache_gib``).

    Keeps, per episode (``key``), the KV cache of its last prompt and the tokens it sampled.
    When the episode's next prompt starts with those ids (full-history mode: the prompt grows
    by the template's closing text and the new observation), only the new tokens are
    prefilled; in window mode the reusable part is whatever prefix still matches. The prefix
    common to all prompts of a call (the system prompt and worked examples; for a call with
    one prompt, its part shared with the previous call's) is held once, not per row
    (``RowCache.base``), and prefilled once when no cache has it. Identical prompts in one
    batch (a GRPO group's first turn) are prefilled once. Entries belong to one policy
    version: a weight update makes them all stale.

    The budget: entries and the cache of the rows being sampled together stay within
    ``budget_bytes`` (default ``kvcache.default_budget_bytes()``). Entries over it are evicted
    least recently used first (those episodes prefill again), and a call whose rows do not fit
    at once is sampled in chunks of rows that do, with the random draws the whole batch would
    get (``_Noise``, or each row's own: ``row_seeds``), so the same tokens come out. A single row that does not fit alone is
    sampled anyway. Not counted: activations, and the rows' shared prefix broadcast inside
    one layer at a time.

    Logprobs equal those of a full prefill up to float rounding (the matmul shapes differ);
    the trainer re-scores every sample anyway."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget = default_budget_bytes() if budget_bytes is None else int(budget_bytes)
        self.entries: OrderedDict[str, RowCache] = OrderedDict()  # least recently used first
        self.base: RowCache | None = None  # the last call's shared prefix
        self.prefilled_tokens = 0  # prompt tokens the model prefilled
        self.reused_tokens = 0  # prompt tokens whose KV came from the cache or from a duplicate prompt
        self.evictions = 0  # entries dropped to stay within the budget
        self.chunks = 0  # generation calls (or parts of one) sampled

    def held_bytes(self) -> int:
        """Bytes of KV the entries and the shared prefixes they use hold."""
        bases = {id(b): b for b in [self.base, *(e.base for e in self.entries.values())] if b is not None}
        return sum(e.nbytes for e in self.entries.values()) + sum(b.nbytes for b in bases.values())

    def _evict(self, keep: Sequence[str] = ()) -> list[RowCache]:
        """Drop least recently used entries (not those of ``keep``) until within the budget."""
        dropped = []
        for key in [k for k in self.entries if k not in keep]:
            if self.held_bytes() <= self.budget:
                break
            dropped.append(self.entries.pop(key))
            self.evictions += 1
        if self.held_bytes() > self.budget and self.base is not None and all(e.base is not self.base for e in self.entries.values()):
            self.base = None
        return dropped

    def _shared(self, model, prompts: Sequence[Sequence[int]], matched: Sequence[tuple[RowCache, int] | None],
                version: int) -> RowCache | None:
        """The KV of the prefix all ``prompts`` share (see the class docstring), taken from a cache
        that has it or prefilled once; None when it is empty."""
        distinct = list({tuple(p): p for p in prompts}.values())
        latest = next(reversed(self.entries.values()), None)  # the row stored last
        if len(distinct) > 1:
            n = min(common_prefix(distinct[0], p) for p in distinct[1:])
        else:  # one prompt: its part shared with the last shared prefix, else with the row stored last
            last = self.base if self.base is not None else latest
            n = 0 if last is None else common_prefix(last.ids, distinct[0])
        n = min(n, min(len(p) for p in distinct) - 1)
        if n <= 0:
            return None
        ids = tuple(distinct[0][:n])
        if self.base is not None and self.base.ids == ids:
            return self.base
        have, source = 0, None
        for cand in [self.base, latest, *(m[0] for m in matched if m is not None)]:
            k = 0 if cand is None else min(common_prefix(cand.ids, ids), n)
            if k > have:
                have, source = k, cand
        if have == n:
            return source.prefix(n)  # type: ignore[union-attr]
        cache, _ = BatchKV.build(num_layers(model), None, [None if source is None else (source, have)], n)
        device = next(model.parameters()).device
        new = torch.as_tensor([ids[have:]], device=device)
        model(input_ids=new, attention_mask=torch.ones((1, n), dtype=torch.long, device=device),
              position_ids=torch.arange(have, n, device=device)[None], past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        self.prefilled_tokens += n - have
        return RowCache(ids, cache.rows([torch.arange(n, device=device)])[0], version)

    def _chunk_end(self, lo: int, prompts: Sequence[Sequence[int]], matched: Sequence[tuple[RowCache, int] | None],
                   keys: Sequence[str], shared: RowCache | None, per_token: int, max_new_tokens: int) -> int:
        """The end ``hi`` of the chunk of rows from ``lo`` that fits the budget (at least one row):
        held entries, less those the chunk's rows consume, plus the chunk's batch cache."""
        s = 0 if shared is None else len(shared.ids)
        held = self.held_bytes() + (0 if shared is None or shared is self.base else shared.nbytes)
        consumed: set[str] = set()
        width = new = 0
        hi = lo
        while hi < len(prompts):
            m = matched[hi]
            start = s if m is None else max(m[1], s)
            width, new = max(width, start - s), max(new, len(prompts[hi]) - start)
            if keys[hi] in self.entries and keys[hi] not in consumed:
                consumed.add(keys[hi])
                held -= self.entries[keys[hi]].nbytes
            if hi > lo and held + per_token * (hi + 1 - lo) * (width + new + max_new_tokens - 1) > self.budget:
                break
            hi += 1
        return hi

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, keys: Sequence[str], prompts: Sequence[Sequence[int]], version: int, *,
               max_new_tokens: int, stop_ids: Sequence[int], pad_id: int, temperature: float = 1.0,
               generator: torch.Generator | None = None, row_seeds: Sequence[int] | None = None) -> list[Generation]:
        """Sample one continuation per prompt (``keys[i]``: the episode prompt ``i`` belongs to);
        ``row_seeds``: per-row draws, as in ``sample``."""
        _check_seeds(generator, row_seeds, len(prompts))
        for key in [k for k, e in self.entries.items() if e.version != version]:
            del self.entries[key]
        if self.base is not None and self.base.version != version:
            self.base = None
        for key in keys:  # about to be used: most recent
            if key in self.entries:
                self.entries.move_to_end(key)
        matched = [self._match(k, p) for k, p in zip(keys, prompts)]
        shared = self._shared(model, prompts, matched, version)
        per_token = kv_bytes_per_token(model)
        noise = _make_noise(temperature, generator, row_seeds, len(prompts))
        gens: list[Generation] = []
        lo = steps = 0
        while lo < len(prompts):
            hi = self._chunk_end(lo, prompts, matched, keys, shared, per_token, max_new_tokens)
            if hi == lo + 1:  # one row: make room for it if it does not fit
                gone = {id(e) for e in self._evict(keep=[keys[lo]])}
                matched = [None if m is not None and id(m[0]) in gone else m for m in matched]
            consumed = [self.entries.pop(k) for k in dict.fromkeys(keys[lo:hi]) if k in self.entries]
            gone = {id(e) for e in consumed}  # released as copied: later rows of the same key prefill
            matched = matched[:hi] + [None if m is not None and id(m[0]) in gone else m for m in matched[hi:]]
            part, kept, n = _sample_rows(model, prompts[lo:hi], max_new_tokens, stop_ids, pad_id, temperature, noise,
                                         first_row=lo, shared=shared, reused=matched[lo:hi], consumed=consumed,
                                         version=version, counters=self)
            del consumed
            self.base = shared if shared is not None else self.base
            for key, row in zip(keys[lo:hi], kept):
                self.entries[key] = row
                self.entries.move_to_end(key)
            gone = {id(e) for e in self._evict()}
            matched = [None if m is not None and id(m[0]) in gone else m for m in matched]
            gens.extend(part)
            steps, lo = max(steps, n), hi
            self.chunks += 1
        if noise is not None:
            noise.finish(steps)
        return gens

    def _match(self, key: str, prompt: Sequence[int]) -> tuple[RowCache, int] | None:
        """The entry of ``key`` and how much of ``prompt`` its KV covers (at least one token is
        left to prefill: its logits), or None."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        n = min(common_prefix(entry.ids, prompt), len(prompt) - 1)
        return (entry, n) if n > 0 else None


def _sample_rows(model, prompts, max_new_tokens, stop_ids, pad_id, temperature, noise, *, first_row=0, shared=None,
                 reused=None, consumed=(), version=0, counters=None, prefills=None, vision=None
                 ) -> tuple[list[Generation], list[RowCache], int]:
    """Sample rows ``first_row ..`` of a batch (``noise``: its draws; None when greedy).

    Without ``reused`` (the plain path): every prompt is prefilled whole and the logits of
    every prompt position are computed, as before the prefix cache existed (the tiny recipes'
    figures stay bit-identical). With it (the prefix cache): every row's KV starts with
    ``shared`` and goes on with ``reused[i] = (cache, n)``, the KV of ``prompts[i][:n]``
    (``consumed``: caches released as they are copied); identical prompts are prefilled once;
    only the last position's logits are computed (as HF ``generate`` does); the rows'
    ``RowCache`` (prompt plus the sampled ids fed back) are returned. Also returns the number of
    decoding steps drawn. ``prefills``: a ``PrefillCache`` for the plain path. ``vision``: pixel
    inputs of the prompts' image blocks for the prefill (plain path only)."""
    device = next(model.parameters()).device
    cache, logits, mask, next_pos = _prefill_rows(model, device, prompts, max_new_tokens, pad_id, shared, reused, consumed,
                                                  counters, prefills, vision)
    sampled, logps, lengths, stopped, fed, steps = _decode(model, device, cache, logits, mask, next_pos, max_new_tokens,
                                                           stop_ids, pad_id, temperature, noise, first_row)
    result = []
    sampled_l, logps_l, lengths_l, stopped_l = sampled.tolist(), logps.tolist(), lengths.tolist(), stopped.tolist()
    for i in range(len(prompts)):
        n = lengths_l[i]
        result.append(Generation(tuple(sampled_l[i][:n]), tuple(logps_l[i][:n]), bool(stopped_l[i])))
    kept: list[RowCache] = []
    if reused is not None:  # each row's own KV (after the shared prefix): its prompt's positions and the fed-back ids
        s = 0 if shared is None else len(shared.ids)
        own_mask = mask[:, s:].cpu()
        fed_l = [min(n, fed) for n in lengths_l]
        columns = [torch.cat([own_mask[i].nonzero().squeeze(-1), own_mask.shape[1] + torch.arange(fed_l[i])]).to(device)
                   for i in range(len(prompts))]
        for i, layers in enumerate(cache.rows(columns)):
            kept.append(RowCache(tuple(prompts[i]) + tuple(sampled_l[i][:fed_l[i]]), layers, version, shared))
    return result, kept, steps


def _prefill_rows(model, device, prompts, max_new_tokens, pad_id, shared, reused, consumed, counters, prefills, vision):
    """The prompts' prefill (see ``_sample_rows``): ``(cache, logits [B, V] of each row's last
    prompt position, attention mask [B, prompt width], next position [B, 1])``, the cache sized
    for ``max_new_tokens`` more positions."""
    batch = len(prompts)
    cached = reused is not None
    s = 0 if shared is None else len(shared.ids)
    if cached:  # one prefill row per distinct prompt
        index: dict[tuple[int, ...], int] = {}
        inverse = [index.setdefault(tuple(p), len(index)) for p in prompts]
        rows = [inverse.index(u) for u in range(len(index))]
        reuse = [reused[i] if reused[i] is not None and reused[i][1] > s else None for i in rows]
    else:
        rows, inverse, reuse = list(range(batch)), list(range(batch)), [None] * batch
    starts = [s if x is None else x[1] for x in reuse]  # prompt tokens whose KV is there already
    width = max(n - s for n in starts)
    new_ids, new_mask = _left_pad([prompts[i][n:] for i, n in zip(rows, starts)], pad_id)
    cache, _ = BatchKV.build(num_layers(model), shared, reuse, width + new_ids.shape[1] + max_new_tokens - 1, consumed)
    past_mask = torch.zeros((len(rows), s + width), dtype=torch.long)
    past_mask[:, :s] = 1
    for r, n in enumerate(starts):
        past_mask[r, s + width - (n - s):] = 1
    mask = torch.cat([past_mask, new_mask], dim=1).to(device)
    positions = (torch.as_tensor(starts)[:, None] + new_mask.cumsum(-1) - 1).clamp(min=0).to(device)
    if counters is not None:
        counters.prefilled_tokens += int(new_mask.sum())
        counters.reused_tokens += sum(len(p) for p in prompts) - int(new_mask.sum())

    # only the last position's logits are computed (as HF generate does): the LM head over every prompt
    # position held rows x prompt x vocabulary floats (6.4 GB for 64 SmolLM2 prompts of 512 tokens)
    extra: dict = {"logits_to_keep": 1}
    if prefills is not None and not cached:
        logits, layers = prefills.prefill(model, prompts, new_ids.to(device), mask, positions)  # [rows, V]
        for layer, (k, v) in zip(cache.layers, layers):  # into the call's buffers, as the forward pass would
            layer.update(k, v)
    else:
        out = model(input_ids=new_ids.to(device), attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, **extra, **(vision or {}))
        logits = out.logits[:, -1, :].float()  # [rows, V]
        del out
    next_pos = positions[:, -1:] + 1  # [rows, 1]
    if len(rows) < batch:  # each distinct prompt's prefill, copied to its duplicates
        expand = torch.as_tensor(inverse, device=device)
        cache.batch_select_indices(expand)
        logits, mask, next_pos = logits[expand], mask[expand], next_pos[expand]
    return cache, logits, mask, next_pos


def _decode(model, device, cache, logits, mask, next_pos, max_new_tokens, stop_ids, pad_id, temperature, noise, first_row):
    """Draw up to ``max_new_tokens`` tokens per row from the prefill's ``logits`` [B, V], feeding
    each back through ``model`` (its KV into ``cache``), until every row has drawn a stop id.
    Returns ``(sampled [B, N] (pad after a row's end), logprobs [B, N], lengths [B], stopped [B],
    the tokens fed back, the steps drawn)``."""
    batch = logits.shape[0]
    stop = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    sampled = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    fed = 0  # sampled tokens fed back through the model (their KV is in the cache)
    for t in range(max_new_tokens):
        logp_full = F.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)  # [B, V]
        if noise is not None:  # torch.multinomial(probs, 1), with the batch's (or each row's) draws for these rows
            q = noise.draw_rows(t, first_row, first_row + batch, logits.shape[-1], ~done)
            tok = (logp_full.exp() / q.to(device)).argmax(-1)
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
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :].float()
        del out
        next_pos = next_pos + 1
        fed += 1
    return sampled, logps, lengths, stopped, fed, t + 1


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

    from turnforge.policy.lora import FrozenBase

    inner = model.peft_model if isinstance(model, FrozenBase) else model
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PeftModel
    return hasattr(modeling_utils, "slice_logits_to_keep") and "logits_to_keep" in inspect.signature(inner.forward).parameters


def token_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    positions: torch.Tensor | None = None,
    vision: dict[str, torch.Tensor] | None = None,
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

    ``vision``: the pixel inputs of the rows' image blocks (``Vision.inputs``; vision policies).

    The inputs may live on the CPU: the forward pass runs on the model's device (``model.device``)
    and the results come back on ``ids``' device, so a trainer's batches and losses are the same
    code on a CPU and a GPU (gradients flow through the copy).
    """
    weight = next(model.parameters(), None)  # None: a model without parameters (a test's), where the inputs are
    home = ids.device
    device = home if weight is None else weight.device
    if device != home:
        ids, attention_mask = ids.to(device), attention_mask.to(device)
        positions = positions.to(device) if positions is not None else None
        vision = {k: t.to(device) for k, t in vision.items()} if vision else vision
    v = vision or {}
    if positions is None:
        logits = model(input_ids=ids, attention_mask=attention_mask, **v).logits[:, :-1, :].float()  # [B, T-1, V]
        targets = ids[:, 1:]
        keep = None
    else:
        keep = positions[:, 1:] != 0  # [B, T-1]: token t is predicted at position t-1
        if _keeps_selected_logits(model):
            head = F.pad(keep, (0, 1), value=False)  # [B, T]
            logits = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=head, **v).logits.float()  # [N, V]
        else:
            logits = model(input_ids=ids, attention_mask=attention_mask, **v).logits[:, :-1, :][keep].float()
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
    picked, entropy = F.pad(picked, (1, 0)), (F.pad(entropy, (1, 0)) if entropy is not None else None)
    return picked.to(home), (entropy.to(home) if entropy is not None else None)
