"""The file transport of weight pushes (``turnforge.inference.weights``), in one process: a
full push loads bit for bit (tied weights written once), a LoRA run pushes only its adapter and
the replica's weights equal the merged model, old pushes are deleted, another model's push or an
adapter on the wrong base is refused; and the mismatch watch's band on hand-computed ratios."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from turnforge.config import LoraConfig
from turnforge.inference.weights import (ADAPTER_FILE, MODEL_FILE, FileWeightSync, LoadedWeights, PushError, load_push,
                                         model_fingerprint)
from turnforge.policy.lora import add_lora, merged_copy
from turnforge.policy.model import load_policy
from turnforge.train.update import out_of_band


def _fingerprint(policy) -> str:
    return model_fingerprint(policy.model, policy.tokenizer, policy.stop_ids)


def _nudge(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=g))


def test_a_full_push_loads_bit_for_bit_and_old_pushes_go(tiny_model_dir, tmp_path):
    trainer, replica = load_policy(tiny_model_dir), load_policy(tiny_model_dir)
    sync, fp = FileWeightSync(tmp_path / "weights", keep=2), _fingerprint(trainer)
    held = LoadedWeights()
    for version in range(3):
        _nudge(trainer.model, version)
        push = sync.publish(trainer.model, version, fp)
        assert (push.push, push.version, push.kind, push.base) == (version + 1, version, "full", version + 1)
        got, held = load_push(replica.model, push.path, held, fp)
        assert (got.push, held.push, held.version) == (push.push, push.push, version)
        for (name, a), b in zip(trainer.model.state_dict().items(), replica.model.state_dict().values()):
            assert torch.equal(a, b), name
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["push-2", "push-3"]  # the last two kept
    assert not (tmp_path / "weights" / "push-3" / ADAPTER_FILE).exists()


def test_tied_weights_are_written_once(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    trainer = load_policy(tiny_model_dir)
    state = trainer.model.state_dict()
    tied = [k for k in state if k != "model.embed_tokens.weight"
            and state[k].untyped_storage().data_ptr() == state["model.embed_tokens.weight"].untyped_storage().data_ptr()]
    push = FileWeightSync(tmp_path).publish(trainer.model, 0, _fingerprint(trainer))
    with safe_open(f"{push.path}/{MODEL_FILE}", "pt") as f:
        written = set(f.keys())
    assert not set(tied) & written and len(written) == len(state) - len(tied)


def test_a_lora_run_pushes_its_adapter_and_the_replica_serves_the_merged_model(tiny_model_dir, tmp_path):
    trainer, replica = load_policy(tiny_model_dir), load_policy(tiny_model_dir)
    fp = _fingerprint(trainer)
    add_lora(trainer, LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), 0, "rl")
    assert _fingerprint(trainer) == fp  # the base's names and shapes: a plain replica shares it
    sync, held = FileWeightSync(tmp_path / "w"), LoadedWeights()
    pushes = []
    for version in range(3):
        _nudge(trainer.model, 10 + version)  # moves the adapters only (the base is frozen)
        push = sync.publish(trainer.model, version, fp)
        pushes.append(push)
        _, held = load_push(replica.model, push.path, held, fp)
        merged = merged_copy(trainer.model).state_dict()
        for name, value in replica.model.state_dict().items():
            torch.testing.assert_close(value, merged[name], rtol=0, atol=1e-6, msg=name)
    assert [p.kind for p in pushes] == ["full", "adapter", "adapter"] and pushes[2].base == 1
    assert pushes[1].bytes * 20 < pushes[0].bytes  # an adapter push moves a small share of the model
    assert (tmp_path / "w" / "push-1").exists()  # the full push the adapters apply to is kept
    stale = LoadedWeights()  # a replica that never loaded push 1
    with pytest.raises(PushError, match="adapter push 3 applies to full push 1; this replica holds 0"):
        load_push(replica.model, pushes[2].path, stale, fp)
    sync.invalidate()  # e.g. a LoRA adapter merged into the base: the next push is whole
    assert sync.publish(trainer.model, 3, fp).kind == "full"


def test_a_push_of_another_model_is_refused_and_leaves_the_weights(tiny_model_dir, tmp_path):
    trainer, replica = load_policy(tiny_model_dir), load_policy(tiny_model_dir)
    before = copy.deepcopy(replica.model.state_dict())
    _nudge(trainer.model, 1)
    push = FileWeightSync(tmp_path).publish(trainer.model, 0, "0123456789abcdef")
    with pytest.raises(PushError, match="push 1 is of another model"):
        load_push(replica.model, push.path, LoadedWeights(), _fingerprint(replica))
    assert all(torch.equal(v, before[k]) for k, v in replica.model.state_dict().items())


def test_the_mismatch_band_counts_ratios_outside_0_9_to_1_1():
    ratios = torch.tensor([1.0, 0.95, 1.05, 0.89, 1.11, 0.5, 2.0, 1.0999])
    assert out_of_band(ratios.log()) == pytest.approx(4 / 8)
    assert out_of_band(torch.tensor([math.log(0.8999), math.log(1.1001), math.log(0.9001), math.log(1.0999)])) == 0.5
    assert out_of_band(torch.zeros(0)) == 0.0
