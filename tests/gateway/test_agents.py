"""Agent runs through the gateway: the example agents (the openai package, plain httpx) train
for 2 iterations with the tiny model, the Parquet holds exactly what the gateway sampled, and
agent failures are infrastructure failures or one-line errors, never reward 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import TINY_TEST_SHAPE, run_main

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.errors import RunStopped, UserError
from turnforge.gateway import server as gateway_server
from turnforge.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "agents" / "moves.jsonl"
SMALL = [f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()] + [
    "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=4", f"agent.tasks={TASKS}",
    "eval.pass_at_k_samples=0"]


@pytest.fixture()
def agents_module(tmp_path, monkeypatch):
    """A module ``test_agents_mod`` of small agents, importable by entrypoint."""
    (tmp_path / "test_agents_mod.py").write_text(textwrap.dedent('''
        import asyncio, time
        import httpx

        def ask(base_url, text="Which move?"):
            r = httpx.post(base_url + "/chat/completions", json={"messages": [{"role": "user", "content": text}]}, timeout=60)
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"] or ""

        def flaky(task, base_url):
            ask(base_url)
            if task["move"] == "Left":
                raise RuntimeError("the agent's tool server fell over")
            return 1.0

        def wrong_type(task, base_url):
            ask(base_url)
            return "1.0"

        def slow(task, base_url):
            ask(base_url)
            time.sleep(30)
            return 1.0

        def silent(task, base_url):
            return 1.0

        async def async_agent(task, base_url):
            async with httpx.AsyncClient(timeout=60) as c:
                r = await c.post(base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "go"}]})
            return {"reward": float(len(r.json()["choices"][0]["message"]["content"] or "") % 2), "metrics": {"chars": 3}}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("test_agents_mod", None)
    return "test_agents_mod"


SMOLAGENTS = "examples.agents.smolagents_agent:agent"


@pytest.mark.slow
@pytest.mark.parametrize("entrypoint", ["examples.agents.openai_agent:agent", "examples.agents.httpx_agent:agent", SMOLAGENTS])
def test_example_agents_train_and_the_parquet_holds_what_was_sampled(tmp_path, recorded, entrypoint, monkeypatch):
    if entrypoint == SMOLAGENTS:
        pytest.importorskip("smolagents", reason="the smolagents example needs: pip install smolagents")
    monkeypatch.chdir(REPO)
    extra = ["rollout.max_context_tokens=4000"] if entrypoint == SMOLAGENTS else []  # its system prompt: ~2,800 tokens
    summary = train(load_config("agent-tiny", SMALL + [f"agent.entrypoint={entrypoint}", *extra]), tmp_path / "run", live=False)
    assert summary.rl_iterations == 2 and summary.env_id == "agent" and summary.eval_after_rl.episodes == 4
    rows = [r for f in sorted((tmp_path / "run" / "trajectories").glob("rl_*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len({r["trajectory_id"] for r in rows}) == 8
    mismatches = 0
    for tid in {r["trajectory_id"] for r in rows}:  # a split trajectory has several samples, in call order
        calls = recorded[tid].calls
        mine = [r for r in rows if r["trajectory_id"] == tid]
        masks = [np.asarray(r["loss_mask"], dtype=bool) for r in mine]
        tokens = [t for r, m in zip(mine, masks) for t in np.asarray(r["token_ids"])[m].tolist()]
        logprobs = [x for r, m in zip(mine, masks) for x in np.asarray(r["logprobs"])[m].tolist()]
        mismatches += tokens != [t for c in calls for t in c.completion_ids]
        assert logprobs == pytest.approx([x for c in calls for x in c.logprobs], abs=1e-6)
    assert mismatches == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = [m["env_events"] for m in metrics if m["event"] == "rl_iter"]
    assert len(events) == 2 and all(e["n_calls"] >= 4 for e in events)
    splits = sum(e["n_splits_rerendered"] + e["n_splits_branch"] + e["n_splits_new_context"] for e in events)
    if entrypoint != SMOLAGENTS:
        assert splits == 0
    else:  # its last call ("give your final answer") starts a new conversation: one split per rollout, listed
        listed = (tmp_path / "run" / "gateway_splits.jsonl").read_text().splitlines()
        assert splits > 0 and sum(json.loads(x)["rollout"].startswith("rl-") for x in listed) == splits


def test_async_agents_and_their_metrics(tmp_path, agents_module):
    summary = train(load_config("agent-tiny", SMALL + [f"agent.entrypoint={agents_module}:async_agent", "rl.iterations=1"]),
                    tmp_path / "run", live=False)
    assert summary.rl_iterations == 1
    rows = pq.read_table(tmp_path / "run" / "trajectories" / "rl_00000.parquet").to_pylist()
    assert len(rows) == 4 and all(r["infra_failure"] is None for r in rows)


def test_an_agent_that_raises_is_an_infrastructure_failure_and_too_many_stop_the_run(tmp_path, agents_module):
    cfg = load_config("agent-tiny", SMALL + [f"agent.entrypoint={agents_module}:flaky", "max_failure_share=0.9"])
    summary = train(cfg, tmp_path / "ok", live=False)
    assert summary.eval_after_rl.infra_failures == 1 and summary.eval_after_rl.success_rate == 1.0  # held-out tasks 0-3: Up, Down, Left, Right
    with pytest.raises(RunStopped, match="failed in the agent program or its tools.*fix the agent"):
        train(load_config("agent-tiny", SMALL + [f"agent.entrypoint={agents_module}:flaky", "max_failure_share=0.1"]),
              tmp_path / "stop", live=False)


def test_timeouts_and_agents_that_never_call_the_model_are_failures(tmp_path, agents_module):
    import torch

    from turnforge.config import TinyModelConfig
    from turnforge.gateway.agents import AgentEngine, AgentTasks, load_agent
    from turnforge.policy.model import load_policy
    from turnforge.policy.tiny import build_tiny_model
    from turnforge.rollout.actors import PolicyActor
    from turnforge.rollout.engine import EpisodeRequest

    build_tiny_model(tmp_path / "m", TinyModelConfig(**TINY_TEST_SHAPE))
    policy = load_policy(tmp_path / "m")
    cfg = load_config("agent-tiny", SMALL + [f"agent.entrypoint={agents_module}:slow", "agent.timeout_s=1"])
    tasks = AgentTasks(str(TASKS))
    requests = [EpisodeRequest(tasks.task("train", i), i, "g", f"t{i}") for i in range(2)]
    actor = PolicyActor(policy, 8, 1.0, torch.Generator().manual_seed(0))
    for name, reason in [("slow", "ran past agent.timeout_s=1.0"), ("silent", "made no model call")]:
        engine = AgentEngine(cfg, policy, tmp_path, tasks, load_agent(f"{agents_module}:{name}"))
        try:
            trajs, stats = engine.play(requests, actor)
        finally:
            engine.close()
        assert stats.infra_failures == 2 and all(reason in t.infra_failure for t in trajs)


def test_an_agent_returning_a_non_number_stops_with_one_line(tmp_path, agents_module):
    with pytest.raises(UserError, match=r"returned '1.0' \(str\) as the reward; return a finite number"):
        train(load_config("agent-tiny", SMALL + [f"agent.entrypoint={agents_module}:wrong_type"]), tmp_path / "run", live=False)


def _cli(*args, cwd=REPO):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "turnforge.cli", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


@pytest.mark.parametrize("args, expected", [
    (["agent.entrypoint=no_such_module_xyz:agent"], "cannot import module 'no_such_module_xyz' (ModuleNotFoundError"),
    (["agent.entrypoint=examples.agents.openai_agent:nope"], "module 'examples.agents.openai_agent' has no callable 'nope'"),
    (["agent.entrypoint=justaname"], "must be 'module:callable'"),
    (["agent.tasks=/no/such.jsonl"], "task file '/no/such.jsonl' does not exist"),
    (["agent.tasks=README.md"], "line 1: not JSON"),
    (["bc.enabled=true"], "bc.enabled=true needs an env's expert"),
    (["reward.judge.enabled=true"], "reward.judge.enabled=true is for env runs; an agent run sets agent.reward=judge"),
])
def test_bad_agent_input_is_one_line_before_training(args, expected, tmp_path, monkeypatch, capsys):
    code, _, stderr = run_main(["train", "agent-tiny", *args, "--out", tmp_path / "run"], REPO, monkeypatch, capsys)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and expected in lines[0] and "Traceback" not in stderr, stderr
    assert not (tmp_path / "run").exists()


def test_a_tasks_file_without_heldout_tasks_is_one_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"move": "Up", "split": "train"}\n')
    r = _cli("train", "agent-tiny", f"agent.tasks={f}", "--out", str(tmp_path / "run"))  # a real process, the entry point
    assert r.returncode == 2 and "has no heldout tasks" in r.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_agent_run_resumes_after_an_interruption(tmp_path, monkeypatch):
    """Agent runs are not bit-reproducible (timing decides what shares a generation call), so
    resume is checked for what it must keep: the iteration count, the metrics (each iteration
    once), a fresh gateway, and a judge loaded again from the run's BC checkpoint."""
    monkeypatch.chdir(REPO)
    cfg = load_config("agent-tiny", SMALL + ["agent.reward=judge", "reward.judge.mode=yes_no"])
    assert train(cfg, tmp_path / "run", live=False, stop_after=1) is None
    assert not (tmp_path / "run" / "summary.json").exists()
    summary = train(load_run_config(tmp_path / "run"), tmp_path / "run", resume=True, live=False)
    assert summary.rl_iterations == 2
    assert [m.iteration for m in read_metrics(tmp_path / "run").iterations] == [1, 2]
    rows = [r for f in sorted((tmp_path / "run" / "trajectories").glob("rl_*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert {r["iteration"] for r in rows} == {0, 1} and all(r["judge_output"] for r in rows if r["infra_failure"] is None)


def test_an_agent_that_compacts_its_history_trains_every_context_as_a_segment(tmp_path, recorded, monkeypatch):
    """The compacting example agent (the openai package) restarts its conversation from a summary
    the model wrote: both contexts are samples of the rollout, in order, with its advantage."""
    monkeypatch.chdir(REPO)
    summary = train(load_config("agent-tiny", SMALL + ["agent.entrypoint=examples.agents.compacting_agent:agent",
                                                       "rl.iterations=1"]), tmp_path / "run", live=False)
    assert summary.rl_iterations == 1
    rows = pq.read_table(tmp_path / "run" / "trajectories" / "rl_00000.parquet").to_pylist()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "checkpoints" / "final")
    tids = sorted({r["trajectory_id"] for r in rows})
    assert len(tids) == 4
    nonempty = 0
    for tid in tids:
        mine = sorted((r for r in rows if r["trajectory_id"] == tid), key=lambda r: r["segment_index"])
        assert [(r["segment_index"], r["parent_segment"]) for r in mine] == [(0, -1), (1, 0)]
        calls = recorded[tid].calls
        first, second = (np.asarray(r["loss_mask"], dtype=bool) for r in mine)
        # the summary: sampled (mask 1) at the end of the first segment...
        written = list(calls[1].completion_ids)
        assert np.asarray(mine[0]["token_ids"])[first].tolist()[-len(written):] == written
        # ...and context (mask 0) in the second, where the agent re-sent it as text
        text = tok.decode(calls[1].completion_ids, skip_special_tokens=True).strip()
        context = tok.decode(np.asarray(mine[1]["token_ids"])[~second].tolist(), skip_special_tokens=True)
        assert text in context and second.sum() == len(calls[2].completion_ids)
        nonempty += bool(text)
        assert mine[0]["advantage"] == mine[1]["advantage"]  # the rollout's advantage on both
    assert nonempty > 0


def test_an_agent_that_pins_its_temperature_trains_through_the_bc_temperature_sweep(tmp_path, monkeypatch, capsys):
    """The openai example agent sending temperature=1.0 on every call, through agent-tiny as
    shipped (its eval.bc_temperatures sweep at 1.0, 0.5 and 0.1 included; one RL iteration, no
    pass@k): the trainer's temperature wins (agent.sampling=trainer), the run ends with exit 0,
    warns once, and counts the overridden calls per evaluation and in summary.json."""
    from turnforge.gateway.sampling import Override
    from turnforge.train.metrics import SamplingOverrides, read_summary

    calls = []
    close = gateway_server.Gateway.close_rollout

    def keep(self, rollout_id):
        record = close(self, rollout_id)
        calls.extend(record.calls)
        return record

    monkeypatch.setattr(gateway_server.Gateway, "close_rollout", keep)
    args = ["train", "agent-tiny", "agent.entrypoint=examples.agents.openai_agent:pinned_agent", "rl.iterations=1",
            "eval.pass_at_k_samples=0", "--out", tmp_path / "run"]
    code, out, err = run_main(args, REPO, monkeypatch, capsys)
    assert code == 0 and "Traceback" not in err, err
    assert load_config("agent-tiny").eval.bc_temperatures == [1.0, 0.5, 0.1]  # the sweep ran as shipped
    told = [line for line in (out + err).splitlines() if "the agent sent" in line]
    assert told == ["warning: the agent sent temperature=1.0; the trainer samples at temperature 0.5 and its value "
                    "wins (agent.sampling=trainer; agent.sampling=strict refuses such requests)"]
    metrics = read_metrics(tmp_path / "run")
    assert [w.message for w in metrics.warnings if "the agent sent" in w.message] == [told[0].removeprefix("warning: ")]
    by_tag = [(e.tag, e.env_events["n_overridden_calls"], e.env_events["n_calls"], e.result) for e in metrics.evals]
    assert [t for t, *_ in by_tag] == ["before-rl", "bc", "bc", "after-rl"]
    for tag, overridden, n_calls, result in by_tag:  # at T=1.0 nothing to override; at 0.5 and 0.1 every call
        assert result.episodes == 8 and result.infra_failures == 0
        assert overridden == (n_calls if tag == "bc" else 0) and n_calls >= 8
    (it,) = metrics.iterations
    assert it.env_events["n_overridden_calls"] == 0 and it.rollout.infra_failures == 0
    total = sum(n for tag, n, _, _ in by_tag)
    assert total >= 16 and read_summary(tmp_path / "run").sampling_overrides == SamplingOverrides(total, total, 0, 0)
    # each overridden call was sampled, and recorded, at the trainer's temperature
    overridden = [c for c in calls if c.overrides]
    assert len(overridden) == total and {c.temperature for c in overridden} == {0.5, 0.1}
    assert all(c.overrides == (Override("temperature", 1.0, c.temperature),) for c in overridden)
