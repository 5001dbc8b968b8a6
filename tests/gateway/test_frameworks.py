"""Agent frameworks, their code unmodified, playing the ``calculator`` env through the gateway
(``examples/agents/langgraph_agent.py``: LangGraph's prebuilt ReAct agent on LangChain's
``ChatOpenAI``, chat completions; ``examples/agents/openai_agents_sdk_agent.py``: the OpenAI
Agents SDK on the Responses API): on a real gateway with the tiny model, each rollout's calls
went through its framework's API, its tool calls were env steps, its reward is the env's
return, and every sampled token is trained exactly; and each framework's recipe trains."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import TINY_TEST_SHAPE, WrittenCalls, assert_rescores

from turnforge.envs.tool.calculator import CalculatorEnv
from turnforge.gateway import SPLIT_REASONS

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "agents" / "countdown.jsonl"
# framework: (the package to import, the example's entrypoint, its recipe, its API's route)
FRAMEWORKS = {
    "langgraph": ("langgraph.prebuilt", "examples.agents.langgraph_agent:agent", "langgraph-tiny", "chat"),
    "openai-agents": ("agents", "examples.agents.openai_agents_sdk_agent:agent", "openai-agents-tiny", "responses"),
}
INSTALL = "needs the frameworks extra: pip install -e '.[frameworks]' (make setup)"


@pytest.fixture(params=list(FRAMEWORKS))
def framework(request):
    package, entrypoint, recipe, route = FRAMEWORKS[request.param]
    pytest.importorskip(package, reason=INSTALL)
    return entrypoint, recipe, route


@pytest.fixture()
def env_steps(monkeypatch):
    """Every step of every calculator env, per env object: [(task, action, StepResult)]."""
    out: dict[int, list] = defaultdict(list)
    alive = []  # the envs, so that no id is reused
    real = CalculatorEnv.step

    def spy(self, action):
        result = real(self, action)
        alive.append(self)
        out[id(self)].append((self.current_task, action, result))
        return result

    monkeypatch.setattr(CalculatorEnv, "step", spy)
    return out


def env_returns(env_steps) -> dict[tuple[str, int], list[float]]:
    """The env's return of each episode (to 5 decimals: the Parquet holds float32), per env task
    (split, index), sorted."""
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for steps in env_steps.values():
        task = steps[0][0]
        out[(task.split, task.index)].append(round(sum(r.reward for _, _, r in steps), 5))
    return {k: sorted(v) for k, v in out.items()}


def assert_trained_as_sampled(samples, calls) -> None:
    """The trained tokens (loss mask 1) of a rollout's samples, in order, are exactly the tokens
    its gateway calls sampled, with their logprobs (as tests/gateway/test_mini_swe_agent.py checks)."""
    masks = [np.asarray(s.loss_mask, dtype=bool) for s in samples]
    tokens = [t for s, m in zip(samples, masks) for t in np.asarray(s.token_ids)[m].tolist()]
    logprobs = [x for s, m in zip(samples, masks) for x in np.asarray(s.logprobs)[m].tolist()]
    assert tokens == [t for c in calls for t in c.completion_ids] and tokens
    assert logprobs == pytest.approx([x for c in calls for x in c.logprobs], abs=1e-6)


def assert_route(record, route: str) -> None:
    """Every call of the rollout came through ``route``: a Responses call is stored on the rollout
    (``RolloutRecord.responses``, by response id); a chat completion is not."""
    assert len(record.responses) == (len(record.calls) if route == "responses" else 0)


def test_a_framework_agent_plays_the_env_through_its_api_and_trains_token_exactly(tmp_path, tiny_policy, framework,
                                                                                   recorded, env_steps, monkeypatch):
    """Three rollouts of the example agent on a real gateway (the tiny model), on train levels 0-2.
    In r0 the model's answers are written: a calculator call ("6+2"; level 0 is 6 2 -> 12), then
    the right answer; in r1 the call is written and the model samples the rest; r2 is the
    model's alone. The tool call was an env step whose result reached the model; each reward is
    the env's return (r0's 1.0 only the env's score of the answer gives); every call went through
    the framework's API; each rollout is one sample whose trained tokens are the sampled ones,
    re-scoring to their logprobs."""
    from turnforge.app.config import load_config
    from turnforge.gateway.agents import AgentEngine, AgentTasks, load_agent
    from turnforge.gateway.render import decode
    from turnforge.rollout.actors import PolicyActor
    from turnforge.rollout.engine import EpisodeRequest

    entrypoint, recipe, route = framework
    monkeypatch.chdir(REPO)
    cfg = load_config(recipe, [f"agent.tasks={TASKS}"])
    tasks = AgentTasks(str(TASKS))
    requests = [EpisodeRequest(tasks.task("train", i), i, f"g{i}", f"r{i}") for i in range(3)]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6+2"}}</tool_call>'
    actor = WrittenCalls(PolicyActor(tiny_policy, cfg.rollout.max_new_tokens, 1.0, torch.Generator().manual_seed(0)),
                    tiny_policy, {"r0": [call, "<answer>6*2</answer>"], "r1": [call, None]})
    engine = AgentEngine(cfg, tiny_policy, tmp_path, tasks, load_agent(entrypoint))
    try:
        trajs, stats = engine.play(requests, actor)
    finally:
        engine.close()
    assert stats.infra_failures == 0 and [t.infra_failure for t in trajs] == [None] * 3
    # the rewards are the env's returns; r0 won
    returns = env_returns(env_steps)
    assert {(t.task.data["split"], t.task.data["index"]): [t.episode_return] for t in trajs} == returns
    written, half, alone = trajs
    assert written.episode_return == 1.0 and written.success and not half.success and not alone.success
    (steps,) = [s for s in env_steps.values() if s[0][0].index == 0]
    assert [a for _, a, _ in steps] == [call, "<answer>6*2</answer>"] and steps[0][2].observation == "8"
    calls = recorded["r0"].calls
    assert len(calls) == 2 and written.turns[0].info["agent_tool_calls"] == 1
    head = calls[0].prompt_ids + calls[0].completion_ids
    assert calls[1].prompt_ids[:len(head)] == head  # spliced onto the sampled call: then the env's result, a tool turn
    tail = decode(tiny_policy.tokenizer, calls[1].prompt_ids[len(head):])
    assert tail == "\n<|im_start|>tool\n8<|im_end|>\n<|im_start|>assistant\n"
    assert len(recorded["r1"].calls) == 2 and half.turns[0].info["agent_tool_calls"] == 1
    for t in trajs:
        record, info = recorded[t.trajectory_id], t.turns[0].info
        assert_route(record, route)
        assert len(t.samples) == 1 and all(info[f"n_splits_{r}"] == 0 for r in SPLIT_REASONS)
        assert info["n_spliced_calls"] == info["n_calls"] - 1 and info["n_refused_calls"] == 0
        assert_trained_as_sampled(t.samples, record.calls)
    assert_rescores(tiny_policy, [s for t in trajs for s in t.samples])


class _Row:
    """A Parquet row as a sample's arrays."""

    def __init__(self, row: dict) -> None:
        self.token_ids, self.loss_mask, self.logprobs = row["token_ids"], row["loss_mask"], row["logprobs"]


