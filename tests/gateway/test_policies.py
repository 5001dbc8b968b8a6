"""Several policies in one run (agent.policies): LoRA adapters on one base, picked per call by the
request's model field, each compiled, credited and trained on its own calls; their checkpoint
serves each under its name; bad names are one line (config) or a 400 naming ``model`` (requests)."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import TINY_TEST_SHAPE, run_main

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.config import LoraConfig, TinyModelConfig
from turnforge.errors import UserError
from turnforge.gateway.agents import parse_result
from turnforge.gateway.render import RequestError
from turnforge.gateway.server import Gateway, open_replica
from turnforge.gateway.trace import CallRecord, compile_trace
from turnforge.policy.lora import adapter_parameters, add_lora, use_adapter
from turnforge.policy.model import load_policy
from turnforge.policy.tiny import build_tiny_model
from turnforge.train.credit import Credit
from turnforge.train.policies import policy_credit, policy_view
from turnforge.types import Task, Trajectory, Turn

REPO = Path(__file__).resolve().parents[2]
POLICIES = "agent.policies=[proposer,solver]"
SMALL = [f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()] + [
    "model.lora.r=4", "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=2", "eval.episodes=4",
    "eval.pass_at_k_samples=0", "eval.bc_temperatures=[]", "eval.every=0"]


def call(index, prompt, completion, policy, version=0):
    return CallRecord(index, tuple(prompt), tuple(completion), tuple(-0.5 for _ in completion), version, 1.0, "stop",
                      policy=policy)


def test_each_policy_compiles_its_own_calls_and_extends_only_its_own_samples():
    calls = [call(0, [1, 2], [3], "proposer"),
             call(1, [1, 2], [4, 5], "solver"),  # same prompt ids as the proposer's: a sample of its own all the same
             call(2, [1, 2, 3, 9], [6], "proposer"),  # extends the proposer's first call
             call(3, [1, 2, 4, 5, 7], [8], "solver")]  # extends the solver's
    got = compile_trace(calls, "t")
    assert [(s.policy, s.token_ids.tolist(), s.segment_index, s.parent_segment, s.turn_index) for s in got.samples] == [
        ("proposer", [1, 2, 3, 9, 6], 0, -1, -1), ("solver", [1, 2, 4, 5, 7, 8], 1, -1, -1)]
    assert [s.loss_mask.tolist() for s in got.samples] == [[0, 0, 1, 0, 1], [0, 0, 1, 1, 0, 1]]
    assert got.splits == ()
    one = compile_trace([call(0, [1, 2], [3], ""), call(1, [5], [6], "")], "t")  # one policy: as before
    assert [(s.policy, s.segment_index, s.parent_segment) for s in one.samples] == [("", 0, -1), ("", 1, 0)]
    assert [sp.reason for sp in one.splits] == ["new_context"]


def trajectory(tid, rewards, policies=("proposer", "solver")):
    samples = tuple(dataclasses.replace(x, turn_index=0)  # as AgentEngine makes an agent rollout one turn
                    for x in compile_trace([call(i, [1, 2], [3 + i], p) for i, p in enumerate(policies)], tid).samples)
    turn = Turn("obs", "act", 0.0, False, "", False, {})
    return Trajectory(tid, Task("agent", "x", {}), "g", 0, (turn,), samples, 9.0, False, True, False, None, 0,
                      policy_rewards=rewards)


def test_each_policy_gets_advantages_from_its_own_rewards():
    """Hand-computed: a group of two episodes; the proposer earned 1 then 0, the solver 0 then 1.
    GRPO over each policy's rewards alone gives +a/-a to the proposer and -a/+a to the solver,
    a = 0.5 / std([1, 0]) (the episode reward, 9, plays no part)."""
    cfg = load_config("agent-selfplay-tiny", [])
    a, b = trajectory("a", {"proposer": 1.0, "solver": 0.0}), trajectory("b", {"proposer": 0.0, "solver": 1.0})
    view = policy_view(a, "solver")
    assert view.episode_return == 0.0 and [s.policy for s in view.samples] == ["solver"] and view.turns[0].reward == 0.0
    assert policy_view(trajectory("c", {}, ("proposer",)), "solver") is None
    credit = policy_credit([a, b], cfg, 0, pad_id=0)
    adv = {(x.trajectory_id, x.policy): float(np.asarray(v).reshape(-1)[0]) for x, v in credit.samples}
    unit = adv[("a", "proposer")]
    assert unit > 0
    assert adv == pytest.approx({("a", "proposer"): unit, ("b", "proposer"): -unit,
                                 ("a", "solver"): -unit, ("b", "solver"): unit})
    assert isinstance(credit.by_policy["solver"], Credit) and set(credit.per_turn) == {"a@proposer", "b@proposer",
                                                                                     "a@solver", "b@solver"}
    assert credit.groups == 2 and credit.flat_groups == 0


def test_per_policy_rewards_are_checked():
    assert parse_result({"reward": 0.5, "rewards": {"solver": 1}}, "m:f", ("proposer", "solver"))[3] == {
        "proposer": 0.5, "solver": 1.0}
    with pytest.raises(UserError, match="rewards=.*map policy names \\(proposer, solver\\)"):
        parse_result({"reward": 0.5, "rewards": {"judge": 1}}, "m:f", ("proposer", "solver"))
    with pytest.raises(UserError, match="the run has one policy"):
        parse_result({"reward": 0.5, "rewards": {"solver": 1}}, "m:f")


@pytest.mark.parametrize("override,message", [
    ("agent.policies=[solver]", "name two or more distinct policies"),
    ("agent.policies=[solver,solver]", "name two or more distinct policies"),
    ("agent.policies=[a/b,c]", "policy name 'a/b' must be a letter"),
    ("model.lora.r=0", "agent.policies=\\['proposer', 'solver'\\] with model.lora.r=0"),
    ("rollout.backend=vllm", "with rollout.backend=vllm"),
])
def test_bad_policy_settings_are_one_line(tmp_path, monkeypatch, capsys, override, message):
    code, out, err = run_main(["train", "agent-selfplay-tiny", override, "--out", tmp_path / "run"], tmp_path.parent,
                              monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(message, err), err


@pytest.fixture()
def two_adapters(tmp_path):
    """A tiny policy with adapters 'proposer' and 'solver', the solver's moved off zero."""
    build_tiny_model(tmp_path / "m", TinyModelConfig(**TINY_TEST_SHAPE))
    policy = load_policy(tmp_path / "m")
    add_lora(policy, LoraConfig(r=4), 0, "rl", names=["proposer", "solver"])
    with torch.no_grad():
        for p in adapter_parameters(policy.model, "solver"):
            p.add_(0.5)
    policy.model.eval()
    return policy


