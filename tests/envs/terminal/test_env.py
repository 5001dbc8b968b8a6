"""The terminal env: episodes, the verifier, the guarantees (each with an attack), snapshots, both
action formats, Harbor task directories (read, checked, refused) and the env.tasks hook."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from turnforge.envs import make
from turnforge.envs.registry import build_env
from turnforge.envs.terminal.check import check_task
from turnforge.envs.terminal.harbor import TaskRefused, read_task
from turnforge.envs.terminal.task import TaskFile, TerminalTask
from turnforge.envs.terminal.verify import VerifierError, verify
from turnforge.errors import UserError
from turnforge.sandbox.box import BOXES
from turnforge.types import Task

pytestmark = pytest.mark.skipif(BOXES["bwrap"].unavailable() is not None, reason="needs bubblewrap (apt-get install -y bubblewrap)")
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "harbor"


def _play(env, actions):
    results = []
    for a in actions:
        results.append(env.step(a))
        if results[-1].terminated or results[-1].truncated:
            break
    return results


def _expert(env):
    steps = [env.step(env.expert_action())]
    while not steps[-1].terminated:
        steps.append(env.step(env.expert_action()))
    return steps


@pytest.fixture
def env():
    e = make("terminal", max_turns=6, command_timeout_s=2)
    yield e
    e.close()


def test_the_expert_solves_and_doing_nothing_fails(env):
    for i in range(3):
        task = env.task("train", i)
        env.reset(task, 0)
        steps = []
        while not steps or not steps[-1].terminated:
            steps.append(env.step(env.expert_action()))
        assert steps[-1].reward == 1.0 and steps[-1].success, task.data
        env.reset(task, 0)
        done = env.step("submit")
        assert done.terminated and done.reward == 0.0 and not done.success


def test_the_observation_is_output_exit_code_and_cwd(env):
    env.reset(env.task("train", 0), 0)
    r = env.step("mkdir -p d && cd d && echo hi && false")
    assert r.observation == "hi\n[exit 1] /app/d$" and not r.invalid_action and r.info["n_commands"] == 1
    assert env.step("pwd").observation == "/app/d\n[exit 0] /app/d$"  # the shell persists


def test_tests_and_solution_are_unreadable_before_verification(env):
    env.reset(env.task("train", 0), 0)
    assert "No such file" in env.step("cat /tests/test.sh /tests/check.py").observation
    assert "No such file" in env.step("ls /solution /logs").observation


def test_no_network_and_only_the_workspace_is_writable(env):
    env.reset(env.task("train", 0), 0)
    r = env.step("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"")
    assert "[exit 1]" in r.observation and "Error" in r.observation
    for path in ("/etc/x", "/usr/x", "/x", "/var/x"):
        assert "[exit 1]" in env.step(f"touch {path}").observation
    assert "[exit 0]" in env.step("touch /app/ok /tmp/ok").observation


@pytest.mark.parametrize("attack, counter", [
    ("sleep 100", "n_timeouts"),                                     # a command that never ends
    (":(){ :|:& };:", "n_limits"),                                   # a fork bomb
    ("dd if=/dev/zero of=/app/big bs=1M count=100000", "n_limits"),  # a disk filler
])
def test_attacks_are_contained_and_counted_as_the_agents_doing(env, attack, counter):
    env.reset(env.task("train", 0), 0)
    r = env.step(attack)
    assert not r.terminated and r.info[counter] == 1 and "[" in r.observation
    assert env.step("echo alive").observation.startswith("alive")  # the episode goes on
    done = env.step("submit")
    assert done.terminated and done.reward == 0.0  # verified, scored as the agent's failure, not an infrastructure one


def test_a_background_process_is_gone_after_the_episode(env):
    env.reset(env.task("train", 0), 0)
    env.step("sleep 1000 & echo started")
    pids = subprocess.run(["pgrep", "-f", "sleep 1000"], capture_output=True, text=True).stdout.split()
    assert pids
    env.step("submit")
    left = subprocess.run(["pgrep", "-f", "sleep 1000"], capture_output=True, text=True).stdout.split()
    assert not set(left) & set(pids)


def test_invalid_shell_text_changes_nothing(env):
    env.reset(env.task("train", 0), 0)
    r = env.step("echo (")
    assert r.invalid_action and "syntax error" in r.observation and env.episode.turns == 0
    assert env.step("").invalid_action
    assert env.step("echo a\0b").invalid_action and env.episode.turns == 0  # (a model can sample a NUL byte)


def test_the_turn_limit_ends_and_verifies(env):
    env.reset(env.task("train", 0), 0)
    steps = _play(env, ["true"] * 6)
    assert len(steps) == 6 and steps[-1].terminated and steps[-1].info["n_unsubmitted"] == 1


def test_snapshot_restore_round_trips_files_cwd_and_variables(env):
    env.reset(env.task("train", 0), 0)
    env.step("mkdir -p w && cd w && echo one > f && export X=1")
    snap = env.snapshot()
    env.step("echo two > f && cd / && export X=2 && touch /app/new")
    env.restore(snap)
    assert env.step("cat f; echo $X; ls /app/new").observation.startswith("one\n1\n")
    assert env.episode.turns == 2


def test_the_bash_tool_call_format(tmp_path):
    env = make("terminal", action_format="tool", max_turns=4)
    try:
        assert [t["function"]["name"] for t in env.tools] == ["bash", "submit"] and env.observation_role == "tool"
        env.reset(env.task("train", 0), 0)
        r = env.step('<tool_call>{"name": "bash", "arguments": {"command": "echo hi"}}</tool_call>')
        assert r.observation == "hi\n[exit 0] /app$"
        assert env.step('<tool_call>{"name": "bash", "arguments": {}}</tool_call>').invalid_action
        assert env.step('<tool_call>{"name": "submit", "arguments": {}}</tool_call>').terminated
    finally:
        env.close()


def _task(**kw) -> TerminalTask:
    base = TerminalTask(name="t", instruction="Write 42 to /app/a.txt.",
                        tests=(TaskFile("/tests/test.sh", b"grep -qx 42 /app/a.txt && echo 1 > /logs/verifier/reward.txt "
                                        b"|| echo 0 > /logs/verifier/reward.txt\n"),),
                        expert_commands=("echo 42 > a.txt",))
    return replace(base, **kw)


def test_a_verifier_that_writes_no_reward_is_an_infrastructure_failure():
    from turnforge.sandbox.box import open_box
    from turnforge.envs.terminal.verify import box_spec

    with open_box(box_spec(_task())) as box:
        final = box.snapshot()
    with pytest.raises(VerifierError, match="wrote neither"):
        verify(_task(tests=(TaskFile("/tests/test.sh", b"exit 3\n"),)), final)
    with pytest.raises(VerifierError, match="not a number"):
        verify(_task(tests=(TaskFile("/tests/test.sh", b"echo x > /logs/verifier/reward.txt\n"),)), final)
    assert check_task(_task()).problem is None
    assert "scores 0" in check_task(_task(expert_commands=("echo 41 > a.txt",))).problem


# ---------------------------------------------------------------------- Harbor task directories
def test_the_example_harbor_tasks_score_1_with_their_solution_and_0_untouched():
    for d in sorted(EXAMPLES.iterdir()):
        found = check_task(read_task(d))
        assert found.problem is None and found.reference == 1.0 and found.nothing == 0.0, found


def test_env_tasks_reads_a_harbor_directory_and_plays_it():
    env = build_env("terminal", {"max_turns": 4}, tasks=str(EXAMPLES), heldout_fraction=1.0)
    try:
        task = env.task("heldout", 0)
        assert task.data["source"] == "harbor" and env.task_source().size("heldout") == 2
        env.reset(task, 0)
        assert _expert(env)[-1].reward == 1.0
    finally:
        env.close()


def _harbor(tmp_path: Path, dockerfile: str = "FROM debian:12\nWORKDIR /app\n", test_sh: str = "echo 1 > /logs/verifier/reward.txt\n",
            toml: str = 'version = "1.0"\n', name: str = "t") -> Path:
    root = tmp_path / name
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "instruction.md").write_text("Do it.\n")
    (root / "task.toml").write_text(toml)
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    (root / "tests" / "test.sh").write_text(test_sh)
    return root


@pytest.mark.parametrize("dockerfile, test_sh, says", [
    ("FROM node:20\nWORKDIR /app\n", "", "environment/Dockerfile line 1: FROM node:20 needs another system"),
    ("FROM python:3.13\nWORKDIR /app\nRUN pip install numpy==2.3.0\n", "", "line 3: pip install numpy==2.3.0 needs the network"),
    ("FROM debian:12\nWORKDIR /app\nRUN git clone https://x.org/r.git\n", "", "line 3: 'git clone' needs the network"),
    ("FROM debian:12\nWORKDIR /app\nRUN apt-get install -y no-such-package-tf\n", "", "apt-get install of no-such-package-tf"),
    ("FROM debian:12\nWORKDIR /app\nENTRYPOINT [\"nginx\"]\n", "", "line 3: ENTRYPOINT"),
    ("FROM debian:12\nWORKDIR /app\nUSER agent\n", "", "line 3: USER agent"),
    ("FROM debian:12\n", "", "sets no WORKDIR"),
    ("FROM debian:12\nWORKDIR /app\nCOPY x /usr/local/bin/x\n", "", "source 'x' is not a file"),
    ("FROM debian:12\nWORKDIR /app\n", "uvx -w numpy==2.3.3 pytest /tests/t.py\n", "tests/test.sh line 1: uvx --with numpy==2.3.3"),
    ("FROM debian:12\nWORKDIR /app\n", "curl -o x https://example.com/x\n", "tests/test.sh line 1: 'curl -o x https://example.com/x'"),
])
def test_a_task_this_host_cannot_run_is_refused_naming_the_task_file_and_line(tmp_path, dockerfile, test_sh, says):
    with pytest.raises(TaskRefused, match=f"task t: .*{says}".replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_task(_harbor(tmp_path, dockerfile, test_sh or "echo 1 > /logs/verifier/reward.txt\n"))


def test_missing_files_and_malformed_toml_are_one_line_each(tmp_path):
    root = _harbor(tmp_path)
    (root / "instruction.md").unlink()
    with pytest.raises(TaskRefused, match="task t: instruction.md is missing"):
        read_task(root)
    with pytest.raises(TaskRefused, match="task u: task.toml is malformed TOML"):
        read_task(_harbor(tmp_path, toml="version = \n", name="u"))
    with pytest.raises(UserError, match="no \\[metadata\\] split; set env.heldout_fraction"):
        build_env("terminal", tasks=str(_harbor(tmp_path, name="v")))


def test_the_offline_stand_ins_answer_what_the_host_has():
    task = _task(tests=(TaskFile("/tests/test.sh", b"apt-get install -y bash && pip install pytest && uvx -p 3.13 -w pytest "
                                                   b"pytest --version && echo 1 > /logs/verifier/reward.txt\n"),))
    from turnforge.sandbox.box import open_box
    from turnforge.envs.terminal.verify import box_spec

    with open_box(box_spec(task)) as box:
        final = box.snapshot()
    assert verify(task, final).reward == 1.0


def test_a_valid_injected_bug_becomes_a_repair_task_the_expert_solves():
    from turnforge.envs.terminal.sources import build_task

    env = make("terminal", source="selfplay", max_turns=6)
    try:
        task = env.task("train", 3)
        assert task.data["source"] == "inject"
        env.reset(task, 0)
        steps = _expert(env)
        assert steps[-1].success and "def " in steps[-1].info["injected_module"]
        repair = {"source": "injected", "seed": task.data["seed"], "module": steps[-1].info["injected_module"]}
        assert build_task(repair).expert_commands[-1].startswith("python3 - <<'EOF'")
        env.reset(Task("terminal", "train", 2**41, repair), 0)
        steps = _expert(env)
        assert steps[-1].success and steps[-1].reward == 1.0
        env.reset(task, 0)  # an injected change the tests do not catch is no bug
        assert _play(env, ["sed -i '1s/^/# a comment\\n/' pkg/*.py", "submit"])[-1].reward == 0.0
    finally:
        env.close()
