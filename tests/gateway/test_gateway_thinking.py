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


def test_a_thinking_budget_at_the_gateway_closes_the_thinking_and_the_trace_masks_the_written_close(tiny_thinking_dir,
                                                                                                       monkeypatch):
    import numpy as np

    policy = load_policy(tiny_thinking_dir)
    t, stop = policy.chat.thinking, policy.stop_ids[0]
    thought, answer = policy.chat.encode("left wall box move"), policy.chat.encode("up")
    budgets = []

    def generate(prompts, keys, *, max_new_tokens, temperature, images=None, **kwargs):
        budgets.append(max_new_tokens)
        out = []
        for p in prompts:
            answering = tuple(p[-len(t.forced_close):]) == t.forced_close  # the answer's call, after the written close
            ids = (*answer, stop) if answering else ((t.open_id,) + thought * 4)[:max_new_tokens]  # never closes itself
            out.append(Generation(ids, tuple(-0.5 for _ in ids), stop in ids))
        return out

    with Gateway(policy, max_new_tokens=16, max_context_tokens=512, temperature=1.0, thinking_budget=5) as gw:
        monkeypatch.setattr(gw.actor, "generate", generate)
        c = openai.OpenAI(base_url=gw.open_rollout("r"), api_key="unused", max_retries=0)
        got = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "where to?"}], max_tokens=8)
        record = gw.close_rollout("r")
    msg = got.choices[0].message
    assert msg.content == "up" and msg.model_extra["reasoning_content"] and "</think>" not in msg.model_extra["reasoning_content"]
    assert got.usage.completion_tokens_details.reasoning_tokens == 5  # the open marker and 4 thought tokens, sampled
    assert budgets == [5, 8]  # thinking up to the budget, then the answer up to the request's max_tokens
    (call,) = record.calls
    written = (5, 5 + len(t.forced_close))
    assert call.forced == written and call.completion_ids[written[0]:written[1]] == t.forced_close
    (sample,) = compile_trace(record.calls, "r").samples
    n = len(call.prompt_ids)
    mask, lps = sample.loss_mask[n:], sample.logprobs[n:]
    assert mask[:written[0]].all() and not mask[written[0]:written[1]].any() and mask[written[1]:].all()
    assert np.isnan(lps[written[0]:written[1]]).all() and not np.isnan(lps[mask == 1]).any()


def test_a_thinking_budget_needs_a_template_with_thinking_markers(tiny_model_dir):
    from turnforge.errors import UserError

    with pytest.raises(UserError, match="a thinking budget of 4 tokens, but the chat template of .* has no thinking markers"):
        Gateway(load_policy(tiny_model_dir), max_new_tokens=8, max_context_tokens=256, thinking_budget=4)
