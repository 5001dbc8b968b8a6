"""Every hint an error line gives, followed: each test makes the error happen through the real
command line, reads the fix off the line, does what it says, and shows that it works (the bad
input cases themselves are in test_bad_input.py; the browser's temporary directory and MiniWoB
tasks without an expert in tests/envs/test_miniwob.py)."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import torch

from helpers import TINY_TEST_SHAPE, run_main


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ---------------------------------------------------------------------- turnforge serve
def _serve(args, tmp_path, monkeypatch, capsys, while_serving):
    """``turnforge serve ARGS`` in this process; ``while_serving(base_url)`` runs once it serves
    (in place of its wait for Ctrl-C), then Ctrl-C stops it. (exit code, stderr)."""
    from turnforge import cli

    real_sleep, threads = time.sleep, torch.get_num_threads()

    def ctrl_c(seconds):
        if seconds != 3600:  # (someone else's sleep)
            return real_sleep(seconds)
        while_serving(re.search(r" on (http://\S+/v1) ", capsys.readouterr().out).group(1))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", ctrl_c)
    try:
        code, _, stderr = run_main(["serve", *args], tmp_path, monkeypatch, capsys)
    finally:
        torch.set_num_threads(threads)  # serve takes every core
    return code, stderr


def test_serve_hints_a_free_port_and_the_context_flag(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A port in use: the line's own fix (--port 0) serves on a free port; a prompt over the budget:
    the 400 names --context, and --context above the prompt's length serves it."""
    messages = [{"role": "user", "content": "go up, then left, then down, then right, " * 4}]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, stderr = _serve([tiny_model_dir, "--port", port], tmp_path, monkeypatch, capsys, lambda url: None)
    line = _one_line(stderr)
    assert code == 2 and f"port {port} on 127.0.0.1 is in use; give another --port, or --port 0 for a free one" in line

    seen = {}

    def ask(url):
        seen["port"] = int(url.rsplit(":", 1)[1].split("/")[0])
        seen["models"] = httpx.get(f"{url}/models", timeout=120).status_code  # (timeouts for a loaded machine)
        seen["reply"] = httpx.post(f"{url}/chat/completions", json={"messages": messages}, timeout=120)

    free = line.split(", or ")[1].split(" for a free one")[0].split()  # ['--port', '0']
    code, stderr = _serve([tiny_model_dir, *free, "--context", "32", "--max-tokens", "4"], tmp_path, monkeypatch, capsys, ask)
    assert code == 130 and seen["port"] > 0 and seen["models"] == 200, stderr
    error = seen["reply"].json()["error"]
    assert seen["reply"].status_code == 400 and error["code"] == "context_length_exceeded"
    assert "rollout.max_context_tokens" not in error["message"]
    needed = int(re.search(r"raise --context above (\d+)", error["message"]).group(1))

    code, stderr = _serve([tiny_model_dir, *free, "--context", needed + 1, "--max-tokens", "4"], tmp_path, monkeypatch, capsys, ask)
    assert code == 130 and seen["reply"].status_code == 200, (stderr, seen["reply"].text)
    assert seen["reply"].json()["usage"]["prompt_tokens"] == needed


