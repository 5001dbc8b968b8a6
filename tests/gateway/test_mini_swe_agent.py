"""mini-swe-agent (PyPI, its code unmodified) as a gateway agent on terminal tasks
(``turnforge.envs.terminal.harness``, ``examples/agents/mini_swe_agent.py``): its Environment
protocol on the terminal env's box (fresh shell per command, timeouts, its submission rule), the
verifier's reward (a verifier failure raises), and, through a real gateway on the tiny model,
episodes whose every sampled token is trained exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import TINY_TEST_SHAPE, WrittenCalls, assert_rescores

from turnforge.sandbox.box import BOXES, regular_files

pytest.importorskip("minisweagent", reason="needs: pip install --no-deps mini-swe-agent platformdirs (make setup)")
pytestmark = pytest.mark.skipif(BOXES["bwrap"].unavailable() is not None, reason="needs bubblewrap (apt-get install -y bubblewrap)")

from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import (
    DeterministicToolcallModel,
    make_toolcall_output,
)

from turnforge.envs.terminal import harness, sources
from turnforge.envs.terminal.env import expert_commands
from turnforge.envs.terminal.generated import build_task
from turnforge.envs.terminal.verify import VerifierError

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "agents" / "terminal_tasks.jsonl"
ENTRYPOINT = "examples.agents.mini_swe_agent:agent"
MARK = "echo BOX_MARK_$((6*7)) | tee /tmp/agent_mark && ls /app"  # 42 only if a shell ran it; /app is the box's


def _tasks() -> list[dict]:
    return [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]


def _bash(i: int, command: str) -> dict:
    """A reply of mini-swe-agent's own scripted tool-call model: one bash call."""
    call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return make_toolcall_output(None, [call], [{"command": command, "tool_call_id": f"c{i}"}])


def _scripted(*commands: str) -> DeterministicToolcallModel:
    return DeterministicToolcallModel(outputs=[_bash(i, c) for i, c in enumerate(commands)],
                                      observation_template=harness.load_prompts("mini").observation_template)


@pytest.fixture()
def verified(monkeypatch):
    """Every verifier call of the harness: (task, final snapshot, verdict)."""
    calls = []
    real = harness.verify

    def spy(task, final, *args):
        calls.append((task, final, verdict := real(task, final, *args)))
        return verdict

    monkeypatch.setattr(harness, "verify", spy)
    return calls


# ------------------------------------------------------------------ the adapter (mini-swe-agent's scripted model)
@pytest.mark.parametrize("text, code, submission", [
    ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 0, ""),
    ("\n  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a/x\n", 0, "diff --git a/x\n"),
    ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 1, None),
    ("done\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 0, None),
    ("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT now\n", 0, None),
])
def test_the_submission_rule_is_mini_swe_agents_own(text, code, submission):
    output = {"output": text, "returncode": code, "exception_info": ""}
    for check in (harness.check_submitted, LocalEnvironment()._check_finished):
        if submission is None:
            check(output)
            continue
        with pytest.raises(Submitted) as got:
            check(output)
        assert got.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": submission}


def test_commands_run_in_the_box_each_in_a_fresh_shell_and_the_verifier_scores_the_submission(verified):
    data = _tasks()[0]
    task = build_task(data)
    solve = " && ".join(expert_commands(task))
    result = harness.run_task(data, _scripted(
        f"{MARK} && cd /tmp && export X=1",
        "pwd; echo ${X:-unset} $PAGER",  # cd and export did not carry over; the prompt set's variables are set
        "sleep 5",
        solve,
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
        "echo never run",
    ), harness.MiniSweConfig(command_timeout_s=1))
    observations = [json.loads(m["content"]) for m in result.messages if m["role"] == "tool"]
    first_file = Path(task.files[0].path).relative_to("/app").parts[0]
    assert observations[0]["returncode"] == 0 and "BOX_MARK_42" in observations[0]["output"]
    assert first_file in observations[0]["output"].split() and not Path("/app", first_file).exists()  # the box's /app
    assert observations[1] == {"returncode": 0, "output": "/app\nunset cat\n"}
    assert observations[2]["returncode"] == -1 and "timed out after 1 seconds" in observations[2]["exception_info"]
    assert observations[2]["output"] == ""  # the box shell's "Killed <wrapper>" line is not shown
    assert result.exit_status == "Submitted" and result.n_model_calls == 5 and result.n_commands == 5
    assert result.messages[-1]["role"] == "exit" and result.n_timeouts == 1
    ((got_task, final, verdict),) = verified
    assert got_task == task and regular_files(final.files)["tmp/agent_mark"] == b"BOX_MARK_42\n"
    assert result.reward == verdict.reward == 1.0 and result.success


