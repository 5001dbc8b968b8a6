"""The policy update that the RL stage and the flywheel share: PPO-clip (or its decoupled form)
over ``(sample, advantage)`` pairs.

``ppo_update`` takes the policy, the pairs, the guarded optimizer step and the ``rl`` section;
the caller says what differs between stages (the temperature the samples were drawn at, the
minibatch order's generator, the KL reference, whether samples came from older policies and the
``engine`` section whose off-policy correction weighs them).
"""

from __future__ import annotations

import numpy as np
import torch

from turnforge.algos import (
    PolicyLossOutput,
    aggregation_weights,
    decoupled_ppo_loss,
    masked_mean,
    ppo_clip_loss,
)
from turnforge.algos.corrections import CORRECTIONS, ratio_stats, token_ratios
from turnforge.config import EngineConfig, RLConfig
from turnforge.dist import micro_batches, share_weighted
from turnforge.optim import GuardedStep
from turnforge.policy.generate import token_logprobs
from turnforge.policy.model import Policy
from turnforge.train.common import Batch, collate, score_samples
from turnforge.train.merge import MergedSample, merge_samples, minibatches
from turnforge.train.metrics import OffPolicyStats, UpdateStats
from turnforge.train.rehearsal import Rehearsal, rehearsal_loss
from turnforge.types import Sample


def ppo_update(
    policy: Policy,
    samples: list[tuple[Sample, float | np.ndarray]],
    step: GuardedStep,
    rl: RLConfig,
    *,
    temperature: float,
    shuffle: np.random.Generator,
    reference: torch.nn.Module | None = None,
    decoupled: bool = False,
    engine: EngineConfig | None = None,
    rehearsal: Rehearsal | None = None,
    micro_batch_tokens: int = 0,
) -> UpdateStats:
    """``rl.epochs`` passes of PPO-clip minibatch steps on ``policy`` over ``(sample, advantage)``
    pairs, each step through ``step`` (the optimizer with its NaN guard); minibatches in the order
    ``shuffle`` draws. Logprobs are scored at the sampling ``temperature``; ``reference`` (the
    frozen BC policy) adds the KL term of ``rl.kl_coef``.

    ``decoupled`` (asynchronous rollouts, vLLM's sampling, replayed samples): the trust region is
    around the proximal policy, the weights before this update, whose logprobs are recomputed
    here once; the gap to the behaviour policy (the sampling logprobs of whatever version
    sampled each token) is an off-policy weight of ``engine.correction`` under its settings
    ``engine.<name>`` (``turnforge.algos.corrections``; None: the schema's defaults, truncated IS
    capped at 2).

    ``rehearsal`` (``rl.rehearsal_coef``): each minibatch step also adds its weight times the NLL
    of ``rl.minibatch_size`` of the starting policy's cached samples (in an order ``shuffle`` draws).

    With ``rl.merge_duplicates`` repeated samples are scored once (``turnforge.train.merge``);
    minibatches still hold ``rl.minibatch_size`` sampled copies each. A minibatch over
    ``micro_batch_tokens`` padded tokens (``model.micro_batch_tokens``) runs in several passes whose
    gradients add up before the step (``turnforge.dist.micro_batches``)."""
    rows = weighted_rows(samples, rl)
    engine = EngineConfig() if engine is None else engine
    prox, offpolicy = (proximal_logprobs(policy, [r.sample for r in rows], temperature, engine) if decoupled else (None, None))
    model = policy.train_model
    model.train()
    order = shuffle.permutation(len(rows)).tolist()
    rehearsal_order = shuffle.permutation(len(rehearsal.samples)) if rehearsal is not None else None
    figures, norms, tokens = [], [], 0
    for _ in range(rl.epochs):
        for idx in minibatches(rows, order, rl.minibatch_size):
            tokens += sum(len(rows[i].sample) * rows[i].count for i in idx)
            # on several ranks each takes its share of the minibatch's rows, and a rank's share may take several
            # passes (turnforge.dist.micro_batches): each pass's loss is weighted by its share of the loss's token
            # weights, so the step is the one 1 rank takes on the whole minibatch in one pass (the logged clip
            # fraction, KL and entropy are means over tokens, so they take the share of the tokens)
            length = lambda i: len(rows[i].sample)  # noqa: E731
            passes = micro_batches(idx, lambda i: rows[i].weight * rows[i].sample.num_action_tokens, length,
                                   micro_batch_tokens)
            token_passes = micro_batches(idx, lambda i: rows[i].count * rows[i].sample.num_action_tokens, length,
                                         micro_batch_tokens)
            figure = [0.0] * 5  # this rank's figures, each pass's times its factor
            for part, tpart in zip(passes, token_passes):
                chunk = [rows[i] for i in part.rows]
                batch = collate([r.sample for r in chunk], policy.pad_id, [r.advantage for r in chunk], vision=policy.vision)
                counts = torch.tensor([r.count for r in chunk], dtype=torch.float32)
                out, entropy = minibatch_loss(policy, batch, chunk, counts, rl, temperature, reference=reference,
                                              prox=None if prox is None else [prox[i] for i in part.rows], engine=engine)
                step.backward(out.loss if part.factor == 1.0 else out.loss * part.factor)
                values = [out.loss.item(), out.clip_fraction, out.approx_kl, out.kl_ref,
                          float(masked_mean(entropy.detach(), batch.mask * counts[:, None]))]
                factors = [part.factor, tpart.factor, tpart.factor, part.factor, tpart.factor]
                figure = [acc + x * f for acc, x, f in zip(figure, values, factors)]
            if rehearsal is not None:  # the rehearsal rows split over the ranks and passes the same way, by their action tokens
                nll_figure = 0.0
                cached = rehearsal.batch(len(figures), rl.minibatch_size, rehearsal_order)
                for rpart in micro_batches(cached, lambda x: x.num_action_tokens, len, micro_batch_tokens):
                    nll = rehearsal_loss(model, rpart.rows, policy.pad_id, rehearsal.temperature)
                    step.backward(rehearsal.coef * (nll if rpart.factor == 1.0 else nll * rpart.factor))
                    nll_figure += float(nll.detach()) * rpart.factor
                figure.append(nll_figure)
            norm = step.step()
            if norm is not None:
                norms.append(norm)
            figures.append(figure)
    model.eval()
    columns = [list(col) for col in zip(*share_weighted(figures, [1.0] * len(figures)))] if figures else [[]] * (5 + (rehearsal is not None))
    losses, clip_fracs, kls, ref_kls, entropies = columns[:5]
    rehearsal_nlls = columns[5] if rehearsal is not None else []
    if rehearsal is not None:  # the logged loss is the whole objective's
        losses = [x + rehearsal.coef * nll for x, nll in zip(losses, rehearsal_nlls)]

    def mean(xs: list[float]) -> float:
        return sum(xs) / max(len(xs), 1)

    return UpdateStats(
        loss=mean(losses), clip_fraction=mean(clip_fracs), approx_kl=mean(kls), kl_ref=mean(ref_kls),
        entropy=mean(entropies), grad_norm=mean(norms), tokens=tokens,
        merged_row_fraction=len(rows) / max(len(samples), 1), offpolicy=offpolicy,
        rehearsal_nll=mean(rehearsal_nlls) if rehearsal is not None else None,
    )



