"""Tools served by an MCP server: one server process per episode, inside the sandbox.

Env ``mcp-tools`` (``McpToolEnv``) asks a question from a task file and lets the agent call
the tools of an MCP server (the ``mcp`` SDK's ``MCPServer``, or any server speaking MCP over
stdio). The tools are listed from the server and rendered by the chat template like the
built-in tools (``Env.tools``); a call goes to the server as ``tools/call``; the episode ends
with ``<answer>...</answer>``, scored against the task's ``answer``.

Per episode: ``reset`` starts a fresh server process in a ``turnforge.sandbox`` (bubblewrap:
no network, read-only system, private work dir, limits) with the task as JSON in
``TURNFORGE_TASK``, so its state (files, counters, a database) belongs to that episode alone;
the end of the episode (an answer, the step limit), the next ``reset`` and ``close`` kill the
whole sandbox. An episode the rollout engine cuts at ``rollout.max_turns`` keeps its server
until the env's next ``reset`` or ``close``.

The server: ``server`` is its command line, run in the sandbox's work dir, which holds copies
of ``server_files``. A first word ``python`` runs this environment's Python with its
installed packages (the interpreter and site-packages are bound read-only; when this process
runs as root and its interpreter lives where the sandbox's user cannot read, e.g. under
``/root``, the system's ``/usr/bin/python3`` of the same version runs with them instead).

Starts under load: a server's start (the sandbox, the interpreter, the ``initialize``
handshake) waits for a slot of the machine-wide ``StartGate`` (``max_starting`` at once, by
default one per usable core) and must answer within ``startup_timeout_s`` of getting it; the
time queued behind other starts is not counted. Each later request has ``call_timeout_s``.

Failures: a server that does not start within ``startup_timeout_s``, exits, hangs past
``call_timeout_s`` or breaks the protocol raises ``McpServerError`` (a ``SandboxError``): the rollout records the episode as
an infrastructure failure, never as reward 0. A tool that reports an error (``isError``) is a
normal observation, counted in ``n_tool_errors``; arguments that do not match the tool's
input schema are an invalid action, as for built-in tools. At construction one server is
started to list the tools: a command that does not start is a ``UserError`` (one line, exit 2).

Departures from MCP clients: only tools are used (no resources, prompts, sampling or
roots; a server's requests are answered "method not found"); a result's non-text content
(images, audio, resources) is shown as a placeholder line; ``structuredContent`` is ignored
in favour of its text rendering.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import selectors
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from turnforge.envs.base import InvalidAction
from turnforge.envs.tool.base import Tool, ToolEnv, ToolError
from turnforge.errors import UserError
from turnforge.sandbox import BACKENDS, Limits, Sandbox, SandboxError
from turnforge.sandbox.process import SandboxProcess
from turnforge.types import Task

CLIENT_NAME = "turnforge"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_INSTALL_HINT = "pip install 'turnforge[mcp]'"


class McpServerError(SandboxError):
    """The MCP server failed (did not start, exited, hung, broke the protocol): an
    infrastructure fault of the episode, never the agent's."""


def _types():
    try:
        import mcp_types
    except ImportError:
        raise UserError(f"env mcp-tools needs the MCP SDK: {_INSTALL_HINT}") from None
    return mcp_types


