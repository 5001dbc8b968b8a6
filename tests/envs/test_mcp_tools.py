"""Env mcp-tools: one MCP server per episode in the sandbox, its tools in the chat template,
state never shared between episodes, a crash or a hang as an infrastructure failure, and
no process or file left behind by 64 concurrent episodes."""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from turnforge.envpool import InlineEnvs
from turnforge.envs.registry import build_env
from turnforge.envs.tool.mcp_tools import McpServerError
from turnforge.errors import UserError
from turnforge.types import Task

ROOT = Path(__file__).resolve().parents[2]
PROBE = str(Path(__file__).with_name("mcp") / "probe_server.py")
INVENTORY = str(ROOT / "examples" / "mcp" / "inventory_server.py")
TASKS = str(ROOT / "examples" / "mcp" / "inventory_tasks.jsonl")


def call(name, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def probe_env(**kwargs):
    return build_env("mcp-tools", {"server": "python probe_server.py", "server_files": [PROBE], "max_tool_calls": 8, **kwargs})


def task(index: int = 0, **data) -> Task:
    return Task("mcp-tools", "train", index, {"question": "What is the counter?", "answer": "1", **data})


def test_tools_come_from_the_server_and_render_in_the_chat_template(tiny_model_dir):
    env = build_env("mcp-tools", {"server": "python inventory_server.py", "server_files": [INVENTORY]}, tasks=TASKS)
    names = [t["function"]["name"] for t in env.tools]
    assert names == ["count", "restock"]
    assert env.tools[0]["function"]["parameters"]["required"] == ["item"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=list(env.tools), tokenize=False)
    assert '"name": "count"' in text and '"name": "restock"' in text
    # an expert episode: the server holds the task's stock; the answer is scored
    first = env.tasks.task("train", 0)
    assert env.reset(first, 0) == first.data["question"]
    r = env.step(env.expert_action())
    assert r.observation == first.data["answer"] and r.info["n_tool_calls"] == 1
    r = env.step(env.expert_action())
    assert r.terminated and r.success and r.reward == 1.0
    assert env._server is None  # torn down with the episode
    env.close()


def test_bad_arguments_are_invalid_actions_and_tool_errors_are_observations():
    env = build_env("mcp-tools", {"server": "python inventory_server.py", "server_files": [INVENTORY]}, tasks=TASKS)
    env.reset(env.tasks.task("train", 1), 0)
    r = env.step(call("count", itemx="pears"))
    assert r.invalid_action and "'item' is a required property" in r.observation
    r = env.step(call("count", item="bananas"))
    assert not r.invalid_action and r.info["n_tool_errors"] == 1 and "unknown item 'bananas'" in r.observation
    r = env.step(call("restock", item="pears", amount="many"))
    assert r.invalid_action and "amount: 'many' is not of type 'integer'" in r.observation
    env.close()


def test_two_concurrent_episodes_never_see_each_others_server():
    a, b = probe_env(), probe_env()
    barrier = threading.Barrier(2)

    def episode(env, name):
        env.reset(task(start=10), 0)
        barrier.wait()
        bumps = [env.step(call("bump")).observation for _ in range(2)]
        env.step(call("write", path="/tmp/owner", text=name))
        barrier.wait()  # both have written /tmp/owner
        return bumps, env.step(call("read", path="/tmp/owner")).observation, env._server.proc.pid

    with ThreadPoolExecutor(2) as pool:
        (bumps_a, owner_a, pid_a), (bumps_b, owner_b, pid_b) = pool.map(episode, (a, b), ("a", "b"))
    assert bumps_a == bumps_b == ["11", "12"]  # each counter started at the task's 10, alone
    assert (owner_a, owner_b) == ("a", "b")  # each has its own /tmp
    assert pid_a != pid_b
    # the host's files are not visible; a new episode starts a new server with fresh state
    assert "cannot read" in a.step(call("read", path=str(ROOT / "README.md"))).observation
    a.reset(task(start=0), 1)
    assert a.step(call("bump")).observation == "1"
    assert "cannot read" in a.step(call("read", path="/tmp/owner")).observation
    a.close(), b.close()


@pytest.mark.parametrize("tool, message", [("crash", "exited during tools/call (exit 3)"),
                                           ("hang", "did not answer tools/call within 1 s")])
def test_a_server_that_crashes_or_hangs_is_an_infrastructure_failure(tool, message):
    env = probe_env(call_timeout_s=1.0)
    env.reset(task(), 0)
    with pytest.raises(McpServerError, match=re.escape(message)):
        env.step(call(tool))
    assert env._server is None or not env._server.proc.alive
    # through an env backend: a failed result (the rollout drops the episode), never a reward
    backend = InlineEnvs.from_envs([env])
    backend.send_reset([0], [0], [task()])
    assert backend.recv()[0].status == "ok"
    backend.send_step([0], [call(tool)])
    result = backend.recv()[0]
    assert result.status == "failed" and "McpServerError" in result.error and message in result.error
    backend.close()


def test_a_server_that_does_not_start_is_one_line_at_construction(tmp_path):
    with pytest.raises(UserError, match=r"mcp-tools: MCP server '.*missing\.py' exited during initialize \(exit 2\): .*No such file"):
        build_env("mcp-tools", {"server": "python missing.py"})
    with pytest.raises(UserError, match=r"mcp-tools: .*'/usr/bin/false' exited during initialize \(exit 1\)"):
        build_env("mcp-tools", {"server": "/usr/bin/false"})
    with pytest.raises(UserError, match="server_files entry 'nope.py' is not a file"):
        build_env("mcp-tools", {"server": "python nope.py", "server_files": ["nope.py"]})
    with pytest.raises(UserError, match="server is empty"):
        build_env("mcp-tools", {"server": ""})
    junk = tmp_path / "junk.py"
    junk.write_text("print('hello')\n")
    with pytest.raises(UserError, match="wrote a line that is not JSON-RPC to stdout: b'hello'"):
        build_env("mcp-tools", {"server": "python junk.py", "server_files": [str(junk)]})
    env = probe_env()
    with pytest.raises(UserError, match="reads its tasks from a file: set env.tasks"):
        env.reset(None, 0)


HOLD_SLOT = """
import sys, time
from turnforge.sandbox.gate import StartGate
with StartGate(1).slot():
    print("held", flush=True)
    time.sleep(float(sys.argv[1]))
"""


@pytest.mark.slow
def test_a_start_queued_behind_other_starts_is_not_timed_out():
    """The queue before a start is not part of its start timeout: with the one slot held by
    another process for longer than startup_timeout_s, the start waits and then succeeds."""
    import subprocess
    import sys
    import time

    env = probe_env(max_starting=1)
    began = time.monotonic()
    env.reset(task(), 0)  # one start on this machine, now, sizes the timeout below
    one_start = time.monotonic() - began
    env.close()
    timeout = max(10.0, 10 * one_start)  # the load may change between the two starts
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SLOT, str(timeout + 1)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env.startup_timeout_s = timeout
        began = time.monotonic()
        env.reset(task(start=5), 1)
        assert time.monotonic() - began > timeout  # it did wait longer than its timeout ...
        assert env.step(call("bump")).observation == "6"  # ... and the server is up
        assert holder.poll() is not None or holder.wait(timeout=30) == 0
    finally:
        holder.kill()
        env.close()


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_64_concurrent_episodes_leave_no_process_or_open_file():
    envs = [build_env("mcp-tools", {"server": "python inventory_server.py", "server_files": [INVENTORY]}, tasks=TASKS)
            for _ in range(64)]
    base_children, base_fds = _children(), _open_fds()
    barrier = threading.Barrier(64)
    alive = []

    def episode(i: int) -> bool:
        env = envs[i]
        env.reset(env.tasks.task("train", i), i)
        barrier.wait(timeout=300)
        alive.append(env._server.proc.alive)
        env.step(env.expert_action())
        return env.step(env.expert_action()).success

    with ThreadPoolExecutor(64) as pool:
        wins = list(pool.map(episode, range(64)))
    assert len(alive) == 64 and all(alive)  # 64 servers were up at once
    assert all(wins)
    for env in envs:
        env.close()
    assert _children() == base_children
    assert _open_fds() == base_fds


def test_check_env_passes():
    from turnforge.envs import check_env

    check_env("mcp-tools", env_kwargs={"server": "python inventory_server.py", "server_files": [INVENTORY]}, tasks=TASKS,
              quick=True)