# ---------------------------------------------------------------------- turnforge eval --best-of
def test_eval_best_of_hints_only_selectors_it_can_use(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--select vote on an env without final answers, outside a run (no critic): the line lists
    the selectors this evaluation can use, and they all run; the report is named after --out;
    progress goes to stderr without a terminal."""
    base = ["eval", tiny_model_dir, "--env", "frozenlake", "--episodes", "2", "--best-of", "1,2", "--mc-rollouts", "1",
            "--mc-horizon", "2", "--out", tmp_path / "x.json"]
    code, _, stderr = run_main([*base, "--select", "vote"], tmp_path, monkeypatch, capsys)
    line = _one_line(stderr)
    assert code == 2 and "env 'frozenlake' has none" in line
    usable = line.split("selectors this evaluation can use: ")[1].split(", ")
    assert usable == ["oracle", "logprob", "mc", "judge"]  # not vote, not critic (no run, no value model)
    code, _, stderr = run_main([*base, "--select", ",".join(usable)], tmp_path, monkeypatch, capsys)
    assert code == 0, stderr
    report = json.loads((tmp_path / "best_of_x.json").read_text())
    assert [c["selector"] for c in report["curves"]] == usable
    assert (tmp_path / "best_of_x.md").is_file() and (tmp_path / "best_of_x.png").is_file()
    assert "stage evaluation" in stderr and "stage best-of" in stderr


def test_eval_best_of_report_in_the_way_hints_force(tiny_model_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "best_of_y.json").write_text("{}")
    args = ["eval", tiny_model_dir, "--env", "frozenlake", "--episodes", "2", "--best-of", "2", "--select", "oracle",
            "--out", tmp_path / "y.json"]
    code, _, stderr = run_main(args, tmp_path, monkeypatch, capsys)
    line = _one_line(stderr)
    assert code == 2 and "best_of_y.json' already exists; give --force to overwrite it" in line
    assert not (tmp_path / "y.json").exists()
    code, _, stderr = run_main([*args, "--force"], tmp_path, monkeypatch, capsys)
    assert code == 0, stderr
    assert json.loads((tmp_path / "best_of_y.json").read_text())["ns"] == [2]


# ---------------------------------------------------------------------- check-env
SOLVER_ENV = '''
from turnforge import Env, StepResult, TaskDataset


class Solver(Env):
    """Say go; its solver asserts on every task (a user's bug)."""

    action_names = ("go", "stop")
    tasks = TaskDataset([{"n": i, "split": "heldout" if i % 3 == 0 else "train"} for i in range(60)])

    def reset(self, task, seed):
        self.n = task.data["n"]
        return f"task {self.n}: say go"

    def step(self, action):
        if action not in self.action_names:
            return StepResult("say go or stop", -0.1, False, False, invalid_action=True)
        return StepResult("done", float(action == "go"), True, False, success=action == "go")

    def expert_action(self):
        assert self.n < 0, f"the solver cannot solve task {self.n}"
        return "go"
'''


def test_check_env_names_the_env_method_that_raised_and_the_traceback_flag(tmp_path, monkeypatch, capsys):
    """An exception in the env's own code is the user's: one line naming the method and the
    exception, exit 1, no traceback; TURNFORGE_TRACEBACK=1 (the documented way) shows the env's own."""
    from turnforge.envs import registry

    (tmp_path / "solver_env.py").write_text(SOLVER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register("solver", "solver_env:Solver")
    code, stdout, stderr = run_main(["check-env", "solver"], tmp_path, monkeypatch, capsys)
    line = _one_line(stderr)
    assert code == 1 and "ok" not in stdout
    assert line.startswith("FAIL solver: Solver ('solver').expert_action() raised AssertionError: the solver cannot solve task")
    monkeypatch.setenv("TURNFORGE_TRACEBACK", "1")
    code, _, stderr = run_main(["check-env", "solver"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "Traceback (most recent call last)" in stderr
    assert "solver_env.py" in stderr and "assert self.n < 0" in stderr and stderr.strip().splitlines()[-1] == line


def test_check_env_fails_on_actions_over_the_budget_and_the_hinted_budget_passes(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """It printed a warning and "ok" with exit 0; now exit 1 naming the flag and the budget."""
    args = ["check-env", "frozenlake", "--model", tiny_model_dir]
    code, stdout, stderr = run_main([*args, "--max-new-tokens", "1"], tmp_path, monkeypatch, capsys)
    line = _one_line(stderr)
    assert code == 1 and "ok" not in stdout and "do not fit rollout.max_new_tokens=1" in line
    budget = re.search(r"give (--max-new-tokens \d+) or more", line).group(1).split()
    code, stdout, stderr = run_main([*args, *budget], tmp_path, monkeypatch, capsys)
    assert code == 0 and "frozenlake: ok" in stdout and "action lengths" in stdout, stderr


# ---------------------------------------------------------------------- train: budgets too small for BC
def test_bc_on_demonstrations_that_all_failed_stops_naming_the_budget(tmp_path, monkeypatch, capsys):
    """A summary limit too small for the expert: BC trained on failures and the run said "done".
    Now it stops before training (exit 1) naming rollout.max_summaries; raised, the run trains.
    The first line says what runs and where, before any work."""
    quick = ["env.kwargs.min_length=20", "env.kwargs.max_length=30", "env.kwargs.gate_every=0", "bc.num_demos=4",
             "bc.epochs=1", "flywheel.rounds=0", "eval.episodes=2", "eval.bc_temperatures=[]", "model.tiny.corpus_episodes=2",
             *(f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items())]
    code, _, stderr = run_main(["train", "keydoor-tiny", *quick, "rollout.max_summaries=1", "--out", "r1"],
                               tmp_path, monkeypatch, capsys)
    lines = stderr.strip().splitlines()
    assert code == 1 and lines[0] == "run directory r1: recipe keydoor-tiny, env keydoor, seed 0"
    assert lines[-1].startswith("error: bc: none of the 4 demonstrations succeeded (4 ended at rollout.max_summaries=1: "
                                "raise rollout.max_summaries)") and "Traceback" not in stderr
    assert not (tmp_path / "r1" / "checkpoints" / "bc").exists()
    key = re.search(r"raise (rollout\.\w+)", lines[-1]).group(1)
    code, _, stderr = run_main(["train", "keydoor-tiny", *quick, f"{key}=16", "--out", "r2"], tmp_path, monkeypatch, capsys)
    assert code == 0, stderr
    bc = json.loads((tmp_path / "r2" / "summary.json").read_text())["bc"]
    assert bc["expert_success_rate"] == 1.0 and bc["optimizer_steps"] > 0


# ---------------------------------------------------------------------- turnforge keys
def test_keys_of_an_unknown_section_hint_the_sections(tmp_path, monkeypatch, capsys):
    code, _, stderr = run_main(["keys", "rollouts"], tmp_path, monkeypatch, capsys)
    line = _one_line(stderr)
    assert code == 2 and "no config key or section 'rollouts'; sections:" in line
    sections = re.findall(r"'(\w+)'", line.split("sections: ")[1])
    assert "rollout" in sections
    code, stdout, _ = run_main(["keys", "rollout"], tmp_path, monkeypatch, capsys)
    assert code == 0 and "| `rollout.max_new_tokens` | int | `8` |" in stdout
    assert all(row.startswith("| `rollout.") for row in stdout.splitlines()[2:])
