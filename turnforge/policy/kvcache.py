"""KV caches of the built-in sampler (``turnforge.policy.generate``), laid out to hold as little
memory as a call needs.

- ``RowCache``: the KV of one token sequence, compact (no padding): a shared ``base`` (the
  prefix common to a call's rows, e.g. the system prompt and worked examples, stored once for
  every row that starts with it) followed by the row's own keys and values.
- ``BatchKV``: the Hugging Face ``Cache`` of one generation call. The shared prefix is held
  once (``[1, kv_heads, S, head_dim]``) and broadcast to the rows only inside each layer's
  attention call (a transient of one layer); each row's own part lives in one buffer per layer
  allocated at its final size (reused prefix, new prompt tokens and ``max_new_tokens``), so
  decoding writes in place instead of concatenating a grown copy of the whole cache every step.
- ``kv_bytes_per_token`` and ``default_budget_bytes``: what the prefix cache's budget
  (``rollout.kv_cache_gib``) is counted in, and its default.

Attention sees, per layer, the same keys and values in the same positions as with
``transformers.DynamicCache`` (the prefix first, masked padding, the row's tokens, the sampled
ones), so a call without a shared prefix gives bit-identical logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import psutil
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

#: The prefix cache's budget when ``rollout.kv_cache_gib`` is not set, in GiB: measured on
#: SmolLM2-135M's 100-episode arithmetic evaluation, a 1 GiB budget sampled the same tokens in
#: the same time as an unbounded one (which grew to 1.6 GiB) with a peak RSS of 2.76 GB, not 3.19.
DEFAULT_BUDGET_GIB = 1.0
#: ... lowered to this share of the memory available at start on a small machine.
DEFAULT_BUDGET_SHARE = 0.5


def default_budget_bytes() -> int:
    """The prefix cache's budget when none is configured: ``DEFAULT_BUDGET_GIB``, or
    ``DEFAULT_BUDGET_SHARE`` of the memory available now (free plus reclaimable page cache, as
    ``psutil`` counts it) where that is less."""
    return int(min(DEFAULT_BUDGET_GIB * 2**30, DEFAULT_BUDGET_SHARE * psutil.virtual_memory().available))


def _text_config(model: torch.nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def num_layers(model: torch.nn.Module) -> int:
    """Decoder layers of ``model`` (one cache layer each)."""
    return _text_config(model).num_hidden_layers


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token adds to a cache of ``model`` (all layers), from its
    config: ``2 x layers x kv_heads x head_dim x`` the element size of its embeddings."""
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.get_input_embeddings().weight.element_size()


