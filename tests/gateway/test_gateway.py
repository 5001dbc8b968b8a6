"""The gateway with real clients (the ``openai`` package and ``httpx``) on the tiny model:
exact token records, merging into one sample, tool calls both ways, batching, errors."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest
import torch

from turnforge.errors import UserError
from turnforge.gateway import compile_trace
from turnforge.gateway.server import Gateway
from turnforge.policy.generate import Generation, token_logprobs

SYSTEM = {"role": "system", "content": "You are playing a game."}


@pytest.fixture()
def gateway(tiny_policy):
    with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=512, temperature=1.0, seed=0) as gw:
        yield gw


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_a_call_records_exactly_what_was_sampled(gateway, tiny_policy):
    base = gateway.open_rollout("r0")
    messages = [SYSTEM, {"role": "user", "content": "Up or Down?"}]
    resp = client(base).chat.completions.create(model="any", messages=messages, logprobs=True)
    (call,) = gateway.rollouts["r0"].calls
    tok = tiny_policy.tokenizer
    assert call.prompt_ids == tuple(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
    stopped = call.completion_ids[-1] in tiny_policy.stop_ids
    body = call.completion_ids[:-1] if stopped else call.completion_ids
    choice = resp.choices[0]
    assert choice.message.content == tok.decode(list(body), skip_special_tokens=False)
    assert choice.finish_reason == ("stop" if stopped else "length")
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(list(call.logprobs[:len(body)]), abs=0)
    assert resp.usage.prompt_tokens == len(call.prompt_ids) and resp.usage.completion_tokens == len(call.completion_ids)
    assert [m.id for m in client(base).models.list().data] == ["turnforge-policy"]


def test_a_conversation_merges_into_one_sample_that_rescores_to_its_logprobs(gateway, tiny_policy):
    base = gateway.open_rollout("conv")
    c, messages = client(base), [SYSTEM, {"role": "user", "content": "wall floor box"}]
    for turn in range(3):
        msg = c.chat.completions.create(model="m", messages=messages).choices[0].message
        messages += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": f"turn {turn}"}]
    record = gateway.close_rollout("conv")
    out = compile_trace(record.calls, "conv")
    assert out.splits == () and len(out.samples) == 1 and record.spliced_calls == 2
    (s,) = out.samples
    sampled = [t for call in record.calls for t in call.completion_ids]
    assert s.token_ids[s.loss_mask == 1].tolist() == sampled
    assert s.logprobs[s.loss_mask == 1].tolist() == pytest.approx([x for c in record.calls for x in c.logprobs], abs=0)
    ids = torch.tensor(s.token_ids)[None]
    lp, _ = token_logprobs(tiny_policy.model, ids, torch.ones_like(ids), positions=torch.tensor(s.loss_mask)[None])
    torch.testing.assert_close(lp[0][s.loss_mask == 1], torch.tensor(s.logprobs[s.loss_mask == 1]), rtol=0, atol=2e-4)


def test_tool_calls_go_out_as_tool_calls_and_come_back_token_exact(gateway, tiny_policy, monkeypatch):
    tok = tiny_policy.tokenizer
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    ids = tuple(tok.encode(text, add_special_tokens=False)) + (tiny_policy.stop_ids[0],)
    real = gateway.actor.generate
    scripted = iter([[Generation(ids, tuple([-0.5] * len(ids)), True)]])  # the model's first answer, scripted
    monkeypatch.setattr(gateway.actor, "generate", lambda *a, **k: next(scripted, None) or real(*a, **k))
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                               "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    c = client(gateway.open_rollout("tools"))
    messages = [{"role": "user", "content": "1+2?"}]
    first = c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=64).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (tc,) = first.message.tool_calls
    assert tc.function.name == "calculator" and json.loads(tc.function.arguments) == {"expression": "1+2"}
    messages += [first.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "3"}]
    c.chat.completions.create(model="m", messages=messages, tools=tools)
    record = gateway.close_rollout("tools")
    out = compile_trace(record.calls, "tools")
    assert out.splits == () and record.spliced_calls == 1
    assert "# Tools" in tok.decode(list(record.calls[0].prompt_ids))  # the tiny template renders the schemas


def _script(gateway, policy, monkeypatch, text):
    """The model's first answer is ``text`` (then it samples)."""
    ids = tuple(policy.tokenizer.encode(text, add_special_tokens=False)) + (policy.stop_ids[0],)
    real = gateway.actor.generate
    scripted = iter([[Generation(ids, tuple([-0.5] * len(ids)), True)]])
    monkeypatch.setattr(gateway.actor, "generate", lambda *a, **k: next(scripted, None) or real(*a, **k))


def test_a_reply_whose_tool_call_does_not_parse_keeps_its_text_and_is_counted(gateway, tiny_policy, monkeypatch):
    text = 'Checking. <tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    _script(gateway, tiny_policy, monkeypatch, text)
    c = client(gateway.open_rollout("bad-call"))
    choice = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+2?"}], max_tokens=64).choices[0]
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"
    record = gateway.close_rollout("bad-call")
    assert record.malformed_tool_calls == 1 and len(record.calls) == 1 and record.refused_calls == 0


