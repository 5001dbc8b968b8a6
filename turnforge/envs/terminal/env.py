"""The ``terminal`` env: a persistent bash per episode in a sandboxed box, commands as actions, and a
verifier that scores the final workspace with tests the agent never saw.

An episode of a ``TerminalTask`` (``turnforge.envs.terminal.task``, from any task source):

- ``reset``: a box (``turnforge.sandbox.box``, bubblewrap) with the task's workspace as its only
  writable place (and /tmp), no network, CPU/memory/process/disk limits; the task's files, the
  offline stand-ins of installers (``offline``) and its set-up commands (a Dockerfile's ``RUN``
  lines) are in place; the shell is in the task's working directory. A task's built workspace
  is kept (per process) and restored for its later episodes instead of building it again. The
  first observation is the instruction and the working directory.
- ``step(action)``: the action is a command (plain text; a fenced ```` ```bash ```` block is
  unwrapped), or, with ``action_format=tool``, a ``bash`` tool call (``{"command": ...}``) in
  any tool-call format of ``turnforge.envs.tool.formats`` (``tool_call_format``): one renderer,
  the same observation. ``submit`` (the word, or the ``submit`` tool) ends the episode, as does the
  episode's last turn (``max_turns``). The observation is the command's output (stdout and
  stderr as a terminal shows them, cut at ``max_output_bytes`` with a visible mark), then a line
  ``[exit N] CWD$``. A command that runs past ``command_timeout_s`` is killed with everything it
  started and the agent is told; so is one that meets a limit (a fork bomb, a full disk, memory).
  These are the agent's doing: counted in ``info`` (``n_timeouts``, ``n_limits``,
  ``n_shell_restarts``), never infrastructure failures.
- at the end the verifier (``verify``) runs the task's tests in a fresh box on the final
  workspace: its reward is the episode's (binary, or the passed fraction when the task says so).
  A verifier that fails to give a reward, or the box itself failing (``SandboxError``), is an
  infrastructure failure: raised, so the rollout counts and excludes the episode.

Snapshots (``snapshot``/``restore``) hold the box's files, cwd and exported variables and the
episode's counters, so Monte-Carlo values, lookahead, anchored starts and retries from a state
work on terminal tasks. The expert (``expert_action``) types the task's reference commands, one
per turn, then ``submit``; for a task whose reference is a script (a Harbor ``solve.sh``), the
script's text is its one command when it uses no file of ``/solution``.
"""

from __future__ import annotations

import random
import re
import subprocess
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from turnforge.envs.base import Env
from turnforge.envs.terminal.sources import TERMINAL_SOURCES, build_task, task_label
from turnforge.envs.terminal.task import SOLUTION_DIR, TerminalTask
from turnforge.envs.terminal.verify import Verdict, box_spec, prepare, verify
from turnforge.envs.tool.base import TOOL_CALL_FORMATS, parse_tool_calls
from turnforge.errors import UserError, choices
from turnforge.sandbox.box import BoxSnapshot, ExecResult, open_box
from turnforge.types import EnvSnapshot, StepResult, Task

ACTION_FORMATS = ("text", "tool")
SUBMIT = "submit"
_FENCE = re.compile(r"^```[a-zA-Z]*\n(.*?)\n?```\s*$", re.DOTALL)
_BUILT: OrderedDict[str, BoxSnapshot] = OrderedDict()  # task name -> its built workspace (per process)
_BUILT_MAX = 256
_BUILT_LOCK = threading.Lock()

BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a command in the task's bash shell and get its output and exit code",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The command"}},
                   "required": ["command"]}}}
SUBMIT_TOOL = {"type": "function", "function": {
    "name": SUBMIT, "description": "End the episode: the task is done and its tests may run",
    "parameters": {"type": "object", "properties": {}}}}


@dataclass
class _Episode:
    task: TerminalTask
    turns: int = 0  # commands run (and submit); invalid actions do not count
    seconds: float = 0.0  # the commands' wall time (against the task's agent_timeout_s)


