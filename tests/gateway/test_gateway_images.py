"""The gateway serves a vision-language policy: OpenAI ``image_url`` parts, token-exact traces."""

from __future__ import annotations

import base64

import openai
import pytest

from helpers import assert_rescores, solid_png
from turnforge.gateway.server import Gateway
from turnforge.gateway.trace import compile_trace


def _url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture()
def vlm(tiny_vlm_dir):
    from turnforge.policy.model import load_policy

    return load_policy(tiny_vlm_dir)


def _user(text, png):
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(png)}}, {"type": "text", "text": text}]}


def test_image_url_parts_reach_the_model_and_the_trace_rescores(vlm):
    red, blue = solid_png((220, 30, 30)), solid_png((30, 30, 220))
    with Gateway(vlm, max_new_tokens=6, max_context_tokens=512, temperature=1.0, seed=0) as gw:
        c = openai.OpenAI(base_url=gw.open_rollout("r"), api_key="unused", max_retries=0)
        messages = [_user("What colour?", red)]
        for png in (blue, red):
            msg = c.chat.completions.create(model="m", messages=messages).choices[0].message
            messages += [{"role": "assistant", "content": msg.content}, _user("And now?", png)]
        record = gw.close_rollout("r")
    assert [len(call.images) for call in record.calls] == [1, 2]
    out = compile_trace(record.calls, "r")
    assert out.splits == () and len(out.samples) == 1 and record.spliced_calls == 1
    (s,) = out.samples
    assert s.images == (red, blue)
    per = vlm.vision.block(red).count(vlm.vision.image_token_id)
    assert int((s.token_ids == vlm.vision.image_token_id).sum()) == 2 * per
    assert_rescores(vlm, [s], atol=1e-4)


def test_image_requests_it_cannot_serve_are_400s(vlm, tiny_policy):
    red = solid_png((220, 30, 30))
    bad = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
    garbage = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    with Gateway(vlm, max_new_tokens=4, max_context_tokens=512, temperature=None, seed=0) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        for messages, says in (([bad], "only data:image"), ([garbage], "not an image")):
            with pytest.raises(openai.BadRequestError, match=says):
                c.chat.completions.create(model="m", messages=messages)
    with Gateway(tiny_policy, max_new_tokens=4, max_context_tokens=512, temperature=None, seed=0) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="text-only"):
            c.chat.completions.create(model="m", messages=[_user("hi", red)])