def weighted_rows(samples: list[tuple[Sample, float | np.ndarray]], rl: RLConfig) -> list[MergedSample]:
    """The update's rows: each sample with its advantage and its ``rl.loss_agg`` weight (by its
    action tokens and its episode's); with ``rl.merge_duplicates`` repeated (prompt, action)
    samples are one row with a count (``turnforge.train.merge``)."""
    episode_tokens: dict[str, int] = {}
    for x, _ in samples:
        episode_tokens[x.trajectory_id] = episode_tokens.get(x.trajectory_id, 0) + x.num_action_tokens
    weights = aggregation_weights(
        rl.loss_agg,
        torch.tensor([x.num_action_tokens for x, _ in samples]),
        torch.tensor([episode_tokens[x.trajectory_id] for x, _ in samples]),
    ).tolist()
    if rl.merge_duplicates:
        return merge_samples(samples, weights)
    return [MergedSample(x, a, w, 1) for (x, a), w in zip(samples, weights)]


def minibatch_loss(policy: Policy, batch: Batch, chunk: list[MergedSample], counts: torch.Tensor, rl: RLConfig,
                   temperature: float, *, reference: torch.nn.Module | None, prox: list[torch.Tensor] | None,
                   engine: EngineConfig) -> tuple[PolicyLossOutput, torch.Tensor]:
    """PPO-clip's loss on one minibatch (the decoupled objective around ``prox``, the proximal
    logprobs of its rows, when given, weighted by ``engine.correction``) and the policy's entropies
    ``[B, T]``."""
    logprobs, entropy = token_logprobs(policy.train_model, batch.ids, batch.attention, temperature,
                                       with_entropy=True, positions=batch.mask, vision=batch.vision)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref, _ = token_logprobs(reference, batch.ids, batch.attention, temperature, positions=batch.mask,
                                    vision=batch.vision)
    ppo_kwargs = dict(
        clip_low=rl.clip_low, clip_high=rl.clip_high, ref_logprobs=ref, kl_coef=rl.kl_coef,
        weights=torch.tensor([r.weight for r in chunk], dtype=torch.float32), dual_clip=rl.dual_clip,
        kl_estimator=rl.kl_estimator, entropy=entropy, entropy_coef=rl.entropy_coef, counts=counts,
    )
    if prox is None:
        return ppo_clip_loss(logprobs, batch.old_logprobs, batch.advantages, batch.mask, **ppo_kwargs), entropy
    prox_b = torch.zeros_like(batch.old_logprobs)
    for r, row in enumerate(prox):
        prox_b[r, : len(row)] = row
    correction = CORRECTIONS[engine.correction]
    out, _ = decoupled_ppo_loss(logprobs, prox_b, batch.old_logprobs, batch.advantages, batch.mask, correction,
                                correction.settings(engine), **ppo_kwargs)
    return out, entropy


