"""The rollout engine's group stream: equivalence with ``play``, per-trajectory scheduling,
bounded staleness, partial rollouts, infra-failure accounting, the rollout thread."""

from __future__ import annotations

import random
import time
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnforge.config import RolloutConfig
from turnforge.envpool import EnvResult, InlineEnvs
from turnforge.envs import make, make_batch
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine
from turnforge.rollout.groups import GroupStream

CFG = RolloutConfig(max_turns=4, max_new_tokens=3, max_context_tokens=256)
G = 2


def _group_maker(env, n_tasks=1000):
    def make_group(k):
        task = env.task("train", k % n_tasks)
        return [EpisodeRequest(task, 100 * k + g, f"g{k}", f"t{k}-{g}") for g in range(G)]
    return make_group


def _engine(policy, backend, env, eta=0, groups_per_batch=2, seed=0, lockstep=False, **kw):
    engine = RolloutEngine(backend, CFG, policy, env)
    actor = PolicyActor(policy, CFG.max_new_tokens, CFG.temperature, torch.Generator().manual_seed(seed))
    return GroupStream(engine, actor, _group_maker(env), group_size=G, groups_per_batch=groups_per_batch, eta=eta,
                       lockstep=lockstep, **kw)


def _same(a, b):
    assert [t.trajectory_id for t in a] == [t.trajectory_id for t in b]
    for x, y in zip(a, b):
        assert [tn.action_text for tn in x.turns] == [tn.action_text for tn in y.turns]
        assert x.episode_return == y.episode_return
        for sx, sy in zip(x.samples, y.samples):
            np.testing.assert_array_equal(sx.token_ids, sy.token_ids)
            np.testing.assert_array_equal(sx.loss_mask, sy.loss_mask)
            np.testing.assert_allclose(sx.logprobs, sy.logprobs, rtol=0, atol=0)


@pytest.mark.parametrize("lockstep", [True, False])
def test_group_stream_equals_play(tiny_policy, lockstep):
    """Inline envs answer at once, so every running episode acts in every round: the
    stream must then produce exactly what ``play`` produces, token for token."""
    env = make("test-echo", episode_len=3)
    stream = _engine(tiny_policy, InlineEnvs("test-echo", 4, {"episode_len": 3}), env, lockstep=lockstep)
    batch = stream.take()
    reqs = [r for k in range(2) for r in _group_maker(env)(k)]
    actor = PolicyActor(tiny_policy, CFG.max_new_tokens, CFG.temperature, torch.Generator().manual_seed(0))
    ref, stats = RolloutEngine(InlineEnvs("test-echo", 4, {"episode_len": 3}), CFG, tiny_policy, env).play(reqs, actor)
    _same(batch.trajectories, ref)
    assert batch.staleness == [0, 0, 0, 0] and batch.stats == stats


class ShuffledBackend:
    """A unit-test fake of a worker pool: each request finishes after a random number of
    ``recv`` calls (long-tailed), so results arrive out of order."""

    def __init__(self, envs, seed, fail_every=0):
        self.inline, self.num_envs = InlineEnvs.from_envs(envs), len(envs)
        self.rng, self.fail_every, self.count = random.Random(seed), fail_every, 0
        self.waiting: list[tuple[int, EnvResult]] = []
        self.sent = deque()

    def _queue(self):
        for r in self.inline.recv():
            self.count += 1
            if self.fail_every and self.count % self.fail_every == 0:
                r = EnvResult.failed(r.env_id, r.kind, "injected", 0.0)
            self.waiting.append((int(self.rng.paretovariate(1.2)), r))

    def send_reset(self, ids, seeds, tasks, probes=None, priorities=None):
        self.inline.send_reset(ids, seeds, tasks, probes)
        self._queue()

    def send_step(self, ids, texts, probes=None, priorities=None):
        self.inline.send_step(ids, texts, probes)
        self._queue()

    def recv(self, batch_size=1, timeout=None):
        while True:
            self.waiting = [(d - 1, r) for d, r in self.waiting]
            out = [r for d, r in self.waiting if d <= 0]
            self.waiting = [(d, r) for d, r in self.waiting if d > 0]
            if out or timeout is not None:
                return out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(eta=st.integers(0, 3), partial=st.booleans(), seed=st.integers(0, 10_000), fail_every=st.sampled_from([0, 7]))
def test_staleness_bound_and_accounting(tiny_policy, eta, partial, seed, fail_every):
    """Out-of-order env results, random eta: no trajectory is ever trained more than eta
    versions after its oldest token; every admitted episode comes out exactly once."""
    if partial and eta == 0:
        return
    envs = make_batch("test-echo", 8, episode_len=3)
    engine = _engine(tiny_policy, ShuffledBackend(envs, seed, fail_every), envs[0], eta=eta, partial_rollouts=partial,
                     seed=seed)
    seen: list[str] = []
    v0 = tiny_policy.version
    for step in range(5):
        batch = engine.take()
        assert len(batch.trajectories) == 2 * G
        assert all(s <= eta for s in batch.staleness), batch.staleness
        for t in batch.trajectories:
            for x in t.samples:  # per-token versions: never older than the bound
                v = x.versions[x.versions >= 0]
                assert ((v0 + step) - v <= eta).all() and (v <= v0 + step).all()
        seen += [t.trajectory_id for t in batch.trajectories]
        engine.set_weights(None, v0 + step + 1)
    assert len(seen) == len(set(seen))
    taken_groups = [int(i.split("-")[0][1:]) for i in seen[::G]]
    if not partial:  # oldest first, exactly in admission order
        assert taken_groups == sorted(taken_groups) == list(range(10))
    assert engine.admitted <= (5 + eta + 1) * 2


