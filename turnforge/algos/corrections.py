"""Off-policy corrections of the decoupled objective (``engine.correction``): one class each, in one
registry, ``CORRECTIONS``.

The decoupled loss (``turnforge.algos.losses.decoupled_ppo_loss``) scales each action token's
advantage by an off-policy weight. A correction computes those weights from each token's ratio
``pi_prox / pi_behav``: the trainer's weights before the update, scored by the trainer, over the
policy that sampled the token (an older version with ``engine.mode=async``, another engine's
numerics with vLLM or inference replicas). ``correct(ratio, mask, settings)`` is pure: ratios
``[B, T]`` (1 off the mask) in, ``Corrected`` out (weights ``[B, T]``, the action tokens that keep
a gradient, and the ratios' distribution, ``RatioStats``). A weight of 0 takes the token's
policy-gradient term away; the token still counts in the loss's aggregation denominator and in
its KL and entropy terms (as TRL's masks and IcePop do).

A *sequence* is one row: one training sample's action tokens (a turn's action, or every action of
a full-history sample). Its ratio is the geometric mean of its tokens' ratios,
``exp(mean log ratio)``, not their product: the product of a long sequence leaves any band by
accumulation alone (TRL's ``sequence_mask`` caps the product at 3.0), the geometric mean keeps one
band meaningful at every length (GSPO's sequence ratio).

Each class owns its settings, the config section ``engine.<name>`` (``engine.tis.cap``), which the
config schema (``turnforge.config``) generates from ``Settings``, so ``turnforge keys`` lists them
and a typo is an unknown key. Adding a correction is one class here, registered in
``CORRECTIONS``, plus its hand-computed test (``tests/algos/test_corrections.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field, model_validator

from turnforge.settings import Section


@dataclass(frozen=True)
class RatioStats:
    """The ratios ``pi_prox / pi_behav`` of a batch's action tokens and sequences, and what a
    correction made of them."""

    weight_mean: float  # mean off-policy weight over action tokens
    ratio_max: float  # largest token ratio (1.0 without action tokens)
    token_out_of_band: float  # share of action tokens whose ratio leaves the correction's band
    sequence_out_of_band: float  # share of sequences (rows with action tokens) whose ratio leaves it
    masked_fraction: float  # share of action tokens given weight 0 (no policy gradient)
    token_p1: float  # quantiles of the token ratios (1.0 without action tokens)
    token_p50: float
    token_p99: float
    sequence_p1: float  # quantiles of the sequence ratios (geometric means)
    sequence_p50: float
    sequence_p99: float


def token_ratios(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``pi_prox / pi_behav`` per token ``[B, T]``, 1 off the mask; no gradient."""
    if prox_logprobs.shape != behav_logprobs.shape or prox_logprobs.shape != mask.shape:
        raise ValueError(
            f"token_ratios: prox_logprobs {tuple(prox_logprobs.shape)}, behav_logprobs "
            f"{tuple(behav_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape"
        )
    with torch.no_grad():
        return torch.where(mask.bool(), torch.exp(prox_logprobs - behav_logprobs), torch.ones_like(prox_logprobs))


def sequence_ratios(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's ratio ``[B]``: the geometric mean of its action tokens' ratios,
    ``exp(sum(mask * log ratio) / sum(mask))``, computed in float64; 1 for a row without action
    tokens."""
    m = mask.to(torch.float64)
    log_ratio = torch.where(mask.bool(), ratio.to(torch.float64).log(), torch.zeros_like(m))
    return torch.exp((log_ratio * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)).to(ratio.dtype)


def _quantiles(x: torch.Tensor) -> tuple[float, float, float]:
    if x.numel() == 0:
        return 1.0, 1.0, 1.0
    q = np.quantile(x.detach().double().cpu().numpy(), [0.01, 0.5, 0.99])
    return float(q[0]), float(q[1]), float(q[2])


def ratio_stats(token_ratio: torch.Tensor, sequence_ratio: torch.Tensor, weights: torch.Tensor,
                kept: torch.Tensor, band: tuple[float, float]) -> RatioStats:
    """``RatioStats`` of flat tensors: the action tokens' ratios, weights and kept flags (``[N]``
    each) and the sequences' ratios (``[S]``); ``band = (lo, hi)``, outside it means ``< lo`` or
    ``> hi``. Quantiles are numpy's (linear interpolation)."""
    lo, hi = band
    n, s = token_ratio.numel(), sequence_ratio.numel()
    tp, sp = _quantiles(token_ratio), _quantiles(sequence_ratio)
    return RatioStats(
        weight_mean=float(weights.mean()) if n else 1.0,
        ratio_max=float(token_ratio.max()) if n else 1.0,
        token_out_of_band=int(((token_ratio < lo) | (token_ratio > hi)).sum()) / max(n, 1),
        sequence_out_of_band=int(((sequence_ratio < lo) | (sequence_ratio > hi)).sum()) / max(s, 1),
        masked_fraction=int((~kept.bool()).sum()) / max(n, 1),
        token_p1=tp[0], token_p50=tp[1], token_p99=tp[2],
        sequence_p1=sp[0], sequence_p50=sp[1], sequence_p99=sp[2],
    )


@dataclass(frozen=True)
class Corrected:
    """What a correction made of one batch's ratios."""

    weights: torch.Tensor  # [B, T] off-policy weight per action token (off the mask: no meaning, the loss masks it); no gradient
    kept: torch.Tensor  # [B, T] bool: the action tokens that keep their policy gradient (not masked)
    sequence_ratio: torch.Tensor  # [B] each row's ratio (geometric mean over its action tokens)
    band: tuple[float, float]  # the correction's band (lo, hi)

    def stats(self, ratio: torch.Tensor, mask: torch.Tensor) -> RatioStats:
        """``RatioStats`` of this batch (``ratio``, ``mask``: what ``correct`` took)."""
        on, rows = mask.bool(), mask.bool().any(dim=1)
        return ratio_stats(ratio[on], self.sequence_ratio[rows], self.weights[on], self.kept[on], self.band)