def out_of_band(log_ratio: torch.Tensor, low: float = 0.9, high: float = 1.1) -> float:
    """The share of tokens whose probability ratio ``exp(log_ratio)`` (trainer over sampler)
    lies outside ``[low, high]`` (the mismatch watch; 0 for none)."""
    if log_ratio.numel() == 0:
        return 0.0
    ratio = log_ratio.double().exp()
    return float(((ratio < low) | (ratio > high)).double().mean())


def proximal_logprobs(policy: Policy, samples: list[Sample], temperature: float,
                      engine: EngineConfig) -> tuple[list[torch.Tensor], OffPolicyStats]:
    """Logprobs of every sample under the current weights (the proximal policy of the
    decoupled loss) at the sampling ``temperature``, one ``[T]`` row per sample, plus off-policy
    diagnostics over all action tokens: the share sampled by an older version, the ratios
    ``pi_prox / pi_behav`` per token and per sequence (quantiles) and what ``engine.correction``
    makes of them (mean weight, largest raw ratio, shares out of its band and masked), and the
    rollout-vs-trainer mismatch ``|p_trainer - p_rollout|`` and ``|logp_trainer - logp_rollout|``
    on tokens the current version sampled (numerics only: the KV-cache sampler, or vLLM,
    against the trainer's forward pass)."""
    policy.model.eval()
    correction = CORRECTIONS[engine.correction]
    settings = correction.settings(engine)
    rows: list[torch.Tensor] = []
    stale, diffs, log_diffs = 0, [], []
    ratios, seq_ratios, weights, kept = [], [], [], []
    for scored in score_samples(policy.model, samples, policy.pad_id, temperature, vision=policy.vision):
        chunk, batch, lp = scored.samples, scored.batch, scored.logprobs
        ratio = token_ratios(lp, batch.old_logprobs, batch.mask)  # [B, T]
        corrected = correction.correct(ratio, batch.mask, settings)
        on = batch.mask.bool()
        ratios.append(ratio[on])
        weights.append(corrected.weights[on])
        kept.append(corrected.kept[on])
        seq_ratios.append(corrected.sequence_ratio[on.any(dim=1)])
        for i, x in enumerate(chunk):
            rows.append(lp[i, : len(x)].clone())
            acted = x.loss_mask.astype(bool)
            stale += int((x.versions[acted] < policy.version).sum())
            fresh = acted & (x.versions == policy.version)
            if fresh.any():
                trainer, rollout = lp[i, : len(x)][torch.from_numpy(fresh)], torch.from_numpy(x.logprobs[fresh])
                diffs.append((trainer.exp() - rollout.exp()).abs())
                log_diffs.append(trainer - rollout)
    w = torch.cat(weights) if weights else torch.ones(1)
    r = ratio_stats(torch.cat(ratios) if ratios else torch.ones(0), torch.cat(seq_ratios) if seq_ratios else torch.ones(0),
                    w, torch.cat(kept) if kept else torch.ones(1, dtype=torch.bool), correction.band(settings))
    d = torch.cat(diffs) if diffs else torch.zeros(1)
    signed = torch.cat(log_diffs) if log_diffs else torch.zeros(1)
    ld = signed.abs()
    n = max(int(w.numel()), 1)
    return rows, OffPolicyStats(
        offpolicy_token_fraction=stale / n, is_weight_mean=float(w.mean()), is_weight_max=max(1.0, r.ratio_max),
        is_truncated_fraction=r.token_out_of_band, logprob_mismatch_max=float(d.max()), logprob_mismatch_mean=float(d.mean()),
        log_ratio_abs_max=float(ld.max()), log_ratio_abs_mean=float(ld.mean()), ratio_out_of_band=out_of_band(signed),
        token_ratio_p1=r.token_p1, token_ratio_p50=r.token_p50, token_ratio_p99=r.token_p99,
        sequence_ratio_p1=r.sequence_p1, sequence_ratio_p50=r.sequence_p50, sequence_ratio_p99=r.sequence_p99,
        sequence_out_of_band=r.sequence_out_of_band, masked_fraction=r.masked_fraction,
    )