def test_engine_runs_ahead_up_to_eta(tiny_policy):
    """With eta=2 and slow envs the engine generates ahead: some trajectories are trained
    two versions after they started, none three."""
    envs = make_batch("test-echo", 12, episode_len=3)
    engine = _engine(tiny_policy, ShuffledBackend(envs, 5), envs[0], eta=2)
    ages = []
    for i in range(8):
        ages += engine.take().staleness
        engine.set_weights(None, tiny_policy.version + 1)
    assert max(ages) == 2


def test_infra_failures_excluded_not_lost(tiny_policy):
    envs = make_batch("test-echo", 8, episode_len=3)
    engine = _engine(tiny_policy, ShuffledBackend(envs, 1, fail_every=5), envs[0], eta=1)
    failed = ok = 0
    v0 = tiny_policy.version
    for i in range(4):
        batch = engine.take()
        failed += sum(t.infra_failure is not None for t in batch.trajectories)
        ok += sum(t.infra_failure is None for t in batch.trajectories)
        engine.set_weights(None, v0 + i + 1)
    assert failed > 0 and ok > 0
    assert failed + ok == 16
    assert engine.engine.stats.infra_failures >= failed


def test_no_generation_for_finished_envs(tiny_policy):
    """Episodes of different lengths: a generation batch never holds a finished episode."""
    envs = make_batch("test-echo", 4, episode_len=1)
    engine = _engine(tiny_policy, InlineEnvs.from_envs(envs), envs[0])
    batch = engine.take()
    assert all(t.num_turns == 1 for t in batch.trajectories)
    assert engine.engine.stats.generation_calls == 1 and engine.engine.stats.turns == 4


def test_versions_per_token_across_weight_updates(tiny_policy):
    """Partial rollouts: an episode running across a weight update carries both versions."""
    envs = make_batch("test-echo", 8, episode_len=4)
    engine = _engine(tiny_policy, ShuffledBackend(envs, 3), envs[0], eta=2, partial_rollouts=True)
    v0 = tiny_policy.version
    mixed = 0
    for i in range(6):
        batch = engine.take()
        for t in batch.trajectories:
            vs = {int(v) for x in t.samples for v in x.versions[x.versions >= 0]}
            mixed += len(vs) > 1
            assert vs <= set(range(v0, v0 + i + 1))
        engine.set_weights(None, v0 + i + 1)
    assert mixed > 0


def test_thread_mode_with_weight_sync(tiny_policy):
    """The engine as a background rollout worker with its own model copy: batches come out
    while the trainer 'trains', and a weight sync reaches the copy."""
    import copy

    envs = make_batch("test-echo", 8, episode_len=2)
    rollout_policy = copy.copy(tiny_policy)
    rollout_policy.model = copy.deepcopy(tiny_policy.model)
    engine = _engine(rollout_policy, InlineEnvs.from_envs(envs), envs[0], eta=1)
    engine.start()
    try:
        for i in range(3):
            batch = engine.take(timeout=60)
            assert len(batch.trajectories) == 4
            with torch.no_grad():
                for p in tiny_policy.model.parameters():
                    p.add_(0.01)
            engine.set_weights({k: v.clone() for k, v in tiny_policy.model.state_dict().items()}, tiny_policy.version + i + 1)
        batch = engine.take(timeout=60)
        deadline = time.time() + 30
        while rollout_policy.version != tiny_policy.version + 3 and time.time() < deadline:
            time.sleep(0.01)  # the worker applies new weights before its next generation call
    finally:
        engine.stop()
    for a, b in zip(rollout_policy.model.parameters(), tiny_policy.model.parameters()):
        torch.testing.assert_close(a, b)
    assert max(batch.staleness) <= 1


def test_thread_mode_partial_rollouts_never_stall(tiny_policy):
    """Threaded engine, partial rollouts, out-of-order env results: stale groups are
    restarted by the worker itself, so the trainer always gets its next batch."""
    import copy

    envs = make_batch("test-echo", 8, episode_len=3)
    rollout_policy = copy.copy(tiny_policy)
    rollout_policy.model = copy.deepcopy(tiny_policy.model)
    engine = _engine(rollout_policy, ShuffledBackend(envs, 11), envs[0], eta=1, partial_rollouts=True)
    engine.start()
    try:
        for i in range(6):
            batch = engine.take(timeout=60)
            assert len(batch.trajectories) == 4 and max(batch.staleness) <= 1
            engine.set_weights(None, tiny_policy.version + i + 1)
    finally:
        engine.stop()