def test_the_model_field_picks_the_adapter_and_a_bad_one_is_a_400(two_adapters):
    policy = two_adapters
    with Gateway(policy, max_new_tokens=4, max_context_tokens=256, temperature=1.0, policies=["proposer", "solver"]) as gw:
        url = gw.open_rollout("r")
        ask = {"messages": [{"role": "user", "content": "Which move?"}], "logprobs": True}
        with httpx.Client(base_url=url, timeout=60) as http:
            assert [m["id"] for m in http.get("/models").json()["data"]] == ["proposer", "solver"]
            bad = http.post("/chat/completions", json=ask | {"model": "judge"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
            assert "proposer, solver" in bad.json()["error"]["message"]
            missing = http.post("/responses", json={"input": "hi"})
            assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
            for name in ("proposer", "solver", "proposer"):
                answer = http.post("/chat/completions", json=ask | {"model": name}).json()
                assert answer["model"] == name
        record = gw.close_rollout("r")
        ids = {"prompts": [[1, 2, 3]], "max_new_tokens": 2, "temperature": 1.0}
        with pytest.raises(RequestError, match="names no policy"):
            gw.generate_ids(ids)  # the replica route too: never a silent pick of whichever adapter was last active
        assert len(gw.generate_ids(ids | {"model": "solver"})["generations"]) == 1
    assert [c.policy for c in record.calls] == ["proposer", "solver", "proposer"] and record.refused_calls == 2
    for c in record.calls:  # each call's logprobs are its own adapter's
        use_adapter(policy.model, c.policy)
        ids = torch.tensor([list(c.prompt_ids) + list(c.completion_ids)])
        with torch.no_grad():
            logits = policy.model(ids).logits[0, len(c.prompt_ids) - 1:-1].float()
        mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.completion_ids)[:, None])[:, 0]
        assert mine.tolist() == pytest.approx(list(c.logprobs), abs=1e-4)


