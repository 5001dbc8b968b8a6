"""mini-swe-agent (the PyPI package, its code unmodified) on terminal tasks: its agent loop, its
prompts and its submission rule; turnforge's box for the commands and the task's verifier for the
reward.

    from turnforge.envs.terminal.harness import MiniSweConfig, gateway_model, run_task
    config = MiniSweConfig()
    result = run_task(task_data, gateway_model(base_url, config), config)   # result.reward: the verifier's

- ``BoxEnvironment``: mini-swe-agent's ``Environment`` protocol (``execute``,
  ``get_template_vars``, ``serialize``, ``config``) on the box that the ``terminal`` env builds
  for the task (``make("terminal", ...).reset(task)``: the same files, set-up commands, offline
  stand-ins, limits and per-process cache of built workspaces). Each action runs as
  mini-swe-agent's own environments run it: a fresh ``bash -c`` in the task's working directory
  with the prompt set's environment variables (``cd`` and ``export`` do not carry over to the
  next action; files do), stdout and stderr merged, returned as ``{"output", "returncode",
  "exception_info"}``. A command past its timeout is killed with everything it started and
  returns code -1 with ``exception_info`` set, as ``LocalEnvironment`` does; a limit it met (the
  box's memory, processes, disk or output cap) is told in ``exception_info``. Its submission
  rule is theirs: an output whose first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, with
  exit code 0, raises ``Submitted`` (the rest of the output is the submission). The commands'
  summed time is held to the task's ``agent_timeout_s`` (``TimeExceeded``, as the terminal env
  ends an episode at it).
- ``GatewayModel``: mini-swe-agent's ``Model`` protocol over the ``openai`` client, pointed at
  any OpenAI-compatible ``base_url`` (a turnforge gateway rollout). mini-swe-agent 2.4.6 has no
  such class without litellm (``LitellmModel`` imports litellm; ``OpenRouterModel`` and
  ``RequestyModel`` post to fixed hosted URLs), so this is a minimal one. Its ``query`` does
  what ``LitellmModel.query`` does, with mini-swe-agent's own tool-call helpers
  (``models.utils.actions_toolcall``): every request offers ``BASH_TOOL`` and the reply's tool
  calls are the actions (native tool calls, the mode of v2's default prompt set ``mini.yaml``;
  the gateway parses the model's Hermes ``<tool_call>`` blocks into ``tool_calls``); a reply
  without a well-formed ``bash`` call is a ``FormatError`` whose message is the prompt set's
  ``format_error_template``, and, as in ``LitellmModel``, the malformed reply is not kept in
  the history. Departures from ``LitellmModel``: no retries (a failed call fails the run, an
  infrastructure failure for the trainer), no cost (0.0), no litellm ``model_kwargs`` (the
  prompt set's ``drop_params`` is litellm's), and a request refused as over the context budget
  (``context_length_exceeded``) ends the run with ``LimitsExceeded`` (exit status
  ``ContextWindowExceeded``) so that the workspace is still verified, where litellm's error
  would abort the run.
- ``run_task``: ``DefaultAgent(model, env, **prompt set's agent section)`` runs on the task's
  instruction until it exits (submitted, a limit, repeated format errors); then, whatever the
  exit, ``verify`` runs the task's hidden tests on a snapshot of the box in a fresh box, and its
  verdict is the reward. A ``VerifierError`` or ``SandboxError`` propagates (an infrastructure
  failure, never a 0), as does an error of the model's client.

mini-swe-agent imports with side effects (it creates its global config directory and loads a
``.env`` from it, and prints a banner): this module sets ``MSWEA_SILENT_STARTUP`` and points
``MSWEA_GLOBAL_CONFIG_DIR`` at a directory of its own under the temp directory (unless either is
set) before importing it. Install: ``pip install --no-deps mini-swe-agent platformdirs`` (the
Makefile does; its other dependencies, litellm among them, are not needed).
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(Path(tempfile.gettempdir()) / "turnforge-mini-swe-agent"))

import yaml
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.exceptions import FormatError, LimitsExceeded, Submitted, TimeExceeded
from minisweagent.models.utils.actions_toolcall import (
    BASH_TOOL,
    format_toolcall_observation_messages,
    parse_toolcall_actions,
)
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from turnforge.envs.registry import make
from turnforge.envs.terminal.verify import Verdict, verify
from turnforge.errors import UserError
from turnforge.sandbox.box import Box
from turnforge.types import SPLITS, Task

#: What mini-swe-agent's environments take as "the agent is done" (the first line of an output).
SUBMIT_MARK = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
#: The line the box's shell prints about a command it killed at its timeout (it would show the wrapper).
_KILLED = re.compile(r"^\S+: line \d+: +\d+ Killed .*\n?\Z", re.MULTILINE)
#: mini-swe-agent's own observation template (its models' default), for a prompt set without one.
DEFAULT_OBSERVATION = ("{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
                       "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>")


@dataclass(frozen=True)
class MiniSweConfig:
    """How mini-swe-agent runs on a terminal task."""

    prompts: str = "mini"  # a prompt set: a tool-call config of mini-swe-agent's package (mini, benchmarks/swebench) or a YAML path
    step_limit: int = 16  # model calls at most (mini-swe-agent's own default, 0, is unlimited)
    max_consecutive_format_errors: int = 3  # replies without a valid bash call in a row that end the run (mini-swe-agent's default)
    command_timeout_s: float = 30.0  # one command's limit (mini-swe-agent's default; the task's own may be lower)
    max_output_bytes: int = 10_000  # a command's output shown in full up to this (mini.yaml shows 10,000 chars before eliding)
    max_tokens: int | None = None  # sent with every request; None: the server's own limit (rollout.max_new_tokens)
    backend: str = "bwrap"  # the box backend (turnforge.sandbox.box.BOXES)

    def __post_init__(self) -> None:
        if self.step_limit < 1 or self.max_consecutive_format_errors < 0 or self.command_timeout_s <= 0:
            raise UserError(f"MiniSweConfig: step_limit must be >= 1, max_consecutive_format_errors >= 0 and "
                            f"command_timeout_s > 0; got {self.step_limit}, {self.max_consecutive_format_errors}, "
                            f"{self.command_timeout_s}")


@dataclass(frozen=True)
class Prompts:
    """A mini-swe-agent prompt set (its config YAML): the agent's templates, the variables every
    command gets, and the model's observation and format-error templates."""

    agent: Mapping[str, Any]  # DefaultAgent's config (system_template, instance_template, ...)
    env: Mapping[str, str]  # the environment section's variables (PAGER=cat, ...)
    observation_template: str
    format_error_template: str


