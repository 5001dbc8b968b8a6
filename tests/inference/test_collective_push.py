"""Weight pushes by broadcast (``rollout.server.transport=gloo``; ``turnforge.inference.collective``)
to real ``turnforge serve`` replicas: full and LoRA pushes sample the trainer's tokens, a dead
replica leaves the group and the push reaches the others, a broadcast cut off mid-way leaves a
replica's weights marked torn (push -1) and never sampled."""

from __future__ import annotations

import copy
import os
import signal
import threading

import httpx
import pytest
import torch

from turnforge.config import LoraConfig
from turnforge.inference.client import Replica, ReplicaSpec, ServerSampler, start_replicas
from turnforge.inference.collective import CollectiveWeightSync, GroupMember, TornPush, broadcast, new_group
from turnforge.inference.weights import LoadedWeights, WeightPush, model_fingerprint, push_tensors
from turnforge.policy.lora import add_lora, merged_copy
from turnforge.policy.model import load_policy
from turnforge.rollout.actors import PolicyActor


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    """Three replicas; the second test stops one and kills another."""
    started = start_replicas(ReplicaSpec(tiny_model_dir, context=256, max_new_tokens=8, threads=1,
                                         log_dir=tmp_path_factory.mktemp("logs")), 3, timeout_s=120)
    yield started
    for r in started:
        if r.process.poll() is None:
            r.process.kill()
        r.process.wait()


def _sampler(policy, replicas, lines, timeout_s=30.0) -> ServerSampler:
    fp = model_fingerprint(policy.model, policy.tokenizer, policy.stop_ids)
    return ServerSampler([Replica(r.index, r.url) for r in replicas], CollectiveWeightSync("gloo", "127.0.0.1", timeout_s), fp,
                         timeout_s=timeout_s, min_replicas=0.2, log=lines.append)


def _prompts(policy):
    texts = ["Move to the goal.", "You are at (0, 0).", "Up", "The box is left of you. Push it right.", "Left", "Down"] * 2
    return [policy.tokenizer.encode(t) for t in texts], [f"episode-{i}" for i in range(len(texts))]


def _in_process(policy, merge: bool = False):
    """A copy of ``policy`` that samples in this process (a LoRA model merged: what a replica serves)."""
    local = copy.deepcopy(policy)
    local.sampler = None
    if merge:
        local.model = merged_copy(policy.model)
    return local


def _same_tokens(policy, local, turn) -> None:
    prompts, keys = _prompts(policy)
    got = PolicyActor(policy, 8, 1.0, None, episode_seed=3).generate(prompts, keys, turns=[turn] * len(keys))
    want = PolicyActor(local, 8, 1.0, None, episode_seed=3).generate(prompts, keys, turns=[turn] * len(keys))
    assert [g.ids for g in got] == [w.ids for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)


def test_full_then_adapter_pushes_by_broadcast_sample_the_trainers_tokens(tiny_model_dir, replicas):
    policy, lines = load_policy(tiny_model_dir), []
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.5)  # weights the replicas did not start with
    sampler = _sampler(policy, replicas, lines)
    sampler.check()
    policy.sampler = sampler
    _same_tokens(policy, _in_process(policy), 0)
    for r in replicas:
        assert httpx.get(f"{r.url}/v1/weights").json()["push"] == 1
    add_lora(policy, LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), 0, "rl")
    sampler.invalidate()  # the LoRA base is new: the next push is full, then adapters
    for version in (1, 2):
        with torch.no_grad():
            for p in policy.model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
        policy.version = version
        _same_tokens(policy, _in_process(policy, merge=True), version)
    st = sampler.stats
    assert (st.pushes, st.full_pushes, st.last_push.kind, st.last_push.path) == (3, 2, "adapter", "")
    assert st.last_push.bytes * 20 < push_tensors(policy.model, "full").bytes and lines == []
    assert sampler.sync.regroups == 0
    sampler.close()