class McpConnection:
    """One MCP server process and a synchronous JSON-RPC session with it over its stdio
    (newline-delimited messages, as the MCP stdio transport)."""

    def __init__(self, proc: SandboxProcess, label: str) -> None:
        self.proc, self.label = proc, label
        self._next_id = 0
        self._buffer = bytearray()
        self.server_instructions = ""

    @classmethod
    def open(cls, sandbox: Sandbox, argv: list[str], *, files: dict[str, str], env: dict[str, str],
             binds: tuple[str, ...], timeout_s: float) -> "McpConnection":
        """Start the server and run the MCP handshake (``initialize``, ``notifications/initialized``)."""
        conn = cls(sandbox.start(argv, files=files, env=env, binds=binds), shlex.join(argv))
        try:
            t = _types()
            params = t.InitializeRequestParams(
                protocol_version=t.LATEST_PROTOCOL_VERSION, capabilities=t.ClientCapabilities(),
                client_info=t.Implementation(name=CLIENT_NAME, version="0.1"),
            )
            result = t.InitializeResult.model_validate(conn.request("initialize", _dump(params), timeout_s))
            conn.server_instructions = result.instructions or ""
            conn.notify("notifications/initialized")
        except BaseException:
            conn.close()
            raise
        return conn

    def list_tools(self, timeout_s: float) -> list[Any]:
        """Every tool of the server (following ``nextCursor`` pages)."""
        t, tools, cursor = _types(), [], None
        for _ in range(1000):
            page = t.ListToolsResult.model_validate(self.request("tools/list", {"cursor": cursor} if cursor else {}, timeout_s))
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                return tools
        raise self._fail("tools/list", "paged more than 1000 times")

    def call_tool(self, name: str, arguments: Mapping[str, Any], timeout_s: float) -> tuple[str, bool]:
        """(the result's text, whether the tool reported an error)."""
        t = _types()
        result = t.CallToolResult.model_validate(
            self.request("tools/call", {"name": name, "arguments": dict(arguments)}, timeout_s))
        parts = []
        for item in result.content:
            parts.append(item.text if getattr(item, "type", "") == "text" else f"[{getattr(item, 'type', 'non-text')} content]")
        return "\n".join(parts), bool(result.is_error)

    def request(self, method: str, params: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send a request and return its result; ``McpServerError`` on an error reply, an exit,
        a timeout or a malformed message (the server is killed then)."""
        self._next_id += 1
        rid = self._next_id
        self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}, method)
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._receive(method, deadline, timeout_s)
            if "method" in message:  # the server's own request or notification
                if "id" in message:
                    self._send({"jsonrpc": "2.0", "id": message["id"],
                                "error": {"code": -32601, "message": f"{CLIENT_NAME} offers no {message['method']}"}}, method)
                continue
            if message.get("id") != rid:
                continue  # a late reply to an earlier request
            if "error" in message:
                error = message["error"] if isinstance(message["error"], dict) else {}
                raise self._fail(method, f"replied error {error.get('code')}: {error.get('message')}")
            if not isinstance(message.get("result"), dict):
                raise self._fail(method, "replied without a result object")
            return message["result"]

    def notify(self, method: str) -> None:
        """Send a notification (a message without an id: the server sends no reply)."""
        self._send({"jsonrpc": "2.0", "method": method})

    def _send(self, message: dict[str, Any], method: str = "") -> None:
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        except (BrokenPipeError, ValueError, OSError):
            try:
                self.proc.proc.wait(timeout=2)  # most often it has exited: say so
            except subprocess.TimeoutExpired:
                pass
            what = "exited" if self.proc.poll() is not None else "closed its input"
            raise self._fail(method or message.get("method", "a message"), what) from None

    def _receive(self, method: str, deadline: float, timeout_s: float) -> dict[str, Any]:
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    raise self._fail(method, f"did not answer {method} within {timeout_s:g} s")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    try:
                        self.proc.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    raise self._fail(method, "exited")
                self._buffer += chunk
                if len(self._buffer) > MAX_MESSAGE_BYTES:
                    raise self._fail(method, f"sent a message over {MAX_MESSAGE_BYTES} bytes")
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            raise self._fail(method, f"wrote a line that is not JSON-RPC to stdout: {line[:80]!r}") from None
        if not isinstance(message, dict):
            raise self._fail(method, f"wrote a JSON line that is not a message: {line[:80]!r}")
        return message

    def _fail(self, method: str, what: str) -> McpServerError:
        """The error for a failed exchange, with the server's last stderr line; kills the server."""
        started, code = self.proc.started(), self.proc.poll()
        tail = self.proc.stderr_tail()
        self.close()
        if not started and code is not None:
            return McpServerError(f"the sandbox of MCP server {self.label!r} failed to start: {tail or 'no message'}")
        exit_note = f" (exit {code})" if code is not None else ""
        return McpServerError(f"MCP server {self.label!r} {what} during {method}{exit_note}"
                              + (f": {tail}" if tail else ""))

    def close(self) -> None:
        self.proc.kill()


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


@functools.cache
def python_runtime() -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(interpreter, read-only binds, extra environment) that run this environment's Python
    and packages in the sandbox (see the module docstring)."""
    from turnforge.sandbox import bwrap

    site = tuple(dict.fromkeys(p for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
                               if Path(p).is_dir()))
    own = tuple(dict.fromkeys((sys.prefix, sys.base_prefix)))
    if all(bwrap.unreadable(p) is None for p in own):
        return sys.executable, own, ()
    blocked = next(bwrap.unreadable(p) for p in own if bwrap.unreadable(p) is not None)
    system = "/usr/bin/python3"
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        found = subprocess.run([system, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        found = "none"
    if found != want:
        raise UserError(
            f"the sandbox's user cannot read {blocked} (this Python) and {system} is Python {found or 'none'}, "
            f"not {want}; install turnforge in a world-readable Python (e.g. under /opt or /usr/local)"
        )
    unreadable = [p for p in site if bwrap.unreadable(p) is not None]
    if unreadable:
        raise UserError(f"the sandbox's user cannot read {bwrap.unreadable(unreadable[0])}, needed for the "
                        f"packages at {unreadable[0]}; make it world-readable (chmod o+rx)")
    return system, site, (("PYTHONPATH", ":".join(site)),)


#: Tool schemas and instructions listed per (command, files, backend) in this process.
_LISTED: dict[tuple, tuple[tuple[dict[str, Any], ...], str]] = {}


class McpToolEnv(ToolEnv):
    """Question answering with the tools of a per-episode MCP server (module docstring).

    Tasks come from ``env.tasks=PATH.jsonl``: each line has ``question`` and ``answer``, and
    may have ``split``, anything the server reads from ``TURNFORGE_TASK``, and
    ``expert_calls`` (a list of ``{"name", "arguments"}``: the calls the expert makes before
    it answers ``answer``; needed for demonstrations). An answer is right when it equals
    ``answer`` after trimming and case-folding, or as a number.
    """

    env_id = "mcp-tools"
    #: ``env.tasks`` applies (tasks carry their content); see ``turnforge.envs.registry.build_env``.
    reads_task_data = True
    # A server's state cannot be copied: no snapshots, so no Monte-Carlo values or
    # mid-episode worker recovery (a crashed worker's episodes are infrastructure failures).
    snapshot = restore = reseed = None  # type: ignore[assignment]

    def __init__(self, *, server: str | Sequence[str], server_files: Sequence[str] = (), instructions: str = "",
                 startup_timeout_s: float = 30.0, call_timeout_s: float = 10.0, memory_mb: int = 1024,
                 cpu_s: int = 60, max_processes: int = 64, sandbox: str = "bwrap", max_starting: int | None = None,
                 success_reward: float = 1.0,
                 tool_call_format: str = "hermes", max_tool_calls: int = 4, max_output_chars: int = 2000,
                 invalid_action_penalty: float = -0.1, max_steps: int = 10) -> None:
        super().__init__(tool_call_format=tool_call_format, max_tool_calls=max_tool_calls,
                         max_output_chars=max_output_chars, invalid_action_penalty=invalid_action_penalty,
                         max_steps=max_steps)
        argv = shlex.split(server) if isinstance(server, str) else [str(a) for a in server]
        if not argv:
            raise UserError("mcp-tools: server is empty; give the MCP server's command line, e.g. "
                            "server='python examples/mcp/inventory_server.py'")
        if sandbox not in BACKENDS:
            raise UserError(f"mcp-tools: unknown sandbox {sandbox!r}; valid: {', '.join(BACKENDS)}")
        for key, value in (("startup_timeout_s", startup_timeout_s), ("call_timeout_s", call_timeout_s)):
            if not value > 0:
                raise UserError(f"mcp-tools: {key} must be > 0 seconds, got {value!r}")
        self.files: dict[str, str] = {}
        for name in server_files:
            path = Path(name)
            if not path.is_file():
                raise UserError(f"mcp-tools: server_files entry {name!r} is not a file")
            self.files[path.name] = path.read_text()
        self.binds: tuple[str, ...] = ()
        self.server_env: dict[str, str] = {}
        if argv[0] in ("python", "python3"):
            interpreter, self.binds, extra = python_runtime()
            argv[0] = interpreter
            self.server_env = dict(extra)
        self.argv = argv
        self.label = shlex.join(argv)
        # the server's limits, per process: CPU seconds over its whole episode, address space, processes
        self.sandbox = Sandbox(Limits(memory_mb=memory_mb, cpu_s=cpu_s, max_processes=max_processes), backend=sandbox,
                               max_starting=max_starting)
        self.startup_timeout_s, self.call_timeout_s = float(startup_timeout_s), float(call_timeout_s)
        self.success_reward = float(success_reward)
        self._server: McpConnection | None = None
        self._tools, server_instructions = self._probe()
        self._instructions = instructions or (
            "Answer the user's question. You may call the tools described above; when you know the answer, "
            "reply <answer>...</answer>." + (f"\n\n{server_instructions}" if server_instructions else ""))

    # ------------------------------------------------------------------ the server
    def _open(self, task_data: Mapping[str, Any]) -> McpConnection:
        # queued behind the machine's other starts; startup_timeout_s counts from the slot on
        with self.sandbox.gate.slot():
            return McpConnection.open(
                self.sandbox, self.argv, files=self.files, binds=self.binds, timeout_s=self.startup_timeout_s,
                env={**self.server_env, "TURNFORGE_TASK": json.dumps(dict(task_data), sort_keys=True)},
            )

    def _probe(self) -> tuple[dict[str, Tool], str]:
        """The server's tools and instructions, listed by one server started with an empty
        task (once per process for the same command and files); ``UserError`` if it cannot."""
        key = (tuple(self.argv), tuple(sorted(self.files.items())), self.sandbox.backend)
        if key not in _LISTED:
            try:
                conn = self._open({})
                try:
                    listed = conn.list_tools(self.startup_timeout_s)
                finally:
                    conn.close()
            except SandboxError as err:
                raise UserError(f"mcp-tools: {err}") from None
            if not listed:
                raise UserError(f"mcp-tools: MCP server {self.label!r} lists no tools")
            schemas = tuple({"type": "function", "function": {
                "name": tool.name, "description": inspect.cleandoc(tool.description or ""), "parameters": tool.input_schema,
            }} for tool in listed)
            _LISTED[key] = (schemas, conn.server_instructions)
        schemas, instructions = _LISTED[key]
        tools = {}
        for schema in schemas:
            name = schema["function"]["name"]
            tools[name] = Tool(name, copy.deepcopy(schema), functools.partial(self._call, name))
        return tools, instructions

    def _call(self, name: str, /, **arguments: Any) -> str:
        if self._server is None:
            raise McpServerError(f"MCP server {self.label!r} is not running (the episode has ended)")
        text, failed = self._server.call_tool(name, arguments, self.call_timeout_s)
        return ToolError(text) if failed else text

    def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def close(self) -> None:
        """Stop the episode's server (env backends call this when they close)."""
        self._stop()

    # ------------------------------------------------------------------ ToolEnv hooks
    def tool_functions(self):
        return ()  # the tools come from the server (``_probe``)

    @property
    def instructions(self) -> str:  # type: ignore[override]
        return self._instructions

    def generate_level(self, level_seed: int):
        raise UserError("env mcp-tools reads its tasks from a file: set env.tasks=PATH.jsonl "
                        "(lines with question and answer)")

    def level_for(self, task: Task) -> dict[str, Any]:
        if task.data is None:
            self.generate_level(task.index)
        data = task.data
        missing = [k for k in ("question", "answer") if k not in data]
        if missing:
            raise UserError(f"mcp-tools: task {task.task_id} has no {missing[0]!r} field")
        return dict(data)

    def level_key(self, level: Mapping[str, Any]) -> str:
        return json.dumps(level, sort_keys=True)

    def question(self, level: Mapping[str, Any]) -> str:
        return str(level["question"])

    def score(self, level: Mapping[str, Any], answer: str) -> tuple[float, bool]:
        right = _same_answer(answer, str(level["answer"]))
        return (self.success_reward if right else 0.0), right

    def expert_action(self) -> str:
        level = self.state["level"]
        calls = level.get("expert_calls")
        if calls is None:
            raise UserError(f"mcp-tools: task {self.current_task.task_id if self.current_task else '?'} has no "
                            "expert_calls; demonstrations need them")
        made = len(self.state["calls"])
        if made < len(calls):
            return self.call_text(calls[made]["name"], calls[made].get("arguments", {}))
        return f"<answer>{level['answer']}</answer>"

    # ------------------------------------------------------------------ the episode
    def reset(self, task: Task | None = None, seed: int | None = None) -> str:  # type: ignore[override]
        self._stop()
        observation = super().reset(task, seed)
        self._server = self._open(self.state["level"])
        return observation

    def step(self, action: str):
        result = super().step(action)
        if result.terminated or result.truncated:
            self._stop()
        return result

    def _run(self, call) -> tuple[str, bool]:
        schema = self._tools[call.name].schema["function"]["parameters"]
        problem = _schema_problem(call.arguments, schema)
        if problem:
            raise InvalidAction(f"bad arguments for {call.name}: {problem}")
        result = self._tools[call.name].call(**call.arguments)
        return str(result), isinstance(result, ToolError)


def _schema_problem(arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> str:
    """The first way ``arguments`` break the tool's JSON schema ("" if none)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(dict(arguments)))
    if error is None:
        return ""
    where = ".".join(map(str, error.absolute_path))
    return f"{where}: {error.message}" if where else error.message


def _same_answer(given: str, expected: str) -> bool:
    a, b = given.strip(), expected.strip()
    if a.casefold() == b.casefold():
        return True
    try:
        return float(a.replace(",", "")) == float(b.replace(",", ""))
    except ValueError:
        return False


__all__ = ["McpConnection", "McpServerError", "McpToolEnv", "python_runtime"]
