"""``model.thinking`` under LoRA: the added markers' embedding rows train beside the adapter
(peft's trainable tokens), sampling runs on them merged into the weights (the same logits as the
training path, re-merged after every update), the frozen base keeps the rows it started with,
and checkpoints, merges and weight pushes carry them."""

from __future__ import annotations

import os

import pytest
import torch

from turnforge.app.config import load_config
from turnforge.app.rules import check_run
from turnforge.config import LoraConfig
from turnforge.envs.registry import make
from turnforge.errors import UserError
from turnforge.inference.weights import FileWeightSync, LoadedWeights, load_push, model_fingerprint
from turnforge.policy.lora import ADAPTER_DIR, FrozenBase, add_lora, merged_copy, thinking_rows
from turnforge.policy.model import load_policy
from turnforge.policy.tiny import cached_thinking
from turnforge.types import THINKING_MARKERS


def _thinking_ids(policy, n: int = 12) -> torch.Tensor:
    """A sequence that holds both markers (as a thought would)."""
    tok = policy.tokenizer
    open_id, close_id = tok.convert_tokens_to_ids(list(THINKING_MARKERS[0]))
    return torch.tensor([[5, open_id, 9, 13, 7, close_id, 3, 11, open_id, 2, close_id, 4][:n]])


def _logits(model, ids, grad: bool = False) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return model(input_ids=ids).logits.detach()


def _train_step(policy, ids, lr: float = 0.05) -> None:
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    logits = policy.model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_the_markers_rows_train_and_sampling_sees_them_merged(tiny_thinking_dir, tmp_path):
    policy = load_policy(tiny_thinking_dir)
    ids = _thinking_ids(policy)
    before = _logits(policy.model, ids)
    rows = thinking_rows(policy)
    assert rows == [len(policy.tokenizer) - 2, len(policy.tokenizer) - 1]
    original = policy.model.get_input_embeddings().weight[rows].detach().clone()
    add_lora(policy, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), 0, "bc", tokens=rows)
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert any("trainable_tokens_delta" in n for n in trained) and any("lora_A" in n for n in trained)
    assert torch.equal(_logits(policy.model, ids), before)  # a fresh adapter and rows at their values
    for _ in range(3):
        _train_step(policy, ids)
        # no gradient (sampling, scoring) runs on the rows merged in: the same logits as the training path
        torch.testing.assert_close(_logits(policy.model, ids), _logits(policy.model, ids, grad=True), rtol=0, atol=1e-6)
    delta = dict(policy.model.named_parameters())
    moved = next(v for n, v in delta.items() if "trainable_tokens_delta" in n).detach()
    assert not torch.allclose(moved, original)  # the rows trained
    # the frozen base (the KL reference) has the rows it started with
    torch.testing.assert_close(_logits(FrozenBase(policy.model), ids), before, rtol=0, atol=1e-6)
    after = _logits(policy.model, ids)
    # a merged copy (checkpoints, vLLM) holds the trained rows; the policy keeps its adapter
    merged = merged_copy(policy.model)
    torch.testing.assert_close(_logits(merged, ids), after, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged.get_input_embeddings().weight[rows], moved, rtol=0, atol=0)
    torch.testing.assert_close(_logits(policy.model, ids), after, rtol=0, atol=0)
    # the adapter saved alone (a checkpoint's adapter/) resumes the same policy
    policy.model.save_pretrained(tmp_path / ADAPTER_DIR)
    resumed = load_policy(tiny_thinking_dir)
    add_lora(resumed, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), 0, "rl", adapter_dir=tmp_path / ADAPTER_DIR)
    torch.testing.assert_close(_logits(resumed.model, ids), after, rtol=0, atol=1e-6)


def test_adapter_pushes_carry_the_rows_to_a_plain_replica(tiny_thinking_dir, tmp_path):
    trainer, replica = load_policy(tiny_thinking_dir), load_policy(tiny_thinking_dir)
    ids = _thinking_ids(trainer)
    fp = model_fingerprint(replica.model, replica.tokenizer, replica.stop_ids)
    add_lora(trainer, LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), 0, "rl", tokens=thinking_rows(trainer))
    assert model_fingerprint(trainer.model, trainer.tokenizer, trainer.stop_ids) == fp
    sync, held = FileWeightSync(tmp_path / "w"), LoadedWeights()
    kinds = []
    for version in range(3):
        _train_step(trainer, ids)
        _logits(trainer.model, ids)  # a sampling pass in between: rows merged when the push is written
        push = sync.publish(trainer.model, version, fp)
        kinds.append(push.kind)
        _, held = load_push(replica.model, push.path, held, fp)
        torch.testing.assert_close(_logits(replica.model, ids), _logits(trainer.model, ids), rtol=0, atol=1e-5)
    assert kinds == ["full", "adapter", "adapter"]
    # the replica's base rows are the push's, written over: the output layer tied to them follows
    emb = replica.model.get_input_embeddings().weight
    assert replica.model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()


def test_cached_thinking_is_made_once_and_again_when_damaged(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TURNFORGE_CACHE", str(tmp_path / "cache"))
    first = cached_thinking(tiny_model_dir)
    policy = load_policy(first)
    assert policy.chat.thinking is not None and len(thinking_rows(policy)) == 2
    stamp = os.stat(first / "model.safetensors").st_mtime_ns
    assert cached_thinking(tiny_model_dir) == first and os.stat(first / "model.safetensors").st_mtime_ns == stamp
    (first / "model.safetensors").write_bytes(b"torn")
    again = cached_thinking(tiny_model_dir)
    assert again == first and load_policy(again).chat.thinking is not None
    # the added rows start at the mean of the others (as transformers' mean resizing does): an average token's logits
    weight = load_policy(again).model.get_input_embeddings().weight.detach()
    torch.testing.assert_close(weight[-2:], weight[:-2].mean(0).expand(2, -1), rtol=0, atol=1e-3)


def test_thinking_on_a_template_that_has_markers_is_one_line(tiny_thinking_dir):
    with pytest.raises(UserError, match=r"model.thinking=true but the chat template of .* already has thinking markers "
                                        r"\(<think>...</think>\); set model.thinking=false"):
        check_run(load_config("frozenlake-think-tiny", [f"model.path={tiny_thinking_dir}"]), make("frozenlake"))