def load_prompts(name: str) -> Prompts:
    """The prompt set ``name``: a config of mini-swe-agent's package (``mini``,
    ``benchmarks/swebench``) or a YAML file's path."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else package_dir / "config" / f"{name}.yaml"
    if not path.is_file():
        shipped = sorted(str(p.relative_to(package_dir / "config").with_suffix(""))
                         for p in (package_dir / "config").rglob("*.yaml"))
        raise UserError(f"mini-swe-agent prompt set {name!r} not found; give a YAML path or one of {', '.join(shipped)}")
    data = yaml.safe_load(path.read_text()) or {}
    agent, model = data.get("agent") or {}, data.get("model") or {}
    if "system_template" not in agent or "instance_template" not in agent:
        raise UserError(f"mini-swe-agent prompt set {str(path)!r} has no agent.system_template and agent.instance_template")
    texts = [str(agent.get("system_template")), str(agent.get("instance_template")), str(model.get("format_error_template"))]
    if "textbased" in str(model.get("model_class", "")) or "action_regex" in model or any("mswea_bash_command" in t for t in texts):
        raise UserError(f"mini-swe-agent prompt set {str(path)!r} asks for actions in text blocks (mswea_bash_command); "
                        "GatewayModel speaks native tool calls: use a tool-call set such as 'mini' or 'benchmarks/swebench'")
    variables = {str(k): str(v) for k, v in ((data.get("environment") or {}).get("env") or {}).items()}
    return Prompts(agent, variables,
                   model.get("observation_template", DEFAULT_OBSERVATION), model.get("format_error_template", "{{ error }}"))


# ---------------------------------------------------------------------------------- Environment
class BoxEnvironmentConfig(BaseModel):
    """``BoxEnvironment``'s settings (mini-swe-agent reads ``config`` of its environments)."""

    cwd: str  # where each command starts: the task's working directory
    env: dict[str, str] = {}  # set for each command
    timeout: float = 30.0  # a command's limit, seconds
    time_budget_s: float = 600.0  # the commands' summed wall time (the task's agent_timeout_s)


