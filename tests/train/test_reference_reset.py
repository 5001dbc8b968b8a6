"""ProRL's reference resets (``rl.reference_reset_every``): when they fall, what a reset does to the
reference and the optimizer, and the config rules that refuse a reset with nothing to reset."""

from __future__ import annotations

import pytest
import torch

from turnforge.app.config import load_config
from turnforge.errors import UserError
from turnforge.train.rl import reference_reset_due, reset_reference


def test_resets_fall_after_every_nth_iteration():
    assert [it for it in range(10) if reference_reset_due(it, 3)] == [2, 5, 8]
    assert not any(reference_reset_due(it, 0) for it in range(10))
    assert all(reference_reset_due(it, 1) for it in range(4))


def test_a_reset_copies_the_current_policy_frozen_and_clears_the_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():  # what a step leaves (a real step's first call imports torch's compiler: seconds)
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.ones_like(p), "exp_avg_sq": torch.ones_like(p)}
    ref = reset_reference(model, opt)
    assert len(opt.state) == 0
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in zip(ref.parameters(), model.parameters()))
    with torch.no_grad():  # a copy: the policy moves on, the reference does not
        model.weight.add_(1.0)
    assert not torch.equal(ref.weight, model.weight) and not ref.training


@pytest.mark.parametrize("overrides, pattern", [
    (["rl.reference_reset_every=10"], r"rl.reference_reset_every=10 resets the KL reference, but rl.kl_coef=0 uses none"),
    (["rl.reference_reset_every=10", "rl.kl_coef=0.001", "model.lora.r=4"], r"under LoRA the reference is the adapter's frozen base"),
    (["rl.reference_reset_every=-1"], r"bad value for 'rl.reference_reset_every' \(-1\)"),
])
def test_a_reset_with_nothing_to_reset_is_refused(overrides, pattern):
    with pytest.raises(UserError, match=pattern):
        load_config("sokoban-tiny", overrides)


def test_a_reset_with_a_reference_is_taken():
    assert load_config("sokoban-tiny", ["rl.reference_reset_every=10", "rl.kl_coef=0.001"]).rl.reference_reset_every == 10