def test_a_framework_recipe_trains_an_iteration_on_the_envs_rewards(tmp_path, framework, recorded, env_steps,
                                                                     monkeypatch):
    """The framework's recipe, one RL iteration: every trajectory's trained tokens in the Parquet
    are its sampled tokens (0 mismatches), its calls came through the framework's API, and its
    reward is the env's return."""
    from turnforge.app.config import load_config
    from turnforge.app.run import train

    _, recipe, route = framework
    monkeypatch.chdir(REPO)
    overrides = [f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()] + [
        "rl.iterations=1", "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=2", "eval.bc_temperatures=[]",
        "eval.pass_at_k_samples=0"]
    summary = train(load_config(recipe, overrides), tmp_path / "run", live=False)
    assert summary.rl_iterations == 1 and summary.env_id == "agent"
    rows = pq.read_table(tmp_path / "run" / "trajectories" / "rl_00000.parquet").to_pylist()
    tids = sorted({r["trajectory_id"] for r in rows})
    assert len(tids) == 4 and all(r["infra_failure"] is None for r in rows)
    mismatches, rewards = 0, defaultdict(list)
    for tid in tids:
        mine = sorted((r for r in rows if r["trajectory_id"] == tid), key=lambda r: r["segment_index"])
        calls = recorded[tid].calls
        assert_route(recorded[tid], route)
        masks = [np.asarray(r["loss_mask"], dtype=bool) for r in mine]
        mismatches += [t for r, m in zip(mine, masks) for t in np.asarray(r["token_ids"])[m].tolist()] != \
            [t for c in calls for t in c.completion_ids]
        assert_trained_as_sampled([_Row(r) for r in mine], calls)
        _, split, index = mine[0]["task_id"].split(":")  # agent:train:i is line i of the train tasks: level i
        rewards[(split, int(index))].append(round(mine[0]["reward"], 5))
    assert mismatches == 0
    returns = env_returns(env_steps)  # held-out evaluations played levels 32.. (no train level among them)
    assert {k: sorted(v) for k, v in rewards.items()} == {k: v for k, v in returns.items() if k[0] == "train"}
    events = [json.loads(line)["env_events"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "rl_iter"]
    assert len(events) == 1 and events[0]["n_calls"] >= 4