class TerminalEnv(Env):
    """Shell tasks in a sandbox (see the module docstring)."""

    instructions = ("You work in a Linux bash shell to do a task. Answer with one shell command per turn; its output "
                    "comes back. When the task is done, answer submit.")

    #: The episode ends (and is verified) at this many turns: the run's rollout.max_turns must not cut it first.
    turn_limit: int

    def __init__(self, *, source: str = "generated", action_format: str = "text", tool_call_format: str = "hermes",
                 max_turns: int = 16, command_timeout_s: float = 10.0, max_output_bytes: int = 2000,
                 backend: str = "bwrap", max_starting: int | None = None, **source_options: Any) -> None:
        if source not in TERMINAL_SOURCES:
            raise UserError(f"env terminal: unknown source {source!r}; valid sources: {choices(TERMINAL_SOURCES)} "
                            "(or env.tasks=DIR of Harbor tasks)")
        if action_format not in ACTION_FORMATS:
            raise UserError(f"env terminal: unknown action_format {action_format!r}; valid: {choices(ACTION_FORMATS)}")
        if tool_call_format not in TOOL_CALL_FORMATS:
            raise UserError(f"env terminal: unknown tool_call_format {tool_call_format!r}; valid: {choices(TOOL_CALL_FORMATS)}")
        if max_turns < 1 or command_timeout_s <= 0 or max_output_bytes < 64:
            raise UserError("env terminal: max_turns must be >= 1, command_timeout_s > 0 and max_output_bytes >= 64; got "
                            f"{max_turns}, {command_timeout_s}, {max_output_bytes}")
        self.source = source
        self.tasks = TERMINAL_SOURCES[source](**source_options)
        self.action_format, self.tool_call_format = action_format, tool_call_format
        self.max_turns, self.command_timeout_s, self.max_output_bytes = max_turns, command_timeout_s, max_output_bytes
        self.turn_limit = max_turns
        self.backend, self.max_starting = backend, max_starting
        if action_format == "tool":
            self.tools = (BASH_TOOL, SUBMIT_TOOL)
            self.observation_role = "tool"
            self.instructions = ("You work in a Linux bash shell to do a task. Call the bash tool with one command per "
                                 "turn; its output comes back. When the task is done, call submit.")
        self.box = None
        self._data: dict = {}
        self.episode: _Episode | None = None
        self.last_verdict: Verdict | None = None

    def read_tasks(self, path: str, heldout_fraction: float | None = None):
        """``env.tasks=PATH``: a directory of Harbor tasks (``turnforge.envs.terminal.harbor``)."""
        from turnforge.envs.terminal.harbor import HarborTasks

        return HarborTasks(path, heldout_fraction=heldout_fraction)

    # ------------------------------------------------------------------ episode
    def reset(self, task: Task, seed: int) -> str:
        self._data = dict(task.data or {})
        spec = build_task(self._data)
        self._open(spec)
        self.episode = _Episode(spec)
        self.last_verdict = None
        return f"{spec.instruction}\n\n[working directory {spec.workdir}]"

    def _open(self, task: TerminalTask) -> None:
        """A box holding ``task``'s built workspace, its shell in the working directory."""
        self.close()
        spec = box_spec(task, timeout_s=min(task.command_timeout_s, self.command_timeout_s),
                        max_output_bytes=self.max_output_bytes)
        self.box = open_box(spec, self.backend, max_starting=self.max_starting)
        with _BUILT_LOCK:  # (agent runs open boxes from several threads)
            built = _BUILT.get(task.name)
            if built is not None:
                _BUILT.move_to_end(task.name)
        if built is not None:
            self.box.restore(built)
            return
        prepare(self.box, task)
        self.box.put({f.path: f.data for f in task.files}, {f.path: f.mode for f in task.files})
        self.box.exec(f"mkdir -p {task.workdir} && cd {task.workdir}", timeout_s=10)
        for name, value in task.env:
            self.box.exec(f"export {name}={_sh_quote(value)}", timeout_s=10)
        for command in task.setup:
            result = self.box.exec(command, timeout_s=max(60.0, task.verifier_timeout_s))
            if result.exit_code != 0:
                raise RuntimeError(f"task {task.name}: set-up command {command[:80]!r} failed with exit code "
                                   f"{result.exit_code}: {result.output.strip().splitlines()[-1:] or ''}")
        self.box.exec(f"cd {task.workdir}", timeout_s=10)
        snap = self.box.snapshot()
        with _BUILT_LOCK:
            _BUILT[task.name] = snap
            if len(_BUILT) > _BUILT_MAX:
                _BUILT.popitem(last=False)

    def step(self, action: str) -> StepResult:
        ep = self.episode
        if ep is None or self.box is None:
            raise RuntimeError("step() before reset()")
        parsed = self._parse(action)
        if isinstance(parsed, _Invalid):  # nothing ran: the episode's state, its command count included, is as it was
            return StepResult(parsed.reason, 0.0, False, False, invalid_action=True, info={"n_invalid_commands": 1})
        ep.turns += 1
        if parsed is None:  # submit
            return self._finish(truncated=False, observation="Submitted.", info={"n_submits": 1})
        result = self.box.exec(parsed, timeout_s=min(ep.task.command_timeout_s, self.command_timeout_s))
        ep.seconds += result.seconds
        info = {"n_commands": 1, "n_timeouts": int(result.timed_out), "n_limits": int(result.killed_reason is not None
                and not result.timed_out), "n_shell_restarts": int(result.shell_restarted), "n_output_truncated": int(result.truncated)}
        observation = render(result)
        if ep.seconds > ep.task.agent_timeout_s:
            return self._finish(truncated=True, observation=observation + "\n[the task's time is up]", info=info)
        return self._after(StepResult(observation, 0.0, False, False, info=info))

    def _after(self, result: StepResult) -> StepResult:
        """``result``, or, after the episode's last command (``max_turns``), the verifier's verdict with it."""
        if self.episode is not None and self.episode.turns >= self.max_turns:
            return self._finish(truncated=True, observation=result.observation, info=dict(result.info))
        return result

    def _finish(self, *, truncated: bool, observation: str, info: dict) -> StepResult:
        ep = self.episode
        assert ep is not None and self.box is not None
        verdict = verify(ep.task, self.box.snapshot(), self.backend, self.max_starting)
        self.last_verdict = verdict
        info = dict(info)  # (the verifier's wall time is on last_verdict, not in info: steps must replay alike)
        if verdict.success and self._data.get("source") == "inject":  # a valid bug: the selfplay mechanism's next repair task
            path = f"/app/pkg/{self._data['seed']}.py"
            info["injected_module"] = self.box.get([path]).get(path, b"").decode(errors="replace")
        self.close()
        # the env's own end (submit, its turn limit, the task's time): terminated, verified either way
        info["n_unsubmitted"] = int(truncated)
        return StepResult(observation, verdict.reward, True, False, success=verdict.success, info=info)

    def _parse(self, action: str) -> str | None | "_Invalid":
        """The command of ``action``; None for submit."""
        if self.action_format == "tool":
            try:
                calls = parse_tool_calls(action, self.tool_call_format)
            except Exception as err:  # InvalidAction: a malformed call
                return _Invalid(f"Error: {err}.")
            if len(calls) != 1:
                return _Invalid("Error: make exactly one tool call per turn (bash with a command, or submit).")
            call = calls[0]
            if call.name == SUBMIT:
                return None
            if call.name != "bash" or not isinstance(call.arguments.get("command"), str):
                return _Invalid('Error: call bash with {"command": "..."}, or submit.')
            command = call.arguments["command"]
        else:
            text = action.strip()
            fenced = _FENCE.match(text)
            command = fenced.group(1).strip() if fenced else text
            if command.lower() == SUBMIT:
                return None
        if not command.strip():
            return _Invalid("Error: the command is empty.")
        if "\0" in command:
            return _Invalid("Error: the command contains a NUL byte, which no shell command can hold.")
        problem = syntax_error(command)
        if problem:
            return _Invalid(f"Error: not a shell command: {problem}")
        return command

    # ------------------------------------------------------------------ capabilities
    def expert_action(self) -> str:
        """The task's next reference command, then ``submit``."""
        ep = self.episode
        assert ep is not None
        commands = expert_commands(ep.task)
        if commands is None:
            raise UserError(f"task {ep.task.name} has no reference solution a demonstration can type (its solve.sh "
                            f"uses files of {SOLUTION_DIR})")
        done = ep.turns
        return commands[done] if done < len(commands) else SUBMIT

    def random_action(self, rng: random.Random) -> str:
        """A command a random agent might type (for baselines and ``check_env``): none that prints
        the clock (``ls -l``'s times would differ between two plays of the same actions)."""
        ep = self.episode
        names = [f.path for f in ep.task.files] if ep is not None else []
        options = ["ls", "ls -a", "pwd", "cat *.txt", "echo hello > out.txt", "wc -l *", "submit"]
        options += [f"cat {rng.choice(names)}" for _ in range(2)] if names else []
        return rng.choice(options)

    def snapshot(self) -> EnvSnapshot:
        ep = self.episode
        if ep is None or self.box is None:
            raise RuntimeError("snapshot() outside an episode")
        return EnvSnapshot(self.env_id, (ep.task.name, self._data, self.box.snapshot(), ep.turns, ep.seconds))

    def restore(self, snapshot: EnvSnapshot) -> None:
        _, data, box_snap, turns, seconds = snapshot.payload
        task = build_task(data)
        if self.box is None or self.episode is None or self.episode.task.name != task.name:
            self._open(task)
        assert self.box is not None
        self.box.restore(box_snap)
        self.episode = _Episode(task, turns, seconds)
        self._data = data

    def task_label(self, task: Task) -> str:
        own = getattr(self.tasks, "task_label", None)  # a source that splits by family labels its own (held-out families)
        return own(task) if callable(own) else task_label(task.data or {})

    def close(self) -> None:
        if self.box is not None:
            self.box.close()
            self.box = None