def test_a_named_tool_format_parses_replies_and_writes_history_token_exact(tiny_policy, monkeypatch):
    """Qwen3-Coder's XML on the tiny model (whose template renders no tool calls): the reply's call comes
    out typed by the request's tool schema, and its history is the format's rendering, spliced."""
    text = "<tool_call>\n<function=calculator>\n<parameter=expression>\n1+2\n</parameter>\n<parameter=exact>\ntrue\n" \
           "</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}, "exact": {"type": "boolean"}}}}}]
    with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=1024, temperature=1.0, seed=0,
                 tool_format="qwen3_coder_xml") as gw:
        _script(gw, tiny_policy, monkeypatch, text.replace("true", "True"))  # as the template writes a boolean
        c = client(gw.open_rollout("xml"))
        messages = [{"role": "user", "content": "1+2?"}]
        first = c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=256).choices[0]
        (tc,) = first.message.tool_calls
        assert first.finish_reason == "tool_calls" and json.loads(tc.function.arguments) == {"expression": "1+2", "exact": True}
        messages += [first.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "3"}]
        c.chat.completions.create(model="m", messages=messages, tools=tools)
        record = gw.close_rollout("xml")
    assert record.spliced_calls == 1 and compile_trace(record.calls, "xml").splits == ()
    with pytest.raises(UserError, match="unknown model.tool_format 'xml'"):
        Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=512, tool_format="xml")


def test_httpx_and_concurrent_requests_are_batched(gateway):
    urls = [gateway.open_rollout(f"h{i}") for i in range(6)]
    results = [None] * 6

    def agent(i):
        r = httpx.post(f"{urls[i]}/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": f"go {i}"}]},
                       timeout=60)
        results[i] = r.status_code

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(6)]
    gateway.batch_window_s, gateway.max_wait_s = 0.2, 0.5
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 6 and max(gateway.batch_sizes) > 1
    assert all(len(gateway.rollouts[f"h{i}"].calls) == 1 for i in range(6))


def test_stop_strings_cut_the_content_and_the_record(gateway, tiny_policy, monkeypatch):
    tok = tiny_policy.tokenizer
    ids = tuple(tok.encode("Up Down Left Right", add_special_tokens=False))
    monkeypatch.setattr(gateway.actor, "generate", lambda *a, **k: [Generation(ids, tuple([-1.0] * len(ids)), False)])
    c = client(gateway.open_rollout("s"))
    choice = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stop=["Left"],
                                       max_tokens=64).choices[0]
    assert choice.message.content == "Up Down " and choice.finish_reason == "stop"
    (call,) = gateway.rollouts["s"].calls
    assert "Left" in tok.decode(list(call.completion_ids)) and "Right" not in tok.decode(list(call.completion_ids))


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=2), "n"),
    (dict(temperature=3), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(seed=3), "seed"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": "wall floor " * 600}]), "messages"),
])
def test_requests_it_cannot_serve_are_openai_style_400s(gateway, kwargs, param):
    c = client(gateway.open_rollout("bad"))
    args = dict(model="m", messages=[{"role": "user", "content": "x"}]) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(**args)
    assert err.value.status_code == 400 and err.value.body["param"] == param and err.value.body["message"]
    assert gateway.rollouts["bad"].calls == [] and gateway.rollouts["bad"].refused_calls == 1


def test_malformed_bodies_and_unknown_rollouts(gateway):
    base = gateway.open_rollout("m")
    r = httpx.post(f"{base}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{gateway.url}/rollouts/nope/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"
    gateway.close_rollout("m")
    with pytest.raises(openai.NotFoundError):
        client(base).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "stream_options": {"include_usage": True}})  # without stream
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_a_port_in_use_is_one_line(tiny_policy):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use"):
            Gateway(tiny_policy, max_new_tokens=4, max_context_tokens=64, port=port)


def test_serving_allows_any_temperature_and_records_nothing(tiny_policy):
    with Gateway(tiny_policy, max_new_tokens=4, max_context_tokens=128) as gw:
        r = client(f"{gw.url}/v1").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                           temperature=0)
        assert r.choices[0].message.role == "assistant" and gw.rollouts == {}


def test_turnforge_serve_answers_the_openai_client(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "turnforge.cli", "serve", str(tiny_model_dir), "--port", str(port),
                             "--max-tokens", "6", "--context", "256"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        c = client(f"http://127.0.0.1:{port}/v1")
        for _ in range(300):  # start-up: model load
            try:
                c.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        r = c.chat.completions.create(model=tiny_model_dir.name, messages=[{"role": "user", "content": "Up?"}], temperature=0.7)
        assert r.model == tiny_model_dir.name and r.usage.completion_tokens <= 6
        busy = subprocess.run([sys.executable, "-m", "turnforge.cli", "serve", str(tiny_model_dir), "--port", str(port)],
                              capture_output=True, text=True, env=env, timeout=120)
        assert busy.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in busy.stderr and "Traceback" not in busy.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
