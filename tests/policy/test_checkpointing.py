"""``model.gradient_checkpointing``: each layer runs again in the backward pass, the gradients are
the same as without it (full fine-tuning and LoRA), and sampling in eval mode is untouched."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rescores, play
from turnforge.config import LoraConfig, RolloutConfig
from turnforge.policy.generate import token_logprobs
from turnforge.policy.lora import add_lora
from turnforge.policy.model import load_policy, use_gradient_checkpointing
from turnforge.train.common import collate

CFG = RolloutConfig(context="full_history", max_turns=4, max_new_tokens=6, max_context_tokens=1024)


def _gradients(policy, batch) -> tuple[dict[str, torch.Tensor], int]:
    """The gradients of one BC-style loss on ``batch`` and how often the first layer's MLP ran."""
    calls = []
    inner = policy.model.get_base_model() if hasattr(policy.model, "get_base_model") else policy.model
    mlp = inner.model.layers[0].mlp  # inside the checkpointed forward (module hooks are not: HF keeps them outside)
    forward = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    policy.model.train()
    lp, _ = token_logprobs(policy.model, batch.ids, batch.attention, positions=batch.mask)
    (-(lp * batch.mask).sum()).backward()
    policy.model.eval()
    del mlp.forward
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}, len(calls)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointing_recomputes_the_layers_and_keeps_the_gradients(tiny_model_dir, lora):
    plain, checkpointed = load_policy(tiny_model_dir), load_policy(tiny_model_dir)
    if lora:
        for p in (plain, checkpointed):
            add_lora(p, LoraConfig(r=4), 0, "bc")
    use_gradient_checkpointing(checkpointed.model)
    samples = play(plain, "frozenlake", CFG)
    batch = collate(samples, plain.pad_id)
    want, once = _gradients(plain, batch)
    got, twice = _gradients(checkpointed, batch)
    assert (once, twice) == (1, 2)  # the layer ran again in the backward pass
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    assert_rescores(checkpointed, play(checkpointed, "frozenlake", CFG), atol=1e-4)  # sampling (eval mode) as before
