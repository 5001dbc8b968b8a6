"""``token_logprobs(positions=...)`` scores only the selected tokens, with the LM head run on
those positions alone, and agrees with full scoring there (values, entropy and gradients)."""

from __future__ import annotations

import pytest
import torch

from turnforge.policy.generate import _keeps_selected_logits, pad_right, token_logprobs


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [17, 9, 23, 5]
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    ids, attn = pad_right(seqs, 0)
    positions = torch.zeros(ids.shape)
    positions[0, 3:6] = 1  # two separate "turns" in row 0
    positions[0, 12:17] = 1
    positions[1, 8] = 1  # the last real token
    positions[2, 1:23] = 1  # everything but the first token
    return ids, attn, positions  # row 3: nothing to score


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_positions_match_full_scoring(any_policy, temperature):
    model = any_policy.model
    assert _keeps_selected_logits(model)
    ids, attn, positions = _batch(model.config.vocab_size)
    full, full_ent = token_logprobs(model, ids, attn, temperature, with_entropy=True)
    part, part_ent = token_logprobs(model, ids, attn, temperature, with_entropy=True, positions=positions)
    on = positions.bool()
    assert part.shape == full.shape and part_ent.shape == full_ent.shape
    torch.testing.assert_close(part[on], full[on], rtol=0, atol=1e-5)
    torch.testing.assert_close(part_ent[on], full_ent[on], rtol=0, atol=1e-5)
    assert (part[~on] == 0).all() and (part_ent[~on] == 0).all()
    assert (part[on] < 0).all()


def test_positions_gradients_match(tiny_policy):
    model = tiny_policy.model
    ids, attn, positions = _batch(model.config.vocab_size, seed=1)
    grads = []
    for pos in (None, positions):
        model.zero_grad()
        lp, _ = token_logprobs(model, ids, attn, positions=pos)
        (-(lp * positions).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_positions_under_lora_and_frozen_base(tiny_model_dir):
    from turnforge.config import LoraConfig
    from turnforge.policy.lora import FrozenBase, add_lora
    from turnforge.policy.model import load_policy

    policy = load_policy(tiny_model_dir)
    base_full, _ = token_logprobs(policy.model, *_batch(policy.model.config.vocab_size)[:2])
    add_lora(policy, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), seed=0, stage="test")
    model = policy.model
    with torch.no_grad():  # move the adapters off zero so that base and policy differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    ids, attn, positions = _batch(model.config.vocab_size)
    on = positions.bool()
    assert _keeps_selected_logits(model) and _keeps_selected_logits(FrozenBase(model))
    lora_full, _ = token_logprobs(model, ids, attn)
    lora_part, _ = token_logprobs(model, ids, attn, positions=positions)
    ref_part, _ = token_logprobs(FrozenBase(model), ids, attn, positions=positions)
    torch.testing.assert_close(lora_part[on], lora_full[on], rtol=0, atol=1e-5)
    torch.testing.assert_close(ref_part[on], base_full[on], rtol=0, atol=1e-5)
    assert (lora_part[on] - ref_part[on]).abs().max() > 1e-3


def test_models_without_logits_to_keep_fall_back(tiny_policy):
    class Plain(torch.nn.Module):  # a causal LM whose forward takes no logits_to_keep
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    plain = Plain(tiny_policy.model)
    assert not _keeps_selected_logits(plain)
    ids, attn, positions = _batch(tiny_policy.model.config.vocab_size)
    on = positions.bool()
    got, _ = token_logprobs(plain, ids, attn, positions=positions)
    want, _ = token_logprobs(tiny_policy.model, ids, attn)
    torch.testing.assert_close(got[on], want[on], rtol=0, atol=1e-5)
    assert (got[~on] == 0).all()
