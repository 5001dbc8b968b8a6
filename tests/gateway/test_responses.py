"""``/v1/responses`` and streaming with the real ``openai`` client on the tiny model: a Responses
call is recorded as a chat call is, a ``previous_response_id`` chain and a function tool round
trip compile to one sample whose trained tokens are the sampled ones, a stream ends in the same
response as the call without it (same seed), chat completions stream too, and a request outside
the subset is a 400 naming its field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from turnforge.gateway import SPLIT_REASONS, compile_trace
from turnforge.gateway.responses import output_items, stream_events, translate
from turnforge.gateway.server import Gateway
from turnforge.policy.generate import Generation, token_logprobs

INSTRUCTIONS = "You are playing a game."
TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate.", "strict": True,
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"], "additionalProperties": False}}]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


@pytest.fixture()
def gateway(tiny_policy):
    with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=512, temperature=1.0, seed=0) as gw:
        yield gw


def script(gateway, policy, monkeypatch, *texts):
    """The model's first answers are ``texts``, each ending in the stop token (then it samples)."""
    tok = policy.tokenizer
    scripted = iter([tuple(tok.encode(t, add_special_tokens=False)) + (policy.stop_ids[0],) for t in texts])
    real = gateway.actor.generate

    def generate(prompts, keys, **kwargs):
        ids = next(scripted, None)
        return [Generation(ids, tuple([-0.5] * len(ids)), True)] if ids is not None else real(prompts, keys, **kwargs)

    monkeypatch.setattr(gateway.actor, "generate", generate)


def assert_token_exact(record, policy):
    """One sample, no split: its trained tokens are every call's sampled ids with their logprobs,
    and the model re-scores them to those logprobs."""
    out = compile_trace(record.calls, record.rollout_id)
    assert out.splits == () and len(out.samples) == 1 and record.spliced_calls == len(record.calls) - 1
    (s,) = out.samples
    assert s.token_ids[s.loss_mask == 1].tolist() == [t for c in record.calls for t in c.completion_ids]
    assert s.logprobs[s.loss_mask == 1].tolist() == pytest.approx([x for c in record.calls for x in c.logprobs], abs=0)
    return s