def test_a_run_that_stops_without_submitting_is_verified_all_the_same(verified):
    data = _tasks()[1]
    result = harness.run_task(data, _scripted("ls", "echo a\0b", "echo never run"), harness.MiniSweConfig(step_limit=2))
    assert result.exit_status == "LimitsExceeded" and result.n_commands == 2
    nul = json.loads([m for m in result.messages if m["role"] == "tool"][1]["content"])
    assert nul["returncode"] == 2 and "NUL byte; nothing was run" in nul["output"]  # the box refuses it: the agent's doing
    ((_, _, verdict),) = verified
    assert result.reward == verdict.reward == 0.0 and not result.success


def test_a_verifier_that_gives_no_reward_raises(monkeypatch):
    from dataclasses import replace

    real = sources.BUILDERS["generated"]
    monkeypatch.setitem(sources.BUILDERS, "generated",
                        lambda d: replace(real(d), name=real(d).name + "-broken", test_command="true"))
    with pytest.raises(VerifierError, match="wrote neither"):
        harness.run_task(_tasks()[2], _scripted("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"))


def test_prompt_sets_for_tool_calls_load_and_others_are_refused():
    from turnforge.errors import UserError

    for name in ("mini", "benchmarks/swebench"):
        assert "{{task}}" in harness.load_prompts(name).agent["instance_template"].replace(" ", "")
    with pytest.raises(UserError, match="not found; give a YAML path or one of .*mini"):
        harness.load_prompts("no_such_set")
    for name in ("mini_textbased", "default", "benchmarks/swebench_backticks", "benchmarks/swebench_xml"):
        with pytest.raises(UserError, match="asks for actions in text blocks"):
            harness.load_prompts(name)


# ------------------------------------------------------------------ through a real gateway, the tiny model
def _assert_trained_as_sampled(samples, calls) -> None:
    """The trained tokens (loss mask 1) of a rollout's samples, in order, are exactly the tokens
    its gateway calls sampled, with their logprobs (as tests/gateway/test_agents.py checks)."""
    masks = [np.asarray(s.loss_mask, dtype=bool) for s in samples]
    tokens = [t for s, m in zip(samples, masks) for t in np.asarray(s.token_ids)[m].tolist()]
    logprobs = [x for s, m in zip(samples, masks) for x in np.asarray(s.logprobs)[m].tolist()]
    assert tokens == [t for c in calls for t in c.completion_ids]
    assert logprobs == pytest.approx([x for c in calls for x in c.logprobs], abs=1e-6)