class BoxEnvironment:
    """mini-swe-agent's ``Environment`` on a turnforge ``Box`` (see the module docstring)."""

    def __init__(self, box: Box, **kwargs: Any) -> None:
        self.config = BoxEnvironmentConfig(**kwargs)
        self.box = box
        self.n_commands = self.n_timeouts = self.n_limits = 0
        self.seconds = 0.0

    def execute(self, action: dict, cwd: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        variables = "".join(f"{k}={shlex.quote(v)} " for k, v in self.config.env.items())
        # a child bash: its cd and exports end with it (the box's shell is sent back to cwd every time)
        result = self.box.exec(f"cd {shlex.quote(cwd or self.config.cwd)} && {variables}bash -c {shlex.quote(command)}",
                               timeout_s=limit)
        self.n_commands += 1
        self.seconds += result.seconds
        if result.timed_out:  # the output so far, without the box shell's "Killed" line (it shows this wrapper)
            self.n_timeouts += 1
            output = {"output": _KILLED.sub("", result.output), "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: Command {command!r} timed out "
                                        f"after {limit:g} seconds",
                      "extra": {"exception_type": "TimeoutExpired", "exception": f"timed out after {limit:g} seconds"}}
        else:
            self.n_limits += result.killed_reason is not None
            output = {"output": result.output, "returncode": result.exit_code, "exception_info": result.notice or ""}
        check_submitted(output)
        if self.seconds > self.config.time_budget_s:
            raise TimeExceeded({"role": "exit", "content": "TimeExceeded",
                                "extra": {"exit_status": "TimeExceeded", "submission": ""}})
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}


def check_submitted(output: Mapping[str, Any]) -> None:
    """mini-swe-agent's submission rule (its environments' ``_check_finished``): ``Submitted``
    when the output's first line is ``SUBMIT_MARK`` and the command exited 0."""
    lines = output.get("output", "").lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_MARK and output["returncode"] == 0:
        submission = "".join(lines[1:])
        raise Submitted({"role": "exit", "content": submission,
                         "extra": {"exit_status": "Submitted", "submission": submission}})


# ---------------------------------------------------------------------------------- Model
class GatewayModelConfig(BaseModel):
    """``GatewayModel``'s settings."""

    base_url: str  # an OpenAI-compatible /v1 root
    model_name: str = "policy"
    api_key: str = "unused"
    max_tokens: int | None = None
    observation_template: str = DEFAULT_OBSERVATION
    format_error_template: str = "{{ error }}"


class GatewayModel:
    """mini-swe-agent's ``Model`` over the ``openai`` client (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        from openai import OpenAI

        self.config = GatewayModelConfig(**kwargs)
        self.client = OpenAI(base_url=self.config.base_url, api_key=self.config.api_key, max_retries=0)

    def query(self, messages: list[dict], **kwargs: Any) -> dict:
        import openai

        if self.config.max_tokens is not None:
            kwargs.setdefault("max_tokens", self.config.max_tokens)
        sent = [{k: v for k, v in m.items() if k != "extra"} for m in messages]
        try:
            response = self.client.chat.completions.create(model=self.config.model_name, messages=sent,
                                                           tools=[BASH_TOOL], **kwargs)
        except openai.BadRequestError as err:
            if err.code != "context_length_exceeded":
                raise
            raise LimitsExceeded({"role": "exit", "content": "ContextWindowExceeded",
                                  "extra": {"exit_status": "ContextWindowExceeded", "submission": ""}}) from None
        choice = response.choices[0]
        try:
            actions = parse_toolcall_actions(choice.message.tool_calls or [],
                                             format_error_template=self.config.format_error_template,
                                             template_kwargs={"finish_reason": choice.finish_reason})
        except FormatError as err:  # mini-swe-agent's contract: the failed call's response and cost are kept
            err.messages[0]["extra"].update({"cost": 0.0, "response": response.model_dump(mode="json")})
            raise
        message = choice.message.model_dump(exclude_none=True)
        message["extra"] = {"actions": actions, "response": response.model_dump(mode="json"), "cost": 0.0,
                            "timestamp": time.time()}
        return message

    def format_message(self, **kwargs: Any) -> dict:
        return dict(kwargs)

    def format_observation_messages(self, message: dict, outputs: list[dict], template_vars: dict | None = None) -> list[dict]:
        return format_toolcall_observation_messages(actions=message.get("extra", {}).get("actions", []), outputs=outputs,
                                                    observation_template=self.config.observation_template,
                                                    template_vars=template_vars)

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return self.config.model_dump()

    def serialize(self) -> dict:
        return {"info": {"config": {"model": self.config.model_dump(mode="json"),
                                    "model_type": f"{type(self).__module__}.{type(self).__name__}"}}}


def gateway_model(base_url: str, config: MiniSweConfig = MiniSweConfig()) -> GatewayModel:
    """A ``GatewayModel`` on ``base_url`` with the templates of ``config``'s prompt set."""
    prompts = load_prompts(config.prompts)
    return GatewayModel(base_url=base_url, max_tokens=config.max_tokens, observation_template=prompts.observation_template,
                        format_error_template=prompts.format_error_template)