def test_a_response_records_exactly_what_was_sampled(gateway, tiny_policy):
    c = client(gateway.open_rollout("r"))
    resp = c.responses.create(model="m", instructions=INSTRUCTIONS, input="Up or Down?",
                              include=["message.output_text.logprobs"])
    (call,) = gateway.rollouts["r"].calls
    tok = tiny_policy.tokenizer
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Up or Down?"}]
    assert call.prompt_ids == tuple(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
    stopped = call.completion_ids[-1] in tiny_policy.stop_ids
    body = call.completion_ids[:-1] if stopped else call.completion_ids
    (msg,) = resp.output
    assert msg.type == "message" and resp.output_text == tok.decode(list(body), skip_special_tokens=False)
    assert [lp.logprob for lp in msg.content[0].logprobs] == pytest.approx(list(call.logprobs[:len(body)]), abs=0)
    assert resp.status == ("completed" if stopped else "incomplete") and resp.id.startswith("resp_")
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (len(call.prompt_ids), len(call.completion_ids))
    assert resp.usage.output_tokens_details.reasoning_tokens == 0 and resp.instructions == INSTRUCTIONS


def test_a_previous_response_id_chain_is_one_token_exact_sample(gateway, tiny_policy):
    c = client(gateway.open_rollout("chain"))
    resp = c.responses.create(model="m", instructions=INSTRUCTIONS, input="wall floor box")
    for turn in range(2):  # only the new message: the gateway holds the conversation
        resp = c.responses.create(model="m", instructions=INSTRUCTIONS, input=f"turn {turn}", previous_response_id=resp.id)
    record = gateway.close_rollout("chain")
    s = assert_token_exact(record, tiny_policy)
    assert len(record.calls) == 3 and len(record.responses) == 3
    ids = torch.tensor(s.token_ids)[None]
    lp, _ = token_logprobs(tiny_policy.model, ids, torch.ones_like(ids), positions=torch.tensor(s.loss_mask)[None])
    torch.testing.assert_close(lp[0][s.loss_mask == 1], torch.tensor(s.logprobs[s.loss_mask == 1]), rtol=0, atol=2e-4)


def test_a_function_tool_round_trip_comes_back_token_exact(gateway, tiny_policy, monkeypatch):
    call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    script(gateway, tiny_policy, monkeypatch, call_text, "It is 3.")
    c = client(gateway.open_rollout("tools"))
    first = c.responses.create(model="m", input="1+2?", tools=TOOLS, max_output_tokens=64)
    (fc,) = first.output
    assert fc.type == "function_call" and fc.name == "calculator" and json.loads(fc.arguments) == {"expression": "1+2"}
    assert first.status == "completed" and first.output_text == ""
    output = {"type": "function_call_output", "call_id": fc.call_id, "output": "3"}
    second = c.responses.create(model="m", previous_response_id=first.id, input=[output], tools=TOOLS, max_output_tokens=64)
    assert second.output_text == "It is 3."
    c.responses.create(model="m", previous_response_id=second.id, input="thanks", tools=TOOLS)
    record = gateway.close_rollout("tools")
    assert_token_exact(record, tiny_policy)
    assert "# Tools" in tiny_policy.tokenizer.decode(list(record.calls[0].prompt_ids))  # the tiny template renders them
    # an agent that sends its whole history back instead of chaining gets the same prompt
    script(gateway, tiny_policy, monkeypatch, call_text)
    c = client(gateway.open_rollout("resent"))
    first = c.responses.create(model="m", input="1+2?", tools=TOOLS, max_output_tokens=64)
    history = [{"role": "user", "content": "1+2?"}, *[o.model_dump(exclude_none=True) for o in first.output], output]
    c.responses.create(model="m", input=history, tools=TOOLS)
    resent = gateway.close_rollout("resent")
    assert resent.calls[1].prompt_ids == record.calls[1].prompt_ids and compile_trace(resent.calls, "resent").splits == ()


def test_a_stream_ends_in_the_response_without_it(tiny_policy):
    def run(stream: bool):
        with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=512, temperature=1.0, seed=0) as gw:
            c = client(gw.open_rollout("s"))
            if not stream:
                return c.responses.create(model="m", input="Up or Down?"), [], gw.close_rollout("s")
            events = list(c.responses.create(model="m", input="Up or Down?", stream=True))
            return events[-1].response, events, gw.close_rollout("s")

    plain, _, plain_record = run(False)
    streamed, events, record = run(True)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    assert kinds[-1] == ("response.completed" if plain.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == streamed.output_text == plain.output_text
    assert record.calls[0].completion_ids == plain_record.calls[0].completion_ids
    drop = {"id", "created_at"}
    assert streamed.model_dump(exclude=drop | {"output"}) == plain.model_dump(exclude=drop | {"output"})
    assert [o.model_dump(exclude={"id"}) for o in streamed.output] == [o.model_dump(exclude={"id"}) for o in plain.output]


def test_the_stream_helper_accumulates_text_and_function_calls(gateway, tiny_policy, monkeypatch):
    call_text = 'Let me see. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    script(gateway, tiny_policy, monkeypatch, call_text)
    c = client(gateway.open_rollout("helper"))
    with c.responses.stream(model="m", input="2*3?", tools=TOOLS, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    msg, fc = final.output
    assert msg.content[0].text == final.output_text and fc.type == "function_call"
    assert fc.parsed_arguments == {"expression": "2*3"}  # a strict tool's arguments, parsed by the helper
    args = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(e.delta for e in args) == fc.arguments and args[0].snapshot == fc.arguments
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert done == [msg.id, fc.id] and len(gateway.rollouts["helper"].calls) == 1


def test_chat_completions_stream_to_the_completion_without_it(tiny_policy, monkeypatch):
    messages = [{"role": "user", "content": "Up or Down?"}]

    def run(**kwargs):
        with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=512, temperature=1.0, seed=0) as gw:
            got = client(gw.open_rollout("c")).chat.completions.create(model="m", messages=messages, logprobs=True, **kwargs)
            return list(got) if kwargs else got

    plain = run()
    chunks = run(stream=True, stream_options={"include_usage": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == plain.choices[0].finish_reason
    lps = [lp.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.content]
    assert lps == [lp.logprob for lp in plain.choices[0].logprobs.content]
    assert chunks[-1].usage == plain.usage and chunks[-1].choices == []
    # the helper accumulates tool calls into the message a call without streaming answers
    with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=512, temperature=1.0, seed=0) as gw:
        script(gw, tiny_policy, monkeypatch, '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>')
        chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
        with client(gw.open_rollout("t")).chat.completions.stream(model="m", messages=messages, tools=chat_tools,
                                                                  max_tokens=64) as stream:
            final = stream.get_final_completion()
        assert len(gw.rollouts["t"].calls) == 1
    (tc,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and tc.function.parsed_arguments == {"expression": "1"}


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input[0].content[0].type"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
    (dict(input=[{"role": "wizard", "content": "x"}]), "input[0].role"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]), "input[0].arguments"),
    (dict(background=True), "background"),
    (dict(truncation="auto"), "truncation"),
    (dict(include=["file_search_call.results"]), "include"),
    (dict(text={"format": {"type": "json_object"}}), "text.format"),
    (dict(previous_response_id="resp_nope"), "previous_response_id"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(temperature=3), "temperature"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(max_tool_calls=2), "max_tool_calls"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(input="wall floor " * 600), "input"),
])
def test_responses_outside_the_subset_are_400s_naming_the_field(gateway, kwargs, param):
    c = client(gateway.open_rollout("bad"))
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(**(dict(model="m", input="x") | kwargs))
    assert err.value.status_code == 400 and err.value.body["param"] == param and err.value.body["message"]
    assert gateway.rollouts["bad"].calls == [] and gateway.rollouts["bad"].refused_calls == 1