def test_mini_swe_agent_runs_through_the_gateway_in_the_box_and_trains_token_exactly(tmp_path, tiny_policy, recorded,
                                                                                      verified, monkeypatch):
    """Two rollouts of the example agent on a real gateway (the tiny model): in one the first and
    last answers are written (a bash call that solves the task and marks the box, then the submit
    command) and the model samples the one between; the other is the model's alone (no valid
    tool call, so it ends after 3 format errors). Each reward is the verifier's; every sampled
    token is trained, exactly, and re-scores to its logprob."""
    from turnforge.app.config import load_config
    from turnforge.gateway.agents import AgentEngine, AgentTasks, load_agent
    from turnforge.gateway.render import decode
    from turnforge.rollout.actors import PolicyActor
    from turnforge.rollout.engine import EpisodeRequest

    monkeypatch.chdir(REPO)
    cfg = load_config("mini-swe-agent-tiny", [f"agent.tasks={TASKS}", "rollout.max_new_tokens=256"])  # room for the written calls
    tasks = AgentTasks(str(TASKS))
    requests = [EpisodeRequest(tasks.task("train", i), i, f"g{i}", f"r{i}") for i in range(2)]
    solve = " && ".join(expert_commands(build_task(requests[0].task.data)))

    def call(command: str) -> str:
        return '<tool_call>' + json.dumps({"name": "bash", "arguments": {"command": command}}) + '</tool_call>'

    actor = WrittenCalls(PolicyActor(tiny_policy, 256, 1.0, torch.Generator().manual_seed(0)), tiny_policy,
                          {"r0": [call(f"{solve} && {MARK}"), None, call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]})
    engine = AgentEngine(cfg, tiny_policy, tmp_path, tasks, load_agent(ENTRYPOINT))
    try:
        trajs, stats = engine.play(requests, actor)
    finally:
        engine.close()
    assert stats.infra_failures == 0 and [t.infra_failure for t in trajs] == [None, None]
    solved, alone = trajs
    # the reward is the verifier's on the box's final workspace
    verdicts = {task.name: (final, verdict) for task, final, verdict in verified}
    assert len(verdicts) == 2
    for t in trajs:
        assert t.episode_return == verdicts[build_task(t.task.data).name][1].reward
    assert solved.episode_return == 1.0 and solved.success and alone.episode_return == 0.0
    final, _ = verdicts[build_task(solved.task.data).name]
    assert regular_files(final.files)["tmp/agent_mark"] == b"BOX_MARK_42\n"  # the agent's command ran in the box
    # the command's output came back to the model: in the third call's prompt, as mini.yaml's JSON observation
    calls = recorded["r0"].calls
    assert len(calls) == 3 and "BOX_MARK_42" in decode(tiny_policy.tokenizer, calls[2].prompt_ids)
    info = solved.turns[0].info
    assert (info["n_calls"], info["agent_submitted"], info["agent_commands"], info["agent_format_errors"]) == (3, 1, 2, 1)
    info = alone.turns[0].info
    assert (info["n_calls"], info["agent_submitted"], info["agent_commands"], info["agent_format_errors"]) == (3, 0, 0, 3)
    # token-exact: every sampled token trained, with its logprob, re-scoring under the model
    for t in trajs:
        _assert_trained_as_sampled(t.samples, recorded[t.trajectory_id].calls)
    assert_rescores(tiny_policy, [s for t in trajs for s in t.samples])


def test_a_prompt_over_the_gateways_context_budget_ends_the_run_and_the_workspace_is_still_verified(tiny_policy, verified):
    from turnforge.gateway.server import Gateway

    with Gateway(tiny_policy, max_new_tokens=8, max_context_tokens=1024, temperature=1.0, seed=0) as gw:
        config = harness.MiniSweConfig()
        result = harness.run_task(_tasks()[0], harness.gateway_model(gw.open_rollout("r"), config), config)
        record = gw.close_rollout("r")
    assert result.exit_status == "ContextWindowExceeded" and record.calls == [] and record.refused_calls == 1
    assert len(verified) == 1 and result.reward == 0.0


@pytest.mark.slow
def test_the_recipe_trains_an_iteration_and_the_parquet_holds_what_was_sampled(tmp_path, recorded, monkeypatch):
    from turnforge.app.config import load_config
    from turnforge.app.run import train

    monkeypatch.chdir(REPO)
    overrides = [f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()] + [
        "rl.iterations=1", "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=2", "eval.bc_temperatures=[]",
        "rollout.max_new_tokens=64"]
    summary = train(load_config("mini-swe-agent-tiny", overrides), tmp_path / "run", live=False)
    assert summary.rl_iterations == 1 and summary.env_id == "agent"
    rows = pq.read_table(tmp_path / "run" / "trajectories" / "rl_00000.parquet").to_pylist()
    tids = sorted({r["trajectory_id"] for r in rows})
    assert len(tids) == 4 and all(r["infra_failure"] is None for r in rows)
    for tid in tids:
        mine = sorted((r for r in rows if r["trajectory_id"] == tid), key=lambda r: r["segment_index"])
        assert len(recorded[tid].calls) >= 1
        _assert_trained_as_sampled([_Row(r) for r in mine], recorded[tid].calls)
    events = [json.loads(line)["env_events"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "rl_iter"]
    assert len(events) == 1 and events[0]["n_calls"] >= 4


class _Row:
    """A Parquet row as a sample's arrays."""

    def __init__(self, row: dict) -> None:
        self.token_ids, self.loss_mask, self.logprobs = row["token_ids"], row["loss_mask"], row["logprobs"]