def test_a_dead_replica_leaves_the_group_and_the_push_reaches_the_others(tiny_model_dir, replicas):
    """(It stops replica 0 and kills replica 1.)"""
    policy, lines = load_policy(tiny_model_dir), []
    sampler = _sampler(policy, replicas, lines, timeout_s=5.0)
    policy.sampler = sampler
    _same_tokens(policy, _in_process(policy), 0)  # a group of the trainer and three replicas
    os.kill(replicas[0].process.pid, signal.SIGSTOP)  # hangs: its sample request times out, it leaves the rotation
    _same_tokens(policy, _in_process(policy), 1)
    assert [r.alive for r in sampler.replicas] == [False, True, True] and len(lines) == 1
    replicas[1].process.kill()  # dies: the next push forms a group of the two left, and it cannot join
    replicas[1].process.wait()
    with torch.no_grad():
        next(policy.model.parameters()).mul_(1.1)
    policy.version = 1
    _same_tokens(policy, _in_process(policy), 2)  # the forming fails; replica 2 answers, forms one alone with the trainer
    assert [r.alive for r in sampler.replicas] == [False, False, True] and sampler.stats.replicas_lost == 2
    assert sampler.stats.regroups == 1 and sampler.stats.last_push.push == 2 and len(lines) == 2
    assert lines[1].startswith(f"inference: replica 1 ({replicas[1].url}) failed to load push 2 (version 1) over gloo "
                               "(to join the gloo group (forming the gloo group failed")
    assert "Connection refused" in lines[1] and lines[1].endswith("1 of 3 replicas left")
    assert httpx.get(f"{replicas[2].url}/v1/weights").json()["push"] == 2
    sampler.close()


def test_a_broadcast_cut_off_mid_way_leaves_torn_weights_marked_as_no_push(tiny_model_dir):
    import torch.distributed as dist
    from datetime import timedelta

    trainer, replica = load_policy(tiny_model_dir), load_policy(tiny_model_dir)
    fp = model_fingerprint(trainer.model, trainer.tokenizer, trainer.stop_ids)
    before = copy.deepcopy(replica.model.state_dict())
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    member, got = GroupMember(), {}
    carried = push_tensors(trainer.model, "full")
    push = WeightPush(1, 0, "full", 1, "", carried.bytes, 0.0, fp)
    full = [[k, list(t.shape), str(t.dtype)] for k, t in carried.full.items()]
    spec = {"group": 1, "push": push.__dict__, "full": full, "adapter": None, "scales": None,
            "plans": [[[i] for i in range(len(full))], []]}  # every tensor alone: the trainer stops after the first

    def replica_side():
        member.join({"id": 1, "host": "127.0.0.1", "port": store.port, "rank": 1, "size": 2, "backend": "gloo",
                     "timeout_s": 2.0})
        try:
            member.receive(replica.model, spec, LoadedWeights(), fp)
        except TornPush as err:
            got["error"] = err

    thread = threading.Thread(target=replica_side)
    thread.start()
    group = new_group("gloo", dist.PrefixStore("group-1", store), 0, 2, 2.0)
    with torch.no_grad():
        first = next(iter(carried.full))
        carried.full[first].add_(1.0)  # the trainer's first tensor differs from the replica's
    broadcast(group, carried.full[first], 2.0)  # then the trainer goes away
    del group
    thread.join(30)
    err = got["error"]
    assert "the gloo broadcast of push 1 failed" in str(err) and (err.held.push, err.held.version) == (-1, -1)
    assert not torch.equal(replica.model.state_dict()[first], before[first])  # torn: the first tensor came


def test_small_tensors_of_one_dtype_travel_in_buckets_and_large_ones_alone():
    from turnforge.inference.collective import BUCKET_BYTES, SMALL_BYTES, buckets

    small, large = SMALL_BYTES // 4 - 1, SMALL_BYTES // 4  # float32 elements: just under, and at, the limit
    described = [["a", [small], "torch.float32"], ["b", [3, 5], "torch.float32"], ["big", [large], "torch.float32"],
                 ["c", [7], "torch.float32"], ["h", [7], "torch.bfloat16"], ["i", [2], "torch.bfloat16"]]
    assert buckets(described) == [[0, 1], [2], [3], [4, 5]]  # a large one ends a bucket; so does another dtype
    many = [[f"t{i}", [small], "torch.float32"] for i in range(40)]  # 40 x ~1 MB: buckets of at most BUCKET_BYTES
    plan = buckets(many)
    assert [i for b in plan for i in b] == list(range(40)) and len(plan) == -(-40 // (BUCKET_BYTES // (4 * small)))
