"""The gateway on a model whose template drops earlier thinking, with the real ``openai`` client:
the thinking comes back as ``reasoning_content``, and a client that sends its history back without
it is spliced onto the sampled tokens (as_sampled: one sample) or starts a counted new sample on the
template's rendering (as_rendered), token-exact either way."""

from __future__ import annotations

import openai
import pytest

from turnforge.gateway import compile_trace
from turnforge.gateway.server import Gateway
from turnforge.policy.generate import Generation
from turnforge.policy.model import load_policy


@pytest.mark.parametrize("history", ["as_sampled", "as_rendered"])
def test_reasoning_content_and_history_without_thinking(tiny_thinking_dir, monkeypatch, history):
    policy = load_policy(tiny_thinking_dir)
    tok, t = policy.tokenizer, policy.chat.thinking
    answers = ["up", "left", "down"]
    scripted = iter([policy.chat.encode(f"<think>\nplan {i}\n</think>\n\n{a}") + (policy.stop_ids[0],)
                     for i, a in enumerate(answers)])

    def generate(prompts, keys, **kwargs):
        return [Generation((ids := next(scripted)), tuple(-0.5 for _ in ids), True) for _ in prompts]

    with Gateway(policy, max_new_tokens=16, max_context_tokens=512, temperature=1.0, history=history) as gw:
        monkeypatch.setattr(gw.actor, "generate", generate)
        c = openai.OpenAI(base_url=gw.open_rollout("r"), api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "where to?"}]
        for i, answer in enumerate(answers):
            msg = c.chat.completions.create(model="m", messages=messages).choices[0].message
            assert msg.content == answer and msg.model_extra["reasoning_content"] == f"plan {i}"
            messages += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": f"now {i}"}]
        record = gw.close_rollout("r")
    out = compile_trace(record.calls, "r")
    assert record.spliced_calls == 2
    sampled = [x for call in record.calls for x in call.completion_ids]
    if history == "as_sampled":  # one sample holding every sampled token, thinking included
        assert out.splits == () and len(out.samples) == 1
        (s,) = out.samples
        assert s.token_ids[s.loss_mask == 1].tolist() == sampled
    else:  # each call a sample whose prompt is the template's rendering; the splits are counted
        assert len(out.samples) == 3 and out.count("rerendered") == 2
        for k, call in enumerate(record.calls):
            shown = messages[: 2 * k + 1]
            assert tok.decode(list(call.prompt_ids), skip_special_tokens=False) == tok.apply_chat_template(
                shown, tokenize=False, add_generation_prompt=True)
            assert t.open_id not in call.prompt_ids  # earlier thinking dropped
            if k:  # the previous answer's ids as sampled, never re-tokenized
                prev = record.calls[k - 1].completion_ids
                kept = prev[prev.index(t.close_id) + 1:]
                kept = kept[kept.index(next(i for i in kept if tok.decode([i]) != "\n")):]
                assert tuple(call.prompt_ids[len(record.calls[k - 1].prompt_ids):][:len(kept)]) == kept
