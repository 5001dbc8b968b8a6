"""Property: for random multi-call agents talking to the gateway, the compiled samples hold
exactly the tokens the gateway sampled (masks and logprobs aligned), and every call that
does not extend its sample is a counted split of the expected kind."""

from __future__ import annotations

import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnforge.gateway import compile_trace
from turnforge.gateway.server import Gateway

MOVES = st.lists(st.sampled_from(["continue", "tool", "reformat", "retry", "new"]), min_size=1, max_size=5)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from turnforge.policy.model import load_policy
    from turnforge.config import TinyModelConfig
    from turnforge.policy.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny_gw")
    build_tiny_model(path, TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    with Gateway(load_policy(path), max_new_tokens=6, max_context_tokens=4096, temperature=1.0) as gw:
        yield gw


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(moves=MOVES)
def test_compiled_samples_hold_exactly_what_was_sampled(gateway, moves):
    rid = uuid.uuid4().hex[:12]
    url = gateway.open_rollout(rid) + "/chat/completions"
    with httpx.Client(timeout=60) as http:
        def ask(messages):
            r = http.post(url, json={"model": "m", "messages": messages})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"] or ""

        messages = [{"role": "user", "content": "start"}]
        last = ask(messages)
        expected = []
        for i, move in enumerate(moves):
            if move in ("continue", "tool"):
                messages = messages + [{"role": "assistant", "content": last},
                                       {"role": "tool" if move == "tool" else "user", "content": f"obs {i}"}]
                expected.append(None)
            elif move == "reformat":  # the client rewrites the model's last answer
                messages = messages + [{"role": "assistant", "content": f"[{last}]"}, {"role": "user", "content": f"obs {i}"}]
                expected.append("rerendered")
            elif move == "retry":
                expected.append("branch")
            else:
                messages = [{"role": "system", "content": f"summarise {i}"}, {"role": "user", "content": "go"}]
                expected.append("new_context")
            last = ask(messages)
    record = gateway.close_rollout(rid)
    out = compile_trace(record.calls, rid)

    sampled = [t for c in record.calls for t in c.completion_ids]
    logps = [x for c in record.calls for x in c.logprobs]
    in_samples = [int(t) for s in out.samples for t in s.token_ids[s.loss_mask == 1]]
    lp_samples = [float(x) for s in out.samples for x in s.logprobs[s.loss_mask == 1]]
    assert in_samples == sampled and lp_samples == pytest.approx(logps, abs=0)
    assert all((s.versions[s.loss_mask == 1] >= 0).all() for s in out.samples)
    assert len(out.samples) == len(out.splits) + 1
    # a split happens exactly where the agent did not extend its conversation; an extension
    # after a split starts from the sample the split opened, so only its kind is checked
    assert [s.reason for s in out.splits] == [e for e in expected if e is not None]
