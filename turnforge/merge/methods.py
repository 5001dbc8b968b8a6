"""Merge methods: pure functions from the parents' tensors (and the base's) to one tensor.

Each method merges one parameter at a time; ``merge_tensor`` dispatches. Every computation is in
float32 (the caller casts back to the checkpoint's dtype). Notation: parents ``x_i`` with weights
``w_i``, the base (the model they were all trained from) ``b``, task vectors ``d_i = x_i - b``.

- ``linear``: ``sum_i w_i x_i``, weights summing to 1 (a model soup; ``--toward init`` is linear
  between a checkpoint and its base, WARP's LITI).
- ``slerp``: two parents, ``t = w_2``; spherical interpolation of the flattened tensors (WARP),
  linear where they are (anti)parallel. Departs from WARP, which slerps task vectors: like
  mergekit, it slerps the weights themselves, so it needs no base.
- ``task_arithmetic``: ``b + sum_i w_i d_i`` (Ilharco et al. 2023; ``w_i`` are scales, not a
  convex combination).
- ``ties``: each ``w_i d_i`` trimmed to its ``density`` share of largest magnitudes, a sign elected
  per element by the summed trimmed mass (where the masses cancel exactly, the tensor's majority
  sign, as the paper's code resolves zero signs), then the mean of the kept values that agree
  with it (Yadav et al. 2023, TIES-Merging; the merged vector is added at scale 1, the paper's
  lambda = 1). Departs from the paper's code, which trims each task vector over the whole model at
  once: like mergekit, it trims each parameter tensor on its own, so every tensor keeps its share.
  TIES and DARE assume sparse, redundant task vectors (fine-tunes of one pretrained base, most of
  whose deltas are small): trimming a dense one (a model trained from a random init, whose
  "task vector" is everything it learned) sends most of each tensor back to its init values.
- ``dare``: each ``d_i`` keeps every element with probability ``density`` and is rescaled by
  ``1 / density`` (Yu et al. 2024, DARE), then ``b + sum_i w_i d_i``; the drop masks come from a
  seeded generator, one stream per parameter name, so a merge repeats exactly.
- ``ram``: per element, the mean of the non-zero deltas (``|d_i| > eps``) over the parents that
  changed it: a delta only one parent made is kept whole, shared ones are averaged
  (Reinforced Agent Merging, arXiv 2601.13572: on-policy RL task vectors are sparse, and
  averaging dilutes what only one specialist learned). RAM+'s rescaling of unique parts is not
  implemented.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

METHODS: tuple[str, ...] = ("linear", "slerp", "task_arithmetic", "ties", "dare", "ram")
#: Methods that merge task vectors, so need ``--base``.
NEEDS_BASE: tuple[str, ...] = ("task_arithmetic", "ties", "dare", "ram")


@dataclass(frozen=True)
class MergeSpec:
    """What to merge and how (checked by ``check_spec`` before any weight is read)."""

    method: str
    weights: tuple[float, ...]  # one per parent (slerp: (1 - t, t))
    density: float = 0.2  # ties / dare: the share of each task vector's elements kept
    eps: float = 0.0  # ram: |delta| above this counts as a change
    seed: int = 0  # dare: the drop masks' seed


def default_weights(method: str, n: int) -> tuple[float, ...]:
    """Equal weights summing to 1 for ``linear`` and ``slerp`` (``t = 0.5``), 1.0 each (every
    task vector added whole) for the task-vector methods."""
    return tuple([1.0 / n] * n) if method in ("linear", "slerp") else tuple([1.0] * n)


def check_spec(spec: MergeSpec, parents: int, has_base: bool) -> str | None:
    """None when ``spec`` can merge ``parents`` checkpoints (with a base or not); else one line
    naming the problem and the fix."""
    if spec.method not in METHODS:
        return f"unknown merge method {spec.method!r}; valid methods: {', '.join(METHODS)}"
    if parents < 2:
        return f"--method {spec.method} needs at least 2 checkpoints, got {parents}"
    if spec.method == "slerp" and parents != 2:
        return f"--method slerp interpolates exactly 2 checkpoints, got {parents}; use linear for more"
    if spec.method in NEEDS_BASE and not has_base:
        return f"--method {spec.method} merges task vectors (checkpoint - base): give --base INIT, the model the checkpoints were trained from"
    if len(spec.weights) != parents:
        return f"--weights has {len(spec.weights)} values for {parents} checkpoints; give one per checkpoint"
    if not all(math.isfinite(w) for w in spec.weights):
        return f"--weights {list(spec.weights)} must be finite numbers"
    if spec.method in ("linear", "slerp"):
        if any(w < 0 for w in spec.weights) or abs(sum(spec.weights) - 1.0) > 1e-6:
            return (f"--method {spec.method} needs non-negative weights that sum to 1, got {list(spec.weights)} "
                    f"(sum {sum(spec.weights):g})")
    if spec.method in ("ties", "dare") and not 0.0 < spec.density <= 1.0:
        return f"--density {spec.density:g} is outside (0, 1]: the share of each task vector kept"
    if spec.eps < 0:
        return f"--eps {spec.eps:g} must be >= 0"
    return None


def linear(xs: Sequence[torch.Tensor], w: Sequence[float]) -> torch.Tensor:
    return sum(wi * xi for wi, xi in zip(w, xs))  # type: ignore[return-value]


def slerp(a: torch.Tensor, b: torch.Tensor, t: float, eps: float = 1e-8) -> torch.Tensor:
    """Spherical interpolation of ``a`` and ``b`` seen as vectors (lengths interpolated with the
    angle, as WARP and mergekit do); linear where the angle is ~0 or ~pi, or a vector is 0."""
    fa, fb = a.flatten(), b.flatten()
    na, nb = fa.norm(), fb.norm()
    if na < eps or nb < eps:
        return (1 - t) * a + t * b
    cos = torch.clamp(torch.dot(fa / na, fb / nb), -1.0, 1.0)
    omega = torch.arccos(cos)
    s = torch.sin(omega)
    if s.abs() < 1e-6:
        return (1 - t) * a + t * b
    return (torch.sin((1 - t) * omega) / s) * a + (torch.sin(t * omega) / s) * b


def trim(d: torch.Tensor, density: float) -> torch.Tensor:
    """``d`` with all but its ``density`` share of largest-magnitude elements set to 0 (ties at
    the threshold kept)."""
    if density >= 1.0 or d.numel() == 0:
        return d
    k = max(1, int(math.ceil(density * d.numel())))
    threshold = d.abs().flatten().kthvalue(d.numel() - k + 1).values
    return torch.where(d.abs() >= threshold, d, torch.zeros_like(d))


def ties(ds: Sequence[torch.Tensor], w: Sequence[float], density: float) -> torch.Tensor:
    """The TIES-merged task vector: trim, elect signs by summed mass, disjoint mean."""
    trimmed = torch.stack([trim(wi * d, density) for wi, d in zip(w, ds)])
    sign = torch.sign(trimmed.sum(0))
    sign = torch.where(sign == 0, torch.sign(sign.sum()), sign)  # cancelled masses: the majority sign
    agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
    count = agree.sum(0)
    total = torch.where(agree, trimmed, torch.zeros_like(trimmed)).sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def drop_generator(seed: int, name: str, parent: int) -> torch.Generator:
    """The drop-mask stream of one parent's parameter: the same for a seed whatever order
    parameters are merged in."""
    digest = hashlib.sha256(f"{seed}:{parent}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def dare(d: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """``d`` with each element kept with probability ``density`` and the kept ones scaled by
    ``1 / density`` (the expected delta is unchanged)."""
    if density >= 1.0:
        return d
    keep = torch.rand(d.shape, generator=gen) < density
    return torch.where(keep, d / density, torch.zeros_like(d))


def ram(ds: Sequence[torch.Tensor], eps: float) -> torch.Tensor:
    """Per element, the mean of the deltas that changed it (``|d| > eps``), 0 where none did."""
    stacked = torch.stack(list(ds))
    changed = stacked.abs() > eps
    count = changed.sum(0)
    total = torch.where(changed, stacked, torch.zeros_like(stacked)).sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def merge_tensor(spec: MergeSpec, name: str, xs: Sequence[torch.Tensor], base: torch.Tensor | None) -> torch.Tensor:
    """One merged parameter (float32) from the parents' ``xs`` (and the ``base``'s)."""
    xs = [x.float() for x in xs]
    if spec.method == "linear":
        return linear(xs, spec.weights)
    if spec.method == "slerp":
        return slerp(xs[0], xs[1], spec.weights[1])
    assert base is not None, f"--method {spec.method} needs the base"
    b = base.float()
    ds = [x - b for x in xs]
    if spec.method == "task_arithmetic":
        return b + linear(ds, spec.weights)
    if spec.method == "ties":
        return b + ties(ds, spec.weights, spec.density)
    if spec.method == "dare":
        return b + linear([dare(d, spec.density, drop_generator(spec.seed, name, i)) for i, d in enumerate(ds)], spec.weights)
    if spec.method == "ram":
        return b + ram([wi * d for wi, d in zip(spec.weights, ds)], spec.eps)
    raise ValueError(f"unknown merge method {spec.method!r}")


@dataclass(frozen=True)
class Sparsity:
    """How sparse one parent's task vector is (``|d| > eps`` counts as changed)."""

    parent: str
    params: int  # elements compared
    changed: dict[str, float]  # eps (as text) -> the share of elements changed
    shared: float  # of its elements changed at eps = 0, the share another parent changed too
    norm: float  # the task vector's L2 norm


SPARSITY_EPS: tuple[float, ...] = (0.0, 1e-6, 1e-4)
