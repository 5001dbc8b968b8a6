"""Rehearsal toward the policy RL starts from (``rl.rehearsal_coef``).

Before the first update the starting policy plays ``rl.rehearsal_episodes`` train episodes at
``rl.rehearsal_temperature`` (its competent temperature: a zero-shot instruct model's skills
live near greedy decoding); their well-formed samples are the cache (a turn's sample when its
action was valid; with ``full_history`` contexts, an episode's sample when every action was).
Every minibatch step of the RL update then adds ``rl.rehearsal_coef`` times the mean negative
log-likelihood of the next cached samples' action tokens, scored at that temperature.

That term is the forward KL from the starting policy, KL(pi_0 || pi), up to pi_0's entropy
(a constant): E_{a ~ pi_0}[log pi_0(a) - log pi(a)]. Where this departs from the plain KL: the
expectation is over the starting policy's *well-formed* samples only (invalid actions are
left out, so rehearsal never pulls toward a format slip), and over a cache
sampled once, not fresh samples each step.

The cache is written to ``RUN/rehearsal.parquet`` (token-exact: ids, masks, sampling logprobs,
versions) when it is played, and read back on resume, so a resumed run rehearses the same
samples in the same order as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from turnforge.algos import sft_loss
from turnforge.dist import broadcast
from turnforge.errors import RunStopped
from turnforge.policy.generate import token_logprobs
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.seeding import generator, rng, stable_hash
from turnforge.train.common import collate
from turnforge.train.run_dir.failures import check_trajectories
from turnforge.train.session import Session
from turnforge.types import Sample, Trajectory


@dataclass
class Rehearsal:
    """The cache and how the update uses it."""

    samples: list[Sample]
    coef: float
    temperature: float
    episodes: int  # episodes with a well-formed sample
    played: int  # episodes the starting policy played (infrastructure failures excluded)
    env_steps: int  # turns of those episodes (counted in the run's env steps once)

    def batch(self, step: int, size: int, order: np.ndarray) -> list[Sample]:
        """The ``size`` cached samples of minibatch step ``step`` (the cache in ``order``, cycled)."""
        n = len(self.samples)
        return [self.samples[int(order[(step * size + i) % n])] for i in range(min(size, n))]


def rehearsal_loss(model: torch.nn.Module, samples: list[Sample], pad_id: int, temperature: float) -> torch.Tensor:
    """Mean negative log-likelihood of the samples' action tokens at ``temperature`` (token mean)."""
    batch = collate(samples, pad_id)
    logprobs, _ = token_logprobs(model, batch.ids, batch.attention, temperature, positions=batch.mask)
    return sft_loss(logprobs, batch.mask)


def load_or_play(s: Session) -> Rehearsal:
    """The run's rehearsal cache: read from ``RUN/rehearsal.parquet``, or played now by the
    policy as it is (call before the first update) and written there."""
    cfg, rl = s.cfg, s.cfg.rl
    temperature = rl.rehearsal_temperature or cfg.rollout.temperature
    path = s.run.rehearsal
    if broadcast(path.exists()):  # rank 0's answer: on several ranks it alone writes the cache
        samples, meta = read_cache(path)
        return Rehearsal(samples, rl.rehearsal_coef, temperature, **meta)
    ids = rng(cfg.seed, "rehearsal-tasks").integers(0, 2**31 - 1, rl.rehearsal_episodes)
    requests = [EpisodeRequest(s.env.task("train", int(t)), stable_hash(cfg.seed, "rehearsal", i), f"rh-{i}", f"rh-{i}")
                for i, t in enumerate(ids)]
    actor = PolicyActor(s.policy, cfg.rollout.max_new_tokens, temperature, generator(cfg.seed, "rehearsal", 0),
                        prefills=s.prefills(), episode_seed=cfg.episode_seed("rehearsal"))
    with s.progress.activity("rehearsal cache: the starting policy plays", len(requests), "episodes"):
        trajs, stats = s.rollout_engine.play(requests, actor)
    check_trajectories("rehearsal cache", s.env.env_id, trajs, cfg.max_failure_share, kind="starting-policy episodes")
    ok = [t for t in trajs if t.infra_failure is None]
    samples = [x for t in ok for x in t.samples if well_formed(t, x)]
    kept = {x.trajectory_id for x in samples}
    if not samples:
        raise RunStopped(f"rehearsal cache: no action of the starting policy's {len(ok)} episodes at temperature "
                         f"{temperature:g} was well formed (valid); lower rl.rehearsal_temperature or set rl.rehearsal_coef=0")
    out = Rehearsal(samples, rl.rehearsal_coef, temperature, len(kept), len(ok), stats.turns)
    s.run.write(path, partial(write_cache, r=out))
    s.progress.message(f"rehearsal cache: {len(samples)} well-formed samples from {len(kept)} of the starting policy's "
                       f"{len(ok)} episodes at T={temperature:g}")
    return out


def well_formed(t: Trajectory, x: Sample) -> bool:
    """A sample of one turn (``rollout.context=window``): that turn's action was valid; a sample
    of the whole episode (``full_history``): every action was."""
    return not t.turns[x.turn_index].invalid_action if x.turn_index >= 0 else t.num_invalid == 0


def write_cache(path: Path, r: Rehearsal) -> None:
    table = pa.table({
        "token_ids": [x.token_ids.tolist() for x in r.samples],
        "loss_mask": [x.loss_mask.tolist() for x in r.samples],
        "logprobs": [x.logprobs.tolist() for x in r.samples],
        "versions": [x.versions.tolist() for x in r.samples],
        "trajectory_id": [x.trajectory_id for x in r.samples],
        "turn_index": [x.turn_index for x in r.samples],
    }).replace_schema_metadata({"episodes": str(r.episodes), "played": str(r.played), "env_steps": str(r.env_steps)})
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def read_cache(path: Path) -> tuple[list[Sample], dict[str, int]]:
    table = pq.read_table(path)
    meta = {k.decode(): int(v) for k, v in (table.schema.metadata or {}).items()}
    rows = table.to_pylist()
    samples = [Sample(np.asarray(r["token_ids"], np.int64), np.asarray(r["loss_mask"], np.int8),
                      np.asarray(r["logprobs"], np.float32), np.asarray(r["versions"], np.int32),
                      r["trajectory_id"], int(r["turn_index"])) for r in rows]
    return samples, {k: meta[k] for k in ("episodes", "played", "env_steps")}