@dataclass(eq=False)
class RowCache:
    """The KV cache of the token sequence ``ids``, computed by the policy at ``version``:
    ``base`` holds the KV of ``ids[:len(base.ids)]`` (a prefix shared with other rows; None:
    empty), ``layers`` the rest, per model layer ``(keys, values)``, each
    ``[kv_heads, len(ids) - len(base.ids), head_dim]``."""

    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    version: int
    base: RowCache | None = None
    nbytes: int = field(init=False)  # of ``layers`` (the base is counted once, by whoever holds it)

    def __post_init__(self) -> None:
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in self.layers)

    @property
    def start(self) -> int:
        """Position of ``layers[...][0][:, 0]`` in ``ids``: the base's length."""
        return 0 if self.base is None else len(self.base.ids)

    def span(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``ids[lo:hi]`` at ``layer``, ``[kv_heads, hi - lo, head_dim]``
        (views where the span lies in one part, else a concatenation)."""
        s = self.start
        if hi <= s:
            return self.base.span(layer, lo, hi)  # type: ignore[union-attr]
        k, v = self.layers[layer]
        own = (k[:, max(lo - s, 0):hi - s], v[:, max(lo - s, 0):hi - s])
        if lo >= s:
            return own
        bk, bv = self.base.span(layer, lo, s)  # type: ignore[union-attr]
        return torch.cat([bk, own[0]], 1), torch.cat([bv, own[1]], 1)

    def prefix(self, n: int) -> RowCache:
        """A compact copy of the KV of ``ids[:n]``, with no base: a new shared prefix."""
        layers = [(k.clone(), v.clone()) for k, v in (self.span(i, 0, n) for i in range(len(self.layers)))]
        return RowCache(self.ids[:n], layers, self.version)


class _BufferLayer(CacheLayerMixin):
    """One layer of ``BatchKV``: ``shared`` (``[1, kv_heads, S, head_dim]`` or None) and the
    rows' own keys and values in ``[rows, kv_heads, capacity, head_dim]`` buffers, of which the
    first ``filled`` positions are in use."""

    is_sliding = False
    is_compileable = False

    def __init__(self, shared: tuple[torch.Tensor, torch.Tensor] | None, capacity: int,
                 own: tuple[torch.Tensor, torch.Tensor] | None, filled: int) -> None:
        super().__init__()
        self.shared, self.capacity, self.filled = shared, capacity, filled
        if own is not None:
            self.keys, self.values = own
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows, heads, q, dim = key_states.shape
        if self.keys is None:  # nothing reused: the buffers are born with the first tokens
            self.keys = key_states.new_zeros((rows, heads, self.capacity, dim))
            self.values = value_states.new_zeros((rows, heads, self.capacity, value_states.shape[-1]))
        self.keys[:, :, self.filled:self.filled + q] = key_states
        self.values[:, :, self.filled:self.filled + q] = value_states
        self.filled += q
        k, v = self.keys[:, :, :self.filled], self.values[:, :, :self.filled]
        if self.shared is None:
            return k.contiguous(), v.contiguous()
        sk, sv = self.shared
        return torch.cat([sk.expand(rows, -1, -1, -1), k], 2), torch.cat([sv.expand(rows, -1, -1, -1), v], 2)

    def prefix_length(self) -> int:
        return 0 if self.shared is None else self.shared[0].shape[2]

    def get_seq_length(self) -> int:
        return self.prefix_length() + self.filled

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys, self.values = self.keys[indices], self.values[indices]

    def release(self) -> None:
        self.keys = self.values = None


class BatchKV(Cache):
    """The cache of one generation call (see the module docstring)."""

    def __init__(self, layers: list[_BufferLayer]) -> None:
        super().__init__(layers=layers)

    @classmethod
    def build(cls, num_layers: int, shared: RowCache | None, reused: Sequence[tuple[RowCache, int] | None],
              capacity: int, consumed: Sequence[RowCache] = ()) -> tuple[BatchKV, int]:
        """The cache of rows whose KV starts with ``shared`` (its ids begin every row) and goes
        on with ``reused[r] = (cache, n)``: the KV of ``cache.ids[len(shared.ids):n]`` (None:
        nothing), left-padded with zeros to the longest; returns it and that width. Each
        layer's buffers hold ``capacity`` positions. ``consumed`` caches (which the caller
        drops) are released layer by layer as they are copied, so that the old and the new
        copies of the rows never coexist whole."""
        s = 0 if shared is None else len(shared.ids)
        spans = [None if x is None or x[1] <= s else x for x in reused]
        width = max((n - s for x in spans if x is not None for n in [x[1]]), default=0)
        layers = []
        for i in range(num_layers):
            shared_kv = None if shared is None else tuple(t.unsqueeze(0) for t in shared.span(i, 0, s))
            own = None
            if width > 0:
                parts = [None if x is None else x[0].span(i, s, x[1]) for x in spans]
                k0, v0 = next(p for p in parts if p is not None)
                k = k0.new_zeros((len(parts), k0.shape[0], capacity, k0.shape[2]))
                v = v0.new_zeros((len(parts), v0.shape[0], capacity, v0.shape[2]))
                for r, p in enumerate(parts):
                    if p is not None:
                        k[r, :, width - p[0].shape[1]:width], v[r, :, width - p[0].shape[1]:width] = p
                own = (k, v)
                for c in consumed:
                    c.layers[i] = None  # type: ignore[call-overload]
            layers.append(_BufferLayer(shared_kv, capacity, own, width))  # type: ignore[arg-type]
        return cls(layers), width

    def rows(self, columns: Sequence[torch.Tensor]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per row ``r``, its own keys and values at buffer ``columns[r]``, compact, per layer;
        extracted one layer at a time, each layer's buffers released once copied (the batch
        and the compact copies never coexist whole)."""
        out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in columns]
        for layer in self.layers:
            for r, cols in enumerate(columns):
                out[r].append((layer.keys[r].index_select(1, cols), layer.values[r].index_select(1, cols)))
            layer.release()
        return out