def test_malformed_responses_bodies_and_unknown_rollouts(gateway):
    base = gateway.open_rollout("m")
    for body in ({"input": 3}, {"input": [1]}, {"input": [{"type": "message", "role": "user", "content": [None]}]},
                 {}, {"input": "x", "tools": "x"}, {"input": "x", "stream": "yes"}, {"input": "x", "reasoning": 1}):
        r = httpx.post(f"{base}/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"], body
    r = httpx.post(f"{gateway.url}/rollouts/nope/v1/responses", json={"input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"
    # a response of another rollout is not found here
    other = client(gateway.open_rollout("other")).responses.create(model="m", input="x")
    with pytest.raises(openai.BadRequestError, match="not found"):
        client(base).responses.create(model="m", input="y", previous_response_id=other.id)
    # store=false keeps nothing to chain onto
    kept = client(base).responses.create(model="m", input="x", store=False)
    assert kept.store is False and kept.id not in gateway.rollouts["m"].responses


def test_serving_answers_responses_and_chains_them(tiny_model_dir):
    from turnforge.gateway.server import open_replica

    with open_replica(tiny_model_dir, host="127.0.0.1", port=0, max_tokens=4, context=256, dtype="float32",
                      device="cpu", seed=0, threads=2, prefix_cache=False) as gw:  # turnforge serve's gateway
        c = client(f"{gw.url}/v1")
        first = c.responses.create(model="m", input="Up?", temperature=0)
        second = c.responses.create(model="m", input="Down?", previous_response_id=first.id)
        assert second.previous_response_id == first.id and gw.rollouts == {} and len(gw.served_responses) == 2
        assert second.model == tiny_model_dir.name and second.usage.input_tokens > first.usage.input_tokens
        with pytest.raises(openai.BadRequestError, match="top_p"):  # serving: the full distribution only
            c.responses.create(model="m", input="x", top_p=0.5)


def test_translation_and_events_by_hand():
    """The pure pieces: items to chat messages (calls merged into one assistant message, reasoning
    not rendered), and the events of a response with every kind of output item."""
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
             {"type": "message", "role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
             {"type": "function_call_output", "call_id": "c2", "output": "two"}]
    req = translate({"input": items, "instructions": "sys", "tools": TOOLS, "max_output_tokens": 5}, {})
    chat = req.chat
    assert [m["role"] for m in chat["messages"]] == ["system", "developer", "user", "assistant", "tool", "tool"]
    assert [tc["function"]["name"] for tc in chat["messages"][3]["tool_calls"]] == ["f", "g"]
    assert chat["messages"][3]["content"] == "ok" and chat["messages"][4]["content"] == "one"
    assert chat["max_tokens"] == 5 and chat["tools"][0]["function"]["name"] == "calculator"
    chained = translate({"input": "next", "previous_response_id": "resp_1"}, {"resp_1": tuple(items)})
    assert chained.items == (*items, {"role": "user", "content": "next"}) and chained.chat["messages"][0]["role"] == "developer"
    message = {"role": "assistant", "content": "x", "reasoning_content": "think",
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    out = output_items(message, "tool_calls")
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call"] and out[2]["call_id"] == "call_1"
    kinds = [e["type"] for e in stream_events({"id": "resp_1", "status": "completed", "output": out})]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]


def test_a_reasoning_model_answers_with_a_reasoning_item_and_chains_token_exact(tiny_thinking_dir, monkeypatch):
    """The thinking comes back as a reasoning item; a chain (whose stored reasoning items are not
    rendered, as the template drops earlier thinking) splices onto the sampled thinking: one sample."""
    from turnforge.policy.model import load_policy

    policy = load_policy(tiny_thinking_dir)
    answers = ["up", "left"]
    scripted = iter([policy.chat.encode(f"<think>\nplan {i}\n</think>\n\n{a}") + (policy.stop_ids[0],)
                     for i, a in enumerate(answers)])

    def generate(prompts, keys, **kwargs):
        return [Generation((ids := next(scripted)), tuple(-0.5 for _ in ids), True) for _ in prompts]

    with Gateway(policy, max_new_tokens=16, max_context_tokens=512, temperature=1.0) as gw:
        monkeypatch.setattr(gw.actor, "generate", generate)
        c = client(gw.open_rollout("r"))
        first = c.responses.create(model="m", input="where to?")
        reasoning, msg = first.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "plan 0" and msg.content[0].text == "up"
        thought = len(policy.chat.encode("<think>\nplan 0\n</think>"))
        assert first.usage.output_tokens_details.reasoning_tokens == thought
        second = c.responses.create(model="m", input="now?", previous_response_id=first.id)
        assert second.output_text == "left"
        record = gw.close_rollout("r")
    assert_token_exact(record, policy)


def test_an_agent_run_on_the_responses_api_trains_what_it_sampled(tmp_path, tiny_policy, monkeypatch):
    """An agent run (``AgentEngine``) whose agent chains Responses calls, one of them streamed:
    each rollout is one sample holding every sampled token, no split."""
    import sys
    import textwrap
    from pathlib import Path

    from turnforge.app.config import load_config
    from turnforge.gateway.agents import AgentEngine, AgentTasks, load_agent
    from turnforge.rollout.actors import PolicyActor
    from turnforge.rollout.engine import EpisodeRequest

    (tmp_path / "responses_agents_mod.py").write_text(textwrap.dedent('''
        import openai

        def agent(task, base_url):
            c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
            r = c.responses.create(model="m", instructions="Play.", input="Which move?", temperature=1.0)
            with c.responses.stream(model="m", instructions="Play.", input="And now?", previous_response_id=r.id) as s:
                for _ in s:
                    pass
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("responses_agents_mod", None)
    tasks_file = Path(__file__).resolve().parents[2] / "examples" / "agents" / "moves.jsonl"
    cfg = load_config("agent-tiny", ["agent.entrypoint=responses_agents_mod:agent", f"agent.tasks={tasks_file}"])
    tasks = AgentTasks(str(tasks_file))
    requests = [EpisodeRequest(tasks.task("train", i), i, "g", f"t{i}") for i in range(2)]
    records, close = {}, Gateway.close_rollout
    monkeypatch.setattr(Gateway, "close_rollout", lambda self, rid: records.setdefault(rid, close(self, rid)))
    engine = AgentEngine(cfg, tiny_policy, tmp_path, tasks, load_agent("responses_agents_mod:agent"))
    try:
        trajs, stats = engine.play(requests, PolicyActor(tiny_policy, 8, 1.0, torch.Generator().manual_seed(0)))
    finally:
        engine.close()
    assert stats.infra_failures == 0 and len(trajs) == 2
    for t in trajs:
        info = t.turns[0].info
        assert (info["n_calls"], info["n_spliced_calls"], info["n_refused_calls"]) == (2, 1, 0)
        (s,) = t.samples
        assert all(info[f"n_splits_{r}"] == 0 for r in SPLIT_REASONS) and info["n_overridden_temperature"] == 0
        sampled = [x for c in records[t.trajectory_id].calls for x in c.completion_ids]
        assert s.token_ids[s.loss_mask == 1].tolist() == sampled and len(sampled) > 0
