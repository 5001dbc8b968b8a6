"""Who owns the sampling settings while the gateway trains (``agent.sampling``), with the real
``openai`` client on the tiny model: the trainer's temperature and top_p win and the call is
sampled exactly as a request without them would have been; strict refuses; max_tokens is
capped; a strict refusal makes the rollout an infrastructure failure even if the agent goes on."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import get_args

import openai
import pytest
import torch

from turnforge.app.config import load_config
from turnforge.config import AgentConfig
from turnforge.gateway.agents import AgentEngine, AgentTasks, load_agent
from turnforge.gateway.sampling import SAMPLING_POLICIES, Override, Strict, TrainerWins, cap_tokens, warning
from turnforge.gateway.server import Gateway
from turnforge.policy.generate import token_logprobs
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest

TASKS = Path(__file__).resolve().parents[2] / "examples" / "agents" / "moves.jsonl"
MESSAGES = [{"role": "system", "content": "You are playing a game."}, {"role": "user", "content": "Up or Down?"}]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def one_call(policy, sampling=TrainerWins(), max_context_tokens=512, **kwargs):
    """A fresh gateway training at temperature 0.5 (seed 0), one call of a rollout: (response, call record)."""
    with Gateway(policy, max_new_tokens=12, max_context_tokens=max_context_tokens, temperature=0.5, seed=0,
                 sampling=sampling) as gw:
        c = client(gw.open_rollout("r"))
        resp = c.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, **kwargs)
        (call,) = gw.close_rollout("r").calls
    return resp, call


@pytest.mark.parametrize("kwargs, overrides", [
    (dict(temperature=1.0), (Override("temperature", 1.0, 0.5),)),
    (dict(top_p=0.9), (Override("top_p", 0.9, 1.0),)),
    (dict(temperature=1.0, top_p=0.5), (Override("temperature", 1.0, 0.5), Override("top_p", 0.5, 1.0))),
])
def test_the_trainers_temperature_and_top_p_win_and_the_call_is_sampled_as_without_them(tiny_policy, kwargs, overrides):
    _, plain = one_call(tiny_policy)
    resp, call = one_call(tiny_policy, **kwargs)
    assert call.overrides == overrides and plain.overrides == ()
    assert call.temperature == 0.5
    # the same tokens and logprobs, bit for bit, as the request that left the settings to the trainer
    assert call.completion_ids == plain.completion_ids and call.logprobs == plain.logprobs
    # ...which are the policy's at the trainer's temperature
    ids = torch.tensor(call.prompt_ids + call.completion_ids)[None]
    positions = torch.zeros_like(ids)
    positions[0, len(call.prompt_ids):] = 1
    lp, _ = token_logprobs(tiny_policy.model, ids, torch.ones_like(ids), 0.5, positions=positions)
    torch.testing.assert_close(lp[0][positions[0] == 1], torch.tensor(call.logprobs), rtol=0, atol=2e-4)
    shown = [c.logprob for c in resp.choices[0].logprobs.content]
    assert shown == list(call.logprobs[:len(shown)])


def test_the_trainers_own_values_are_no_override(tiny_policy):
    _, call = one_call(tiny_policy, temperature=0.5, top_p=1.0)
    assert call.overrides == ()


@pytest.mark.parametrize("kwargs, param", [(dict(temperature=1.0), "temperature"), (dict(top_p=0.9), "top_p")])
def test_strict_refuses_a_setting_the_trainer_owns(tiny_policy, kwargs, param):
    with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=512, temperature=0.5, sampling=Strict()) as gw:
        c = client(gw.open_rollout("r"))
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="m", messages=MESSAGES, **kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == param
        assert err.value.body["code"] == "unsupported_value" and "agent.sampling=strict" in err.value.body["message"]
        c.chat.completions.create(model="m", messages=MESSAGES, temperature=0.5, top_p=1)  # the trainer's: served
        record = gw.close_rollout("r")
    assert record.refused_calls == 1 and len(record.calls) == 1 and param in record.sampling_refusal


def test_a_max_tokens_beyond_the_context_left_is_capped_and_recorded(tiny_policy):
    resp, call = one_call(tiny_policy, max_context_tokens=64, max_tokens=10_000)
    room = 64 - len(call.prompt_ids)
    assert call.overrides == (Override("max_tokens", 10_000, room),) and len(call.completion_ids) <= room
    _, call = one_call(tiny_policy, max_tokens=5)  # within the context: as sent, above max_new_tokens too
    assert call.overrides == () and len(call.completion_ids) <= 5
    assert cap_tokens(None, 12, 4) == (4, None) and cap_tokens(30, 12, 100) == (30, None)


def test_serving_uses_the_requests_temperature_and_refuses_top_p(tiny_policy):
    with Gateway(tiny_policy, max_new_tokens=4, max_context_tokens=128) as gw:
        c = client(f"{gw.url}/v1")
        c.chat.completions.create(model="m", messages=MESSAGES, temperature=1.7)
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="m", messages=MESSAGES, top_p=0.9)
        assert err.value.body["param"] == "top_p"


def test_the_warning_names_the_settings_the_values_and_strict_mode():
    assert warning((Override("temperature", 1.0, 0.5),), TrainerWins()) == (
        "the agent sent temperature=1.0; the trainer samples at temperature 0.5 and its value wins "
        "(agent.sampling=trainer; agent.sampling=strict refuses such requests)")
    both = warning((Override("temperature", 1, 0.5), Override("top_p", 0.9, 1.0)), TrainerWins())
    assert both.startswith("the agent sent temperature=1 and top_p=0.9; the trainer samples at temperature 0.5 and "
                           "with top_p=1 and its values win")
    tokens = warning((Override("max_tokens", 4096, 300),), TrainerWins())
    assert "max_tokens=4096" in tokens and "at most 300 tokens" in tokens and "strict" not in tokens


def test_the_config_values_are_the_policies():
    assert set(get_args(AgentConfig.model_fields["sampling"].annotation)) == set(SAMPLING_POLICIES)
    assert AgentConfig().sampling == "trainer"


@pytest.fixture()
def strict_agents(tmp_path, monkeypatch):
    """A module of agents pinning temperature=1.0: one lets the 400 raise, one goes on without the answer."""
    (tmp_path / "strict_agents_mod.py").write_text(textwrap.dedent('''
        import openai

        def ask(base_url, **kwargs):
            c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
            return c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Which move?"}], **kwargs)

        def raises(task, base_url):
            ask(base_url, temperature=1.0)
            return 1.0

        def goes_on(task, base_url):
            ask(base_url)
            try:
                ask(base_url, temperature=1.0)
            except openai.BadRequestError:
                pass
            return 1.0
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("strict_agents_mod", None)
    return "strict_agents_mod"


@pytest.mark.parametrize("name", ["raises", "goes_on"])
def test_a_strict_refusal_makes_the_rollout_an_infrastructure_failure(tmp_path, tiny_policy, strict_agents, name):
    cfg = load_config("agent-tiny", [f"agent.entrypoint={strict_agents}:{name}", f"agent.tasks={TASKS}",
                                     "agent.sampling=strict"])
    tasks = AgentTasks(str(TASKS))
    requests = [EpisodeRequest(tasks.task("heldout", i), i, f"eval-{i}", f"t{i}") for i in range(2)]
    engine = AgentEngine(cfg, tiny_policy, tmp_path, tasks, load_agent(f"{strict_agents}:{name}"))
    try:  # an evaluation at T=0.5 (a BC temperature)
        trajs, stats = engine.play(requests, PolicyActor(tiny_policy, 8, 0.5, torch.Generator().manual_seed(0)))
    finally:
        engine.close()
    assert stats.infra_failures == 2 and stats.episodes == 2
    assert all("temperature=1.0: this gateway is training at temperature 0.5" in t.infra_failure for t in trajs)
    assert not engine.warned  # nothing was overridden