class Correction:
    """One off-policy correction. Subclasses set the class attributes and ``weights``."""

    name: ClassVar[str]
    help: ClassVar[str]  # a few words for the config key's description
    Settings: ClassVar[type[Section] | None] = None  # its own keys, the config section engine.<name>

    def settings(self, engine: Any) -> Any:
        """Its settings in the run's ``engine`` section (``engine.<name>``); None without any."""
        return getattr(engine, self.name) if self.Settings is not None else None

    def band(self, settings: Any) -> tuple[float, float]:
        """The ratios ``(lo, hi)`` it leaves alone: a ratio outside is cut or masked."""
        raise NotImplementedError

    def weights(self, ratio: torch.Tensor, mask: torch.Tensor, sequence_ratio: torch.Tensor,
                settings: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [B, T], kept [B, T] bool)`` from the token ratios ``[B, T]`` (1 off the mask)
        and the rows' ratios ``[B]``."""
        raise NotImplementedError

    def correct(self, ratio: torch.Tensor, mask: torch.Tensor, settings: Any = None) -> Corrected:
        """The weights of ``ratio`` ``[B, T]`` (``pi_prox / pi_behav``, 1 off ``mask``) under
        ``settings`` (None: the defaults of ``Settings``)."""
        if ratio.shape != mask.shape or ratio.ndim != 2:
            raise ValueError(f"{self.name}: ratio {tuple(ratio.shape)} and mask {tuple(mask.shape)} must be one [B, T] shape")
        if settings is None and self.Settings is not None:
            settings = self.Settings()
        with torch.no_grad():
            seq = sequence_ratios(ratio, mask)
            w, kept = self.weights(ratio, mask, seq, settings)
        return Corrected(w, kept, seq, self.band(settings))


class TISSettings(Section):
    cap: float | None = Field(
        2.0, gt=0, description="Truncated importance sampling cap C on pi_prox / pi_behav (None = untruncated)")


class TruncatedIS(Correction):
    """Truncated importance sampling per token, ``w = min(ratio, cap)`` (untruncated with
    ``cap=None``); every token keeps its gradient."""

    name, help = "tis", "token-level truncated importance weight min(ratio, engine.tis.cap)"
    Settings = TISSettings

    def band(self, settings):
        return 0.0, math.inf if settings.cap is None else settings.cap

    def weights(self, ratio, mask, sequence_ratio, settings):
        w = ratio if settings.cap is None else torch.clamp(ratio, max=settings.cap)
        return w, mask.bool()


class _Band(Section):
    """A band [lo, hi] of ratios; outside it a token or sequence is masked."""

    lo: float
    hi: float

    @model_validator(mode="after")
    def _ordered(self) -> _Band:
        if not self.lo < self.hi:
            raise ValueError(f"lo={self.lo:g} must be below hi={self.hi:g}")
        return self


class SequenceMaskSettings(_Band):
    lo: float = Field(0.5, gt=0, description="Lowest sequence ratio kept (the geometric mean of its tokens' pi_prox / pi_behav)")
    hi: float = Field(2.0, gt=0, description="Highest sequence ratio kept (the geometric mean of its tokens' pi_prox / pi_behav)")


class SequenceMask(Correction):
    """A row whose sequence ratio (geometric mean) leaves ``[lo, hi]`` gets weight 0 on every
    action token; the others get their sequence ratio on every action token (a sequence-level
    importance weight, bounded by the band)."""

    name, help = "sequence_mask", "rows whose geometric-mean ratio leaves [engine.sequence_mask.lo, hi] get weight 0"
    Settings = SequenceMaskSettings

    def band(self, settings):
        return settings.lo, settings.hi

    def weights(self, ratio, mask, sequence_ratio, settings):
        inside = (sequence_ratio >= settings.lo) & (sequence_ratio <= settings.hi)  # [B]
        on = mask.bool()
        kept = on & inside[:, None]
        w = torch.where(kept, sequence_ratio[:, None].expand_as(ratio), torch.zeros_like(ratio))
        return torch.where(on, w, torch.ones_like(ratio)), kept


class TokenMaskSettings(_Band):
    lo: float = Field(0.5, gt=0, description="Lowest token ratio pi_prox / pi_behav kept")
    hi: float = Field(2.0, gt=0, description="Highest token ratio pi_prox / pi_behav kept")


class TokenMask(Correction):
    """Two-sided token masking (IcePop): a token whose ratio leaves ``[lo, hi]`` gets weight 0, the
    others keep their ratio as the weight (bounded by the band)."""

    name, help = "token_mask", "tokens whose ratio leaves [engine.token_mask.lo, hi] get weight 0"
    Settings = TokenMaskSettings

    def band(self, settings):
        return settings.lo, settings.hi

    def weights(self, ratio, mask, sequence_ratio, settings):
        on = mask.bool()
        kept = on & (ratio >= settings.lo) & (ratio <= settings.hi)
        return torch.where(on & ~kept, torch.zeros_like(ratio), ratio), kept


#: Every correction by its ``engine.correction`` name, in the order the config lists them.
CORRECTIONS: dict[str, Correction] = {cls.name: cls() for cls in (TruncatedIS, SequenceMask, TokenMask)}


__all__ = ["CORRECTIONS", "Corrected", "Correction", "RatioStats", "SequenceMask", "TokenMask", "TruncatedIS",
           "ratio_stats", "sequence_ratios", "token_ratios"]
