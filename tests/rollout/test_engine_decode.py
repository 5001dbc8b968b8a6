"""What the env gets of a sampled action: special tokens dropped, the tool-call format's markers kept."""

from __future__ import annotations

import copy

from helpers import inline_engine
from turnforge.config import RolloutConfig


def test_a_mistral_call_keeps_its_marker_and_loses_the_stop_token(tiny_policy):
    policy = copy.copy(tiny_policy)
    policy.tokenizer = copy.deepcopy(tiny_policy.tokenizer)
    policy.tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    cfg = RolloutConfig(context="full_history", max_new_tokens=8, max_context_tokens=512)
    call = '[TOOL_CALLS][{"name": "calc", "arguments": {"expression": "1+2"}}]'
    ids = policy.tokenizer.encode(call, add_special_tokens=False) + [policy.tokenizer.eos_token_id]
    mistral = inline_engine(policy, "calculator", cfg, tool_call_format="mistral")
    assert mistral._decode([ids]) == [call]
    hermes = inline_engine(policy, "calculator", cfg)  # no markers: exactly what skip_special_tokens gives
    assert hermes._decode([ids]) == policy.tokenizer.batch_decode([ids], skip_special_tokens=True)
    assert not hermes._decode([ids])[0].startswith("[TOOL_CALLS]")
