"""Inference replicas as real ``turnforge serve`` processes (``turnforge.inference.client``):
with per-episode seeds they sample the tokens in-process sampling draws; each sample names the
push and version that made it; weights are pushed only when the version moves; a replica that
hangs (stopped: its request times out) or dies (connection refused) leaves the rotation with one
line and its rows go to the others; with none left the run stops with one line; a replica of
another model is refused before any work."""

from __future__ import annotations

import copy
import os
import signal

import httpx
import pytest
import torch

from turnforge.errors import RunStopped, UserError
from turnforge.inference.client import Replica, ReplicaSpec, ServerSampler, copies_weights_of, start_replicas
from turnforge.inference.weights import FileWeightSync, model_fingerprint
from turnforge.policy.model import load_policy
from turnforge.rollout.actors import PolicyActor


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    """Two replicas for the module's tests; the last test stops and kills them."""
    started = start_replicas(ReplicaSpec(tiny_model_dir, context=256, max_new_tokens=8, threads=1, prefix_cache=True,
                                         log_dir=tmp_path_factory.mktemp("logs")), 2, timeout_s=120)
    yield started
    for r in started:
        if r.process.poll() is None:
            r.process.send_signal(signal.SIGCONT)
            r.process.kill()
        r.process.wait()


def _prompts(policy) -> tuple[list[list[int]], list[str]]:
    texts = ["Move to the goal.", "You are at (0, 0).", "Up", "The box is left of you. Push it right.", "Left", "Down"]
    return [policy.tokenizer.encode(t) for t in texts], [f"episode-{i}" for i in range(len(texts))]


def _sampler(policy, replicas, tmp_path, lines, timeout_s=60.0) -> ServerSampler:
    fp = model_fingerprint(policy.model, policy.tokenizer, policy.stop_ids)
    # the replicas' addresses only: the fixture, not the sampler, owns the processes
    return ServerSampler([Replica(r.index, r.url) for r in replicas], FileWeightSync(tmp_path / "weights"), fp,
                         timeout_s=timeout_s, min_replicas=0.5, log=lines.append)


def test_replicas_sample_the_trainers_tokens_at_the_pushed_version(tiny_model_dir, replicas, tmp_path):
    policy, lines = load_policy(tiny_model_dir), []
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.5)  # weights the replicas did not start with
    policy.version = 3
    local = copy.deepcopy(policy)
    sampler = _sampler(policy, replicas, tmp_path, lines)
    sampler.check()
    policy.sampler = sampler
    prompts, keys = _prompts(policy)
    remote_actor = PolicyActor(policy, 8, 1.0, None, episode_seed=7)
    local_actor = PolicyActor(local, 8, 1.0, None, episode_seed=7)
    for turn in range(2):
        got = remote_actor.generate(prompts, keys, turns=[turn] * len(keys))
        want = local_actor.generate(prompts, keys, turns=[turn] * len(keys))
        assert [g.ids for g in got] == [w.ids for w in want]  # the discrete outputs are the golden
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
    assert sampler.stats.pushes == 1 and sampler.stats.requests == 4  # one push; each call one request per replica
    for r in replicas:
        held = httpx.get(f"{r.url}/v1/weights").json()
        assert (held["push"], held["version"], held["fingerprint"]) == (1, 3, sampler.fingerprint)
    policy.version = 4  # an update: the next call pushes again
    remote_actor.generate(prompts[:1], keys[:1], turns=[2])
    assert sampler.stats.pushes == 2 and sampler.stats.last_push.version == 4 and lines == []
    worker = copy.deepcopy(policy)  # the async rollout worker's copy: the same weights at the same version
    copies_weights_of(worker.model, policy.model)
    assert worker.sampler is sampler and "_turnforge_weights_of" not in dict(worker.model.named_modules())
    PolicyActor(worker, 8, 1.0, None, episode_seed=7).generate(prompts[:1], keys[:1], turns=[3])
    remote_actor.generate(prompts[:1], keys[:1], turns=[4])
    assert sampler.stats.pushes == 2  # no push back and forth
    stale = httpx.post(f"{replicas[0].url}/v1/generate", json={"prompts": [prompts[0]], "max_new_tokens": 2,
                                                                "temperature": 1.0, "push": 1})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_weights"
    sampler.close()


def test_a_replica_of_another_model_is_refused_in_one_line(tiny_model_dir, replicas, tmp_path):
    policy = load_policy(tiny_model_dir)
    other = model_fingerprint(policy.model, policy.tokenizer, policy.stop_ids + (5,))  # e.g. another stop token
    sampler = ServerSampler([Replica(r.index, r.url) for r in replicas], FileWeightSync(tmp_path), other, timeout_s=30,
                            min_replicas=0.5)
    with pytest.raises(UserError, match=r"^inference replica 0 \(http://127.0.0.1:\d+\) serves another model or "
                                        r"tokenizer \(fingerprint \w+, the trainer's \w+\); serve the run's model"):
        sampler.check()
    sampler.close()


def test_a_hung_or_dead_replica_leaves_the_rotation_and_none_left_stops_the_run(tiny_model_dir, replicas, tmp_path):
    """(Last in the module: it stops one replica and kills the other.)"""
    policy, lines = load_policy(tiny_model_dir), []
    local = copy.deepcopy(policy)
    sampler = _sampler(policy, replicas, tmp_path, lines, timeout_s=3.0)
    policy.sampler = sampler
    prompts, keys = _prompts(policy)
    actor, local_actor = PolicyActor(policy, 8, 1.0, None, episode_seed=1), PolicyActor(local, 8, 1.0, None, episode_seed=1)
    actor.generate(prompts, keys, turns=[0] * 6)  # both serve push 1
    os.kill(replicas[1].process.pid, signal.SIGSTOP)  # hangs: its request times out
    got = actor.generate(prompts, keys, turns=[1] * 6)
    assert [g.ids for g in got] == [w.ids for w in local_actor.generate(prompts, keys, turns=[1] * 6)]  # every row, whole
    assert sampler.stats.replicas_lost == 1 and sampler.stats.retried_rows > 0 and [r.alive for r in sampler.replicas] == [True, False]
    assert len(lines) == 1 and lines[0].startswith(f"inference: replica 1 ({replicas[1].url}) failed to sample")
    assert "no answer within rollout.server.timeout_s=3 s" in lines[0] and lines[0].endswith("1 of 2 replicas left")
    replicas[0].process.kill()  # dies: connection refused
    replicas[0].process.wait()
    with pytest.raises(RunStopped, match=r"^0 of 2 inference replicas left, below rollout.server.min_replicas=0.5 "
                                         r"\(the last: replica 0 .* failed to sample"):
        actor.generate(prompts, keys, turns=[2] * 6)
    sampler.close()