@pytest.fixture()
def two_policy_agent(tmp_path, monkeypatch):
    """A module whose agent calls the proposer once and the solver twice per rollout."""
    (tmp_path / "two_policy_mod.py").write_text(textwrap.dedent('''
        import httpx

        def agent(task, base_url):
            with httpx.Client(base_url=base_url, timeout=60) as http:
                def ask(model, text):
                    r = http.post("/chat/completions", json={"model": model, "messages": [{"role": "user", "content": text}]})
                    return r.raise_for_status().json()["choices"][0]["message"]["content"] or ""
                idea = ask("proposer", "Propose a board.")
                tries = [ask("solver", f"Board {task['board']}. Which move?") for _ in range(2)]
            right = sum(task["move"].lower() in t.lower() for t in tries) / 2
            # rewards that vary from sample to sample, so that each policy's groups have some variance to learn
            # from (the tiny model rarely names the move: the solver's share right was 0 in every group once)
            return {"reward": right, "rewards": {"proposer": float(len(idea) % 3 == 0), "solver": float(len(tries[0]) % 2)}}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("two_policy_mod", None)
    return "two_policy_mod:agent"


def test_two_adapters_train_checkpoint_resume_and_serve(tmp_path, two_policy_agent, recorded):
    from turnforge.view.data import RunView
    from turnforge.view.rundir import read_series

    overrides = SMALL + [f"agent.entrypoint={two_policy_agent}", f"agent.tasks={REPO / 'examples/agents/moves.jsonl'}", POLICIES]
    cfg = load_config("agent-tiny", overrides)
    assert train(cfg, tmp_path / "run", live=False, stop_after=1) is None  # stops after RL iteration 1, checkpointed
    summary = train(cfg, tmp_path / "run", resume=True, live=False)
    assert summary.rl_iterations == 2 and set(summary.policies) == {"proposer", "solver"}
    for name, p in summary.policies.items():  # both adapters moved, and trained on their own calls
        assert p.adapter_change > 0 and p.train_tokens > 0 and p.calls == 8 * (1 if name == "proposer" else 2)
    iters = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    iters = [m for m in iters if m["event"] == "rl_iter"]
    assert [sorted(m["policies"]) for m in iters] == [["proposer", "solver"]] * 2
    assert all(m["update"]["tokens"] == sum(p["update"]["tokens"] for p in m["policies"].values()) for m in iters)
    rows = [r for f in sorted((tmp_path / "run" / "trajectories").glob("rl_*.parquet")) for r in pq.read_table(f).to_pylist()]
    mismatches = 0
    for tid in {r["trajectory_id"] for r in rows}:  # every policy's trained tokens are exactly what it sampled
        for name in ("proposer", "solver"):
            mine = [r for r in rows if r["trajectory_id"] == tid and r["policy"] == name]
            sampled = [t for c in recorded[tid].calls if c.policy == name for t in c.completion_ids]
            trained = [t for r in mine for t, m in zip(r["token_ids"], r["loss_mask"]) if m]
            mismatches += trained != sampled
            assert all(r["advantage"] is not None for r in mine)
    assert mismatches == 0
    series, _ = read_series(tmp_path / "run" / "metrics.jsonl")  # the viewer plots each policy's figures
    assert {"policies.proposer.reward", "policies.solver.update.loss"} <= set(series["rl_iter"].columns)
    view = RunView(tmp_path / "run")
    assert set(view.overview().summary["policies"]) == {"proposer", "solver"}
    view.close()

    final = tmp_path / "run" / "checkpoints" / "final"
    assert sorted(p.name for p in (final / "adapter").iterdir() if p.is_dir()) == ["proposer", "solver"]
    from turnforge.merge.checkpoints import check_parent
    from turnforge.train.evaluate import load_for_eval

    with pytest.raises(UserError, match="holds 2 policies \\(proposer, solver\\).*adapter/proposer with --base"):
        check_parent(final, "member 1", base=None)  # its weights are the base, not a policy: never merged silently
    with pytest.raises(UserError, match="holds 2 policies.*serve it"):
        load_for_eval(cfg, final)
    gw = open_replica(final, host="127.0.0.1", port=0, max_tokens=4, context=256, dtype="float32", device="cpu", seed=0,
                      threads=1, prefix_cache=False)
    with gw, httpx.Client(base_url=f"{gw.url}/v1", timeout=60) as http:
        assert [m["id"] for m in http.get("/models").json()["data"]] == ["proposer", "solver"]
        ask = {"messages": [{"role": "user", "content": "Board __.^#_. Which move?"}]}
        for name in ("proposer", "solver"):
            assert http.post("/chat/completions", json=ask | {"model": name}).json()["model"] == name
        assert http.post("/chat/completions", json=ask | {"model": "nobody"}).status_code == 400


def test_the_self_play_example_reads_a_board_from_any_reply(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.agents.selfplay_agent import board_of

    assert board_of("no board here") is None
    assert board_of(">") == ">_____"
    assert board_of("_.^#_<.") == "_.^#_."  # later arrows dropped
    assert board_of("#_.#_.__^..") == "#_.#_^"  # the arrow kept however late it comes