# ---------------------------------------------------------------------------------- a run
@dataclass(frozen=True)
class MiniSweResult:
    """One mini-swe-agent run on a terminal task."""

    verdict: Verdict  # the task's verifier on the final workspace: the reward
    exit_status: str  # mini-swe-agent's: Submitted, LimitsExceeded, RepeatedFormatError, TimeExceeded, ContextWindowExceeded
    submission: str
    n_model_calls: int
    n_commands: int
    n_timeouts: int
    n_limits: int  # commands that met a box limit (memory, processes, disk, output)
    n_format_errors: int
    messages: list[dict] = field(repr=False)  # mini-swe-agent's trajectory (its final "exit" message included)

    @property
    def reward(self) -> float:
        return self.verdict.reward

    @property
    def success(self) -> bool:
        return self.verdict.success

    def metrics(self) -> dict[str, float]:
        """Numbers for a gateway agent's ``metrics`` (the trainer logs them as ``agent_*``)."""
        return {"submitted": float(self.exit_status == "Submitted"), "model_calls": float(self.n_model_calls),
                "commands": float(self.n_commands), "timeouts": float(self.n_timeouts), "limits": float(self.n_limits),
                "format_errors": float(self.n_format_errors)}


def run_task(data: Mapping[str, Any], model: Any, config: MiniSweConfig = MiniSweConfig()) -> MiniSweResult:
    """mini-swe-agent's ``DefaultAgent`` with ``model`` (any mini-swe-agent ``Model``) on the
    terminal task that ``data`` names (a terminal task's ``data``: generated, repair, Harbor...),
    then the task's verifier on the final workspace (see the module docstring)."""
    prompts = load_prompts(config.prompts)
    env = make("terminal", command_timeout_s=config.command_timeout_s, max_output_bytes=config.max_output_bytes,
               backend=config.backend)
    try:
        split = data.get("split") if data.get("split") in SPLITS else "train"
        env.reset(Task("terminal", split, 0, dict(data)), 0)  # type: ignore[arg-type]
        assert env.box is not None and env.episode is not None
        task = env.episode.task
        box_env = BoxEnvironment(env.box, cwd=task.workdir, env=dict(prompts.env),
                                 timeout=min(task.command_timeout_s, config.command_timeout_s),
                                 time_budget_s=task.agent_timeout_s)
        agent = DefaultAgent(model, box_env, **{**prompts.agent, "step_limit": config.step_limit, "cost_limit": 0.0,
                                                "max_consecutive_format_errors": config.max_consecutive_format_errors})
        info = agent.run(task.instruction)
        verdict = verify(task, env.box.snapshot(), env.backend, env.max_starting)
    finally:
        env.close()
    return MiniSweResult(
        verdict=verdict, exit_status=str(info.get("exit_status", "")), submission=str(info.get("submission", "")),
        n_model_calls=agent.n_calls, n_commands=box_env.n_commands, n_timeouts=box_env.n_timeouts,
        n_limits=box_env.n_limits,
        n_format_errors=sum(m.get("extra", {}).get("interrupt_type") == "FormatError" for m in agent.messages),
        messages=agent.messages)