@dataclass(frozen=True)
class _Invalid:
    reason: str


def render(result: ExecResult) -> str:
    """An ``ExecResult`` as the agent sees it: the output, a line saying what a limit or timeout did,
    and ``[exit N] CWD$``."""
    lines = [result.output.rstrip("\n")] if result.output.strip() else []
    if result.notice:
        lines.append(f"[{result.notice}]")
    lines.append(f"[exit {result.exit_code}] {result.cwd}$")
    return "\n".join(lines)


def expert_commands(task: TerminalTask) -> tuple[str, ...] | None:
    """What a demonstration types: the reference commands, or a reference script's text (a
    Harbor ``solve.sh``) when it reads no file of /solution; None when neither can be typed."""
    if task.expert_commands:
        return task.expert_commands
    if task.solve_command is None:
        return None
    script = next((f for f in task.solution if f.path == f"{SOLUTION_DIR}/solve.sh"), None)
    if script is None:
        return None
    text = script.data.decode(errors="replace")
    return None if SOLUTION_DIR in text else (text.strip(),)


def syntax_error(command: str) -> str | None:
    """bash's complaint about ``command`` when it does not parse (``bash -n``: read, not run), else None."""
    try:
        found = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, timeout=5, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "bash could not read it within 5 s"
    if found.returncode == 0:
        return None
    lines = [line.removeprefix("bash: -c: ") for line in found.stderr.splitlines() if "syntax error" in line]
    return (lines[0] if lines else found.stderr.strip().splitlines()[-1] if found.stderr.strip() else "bash cannot read it")


def _sh_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"
