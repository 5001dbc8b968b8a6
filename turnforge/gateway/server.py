"""The OpenAI-compatible gateway: ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/models`` on the policy;
as an inference replica (``turnforge serve``, ``rollout.backend=server``) also ``POST
/v1/generate`` (token ids in and out) and ``/v1/weights`` (load a weight push from its files,
join a broadcast group or receive a push over it; ``GET``: what it serves).

``Gateway`` runs FastAPI on uvicorn in a thread of the trainer's process, on a free local
port (or the one given). Each rollout gets its own root, ``/rollouts/<id>/v1``, so that any
client (the ``openai`` package, ``httpx``, an agent framework) can be pointed at it with a
``base_url``; ``/v1`` itself serves without recording (``turnforge serve``).

Requests are rendered to token ids (``turnforge.gateway.render``), then sampled by one
batcher thread through ``PolicyActor.generate``, the sampling path of env episodes (HF
sampler, prefix cache, or vLLM). A batch collects requests until every open rollout has
one in it or is being rendered (the engine's lock-step wave; so open a rollout when its agent
starts and close it when it ends), or, without rollouts, while requests keep arriving within
``batch_window_s`` of each other; never longer than ``max_wait_s``. Its requests at the same
temperature are sampled together. Per call the gateway
records the exact prompt ids, sampled ids, their logprobs and the policy version under the
rollout's id (``CallRecord``); ``close_rollout`` hands them to the trace compiler.

``/v1/responses`` (the Responses API: input items, instructions, function tools and their
call/output items, ``previous_response_id`` chains, reasoning items) is translated into the chat
request it means (``turnforge.gateway.responses``) and served and recorded by the same path, so
its calls are ``CallRecord``s of the rollout like any other. ``stream=true`` on either route
sends the answer as server-sent events (chat chunks ending in ``[DONE]``; Responses events),
once it is sampled: the batcher samples completions whole, so a stream holds one delta per part.

What it refuses, with an OpenAI-style error body and status 400 (``param`` named): n > 1,
penalties (they change the sampling distribution, so the recorded logprobs would
not be the ones the trainer re-scores), a per-request seed (sampling is seeded by the run),
``tool_choice`` other than auto/none, non-text content, a prompt over the context budget.
Unknown rollout ids are 404. While training, the trainer owns the temperature and top_p
(``turnforge.gateway.sampling``, ``agent.sampling``): by default a request's other value is
replaced by the trainer's and recorded on the call (``CallRecord.overrides``); under
``agent.sampling=strict`` it is refused. A max_tokens beyond the context left is capped
(recorded too). Serving, any temperature is used as sent and top_p < 1 is refused.
"""


import asyncio
import collections
import concurrent.futures
import errno
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from turnforge.errors import UserError
from turnforge.gateway import responses
from turnforge.gateway.render import Prior, Renderer, RequestError, assistant_message, decode
from turnforge.gateway.sampling import (Override, SamplingPolicy, SamplingRefused, TrainerWins, cap_tokens,
                                        settle_sampling)
from turnforge.gateway.trace import CallRecord
from turnforge.inference.collective import TORN, GroupMember, TornPush
from turnforge.inference.weights import LoadedWeights, PushError, load_push, model_fingerprint
from turnforge.policy.generate import Generation
from turnforge.policy.lora import ADAPTER_DIR, add_lora, saved_policies, use_adapter
from turnforge.policy.model import Policy
from turnforge.rollout.actors import ActorInput, PolicyActor
from turnforge.rollout.budget import NO_FORCE, think_then_answer
from turnforge.rollout.history import HISTORIES


@dataclass
class RolloutRecord:
    """What the gateway recorded for one rollout."""

    rollout_id: str
    calls: list[CallRecord] = field(default_factory=list)
    priors: list[Prior] = field(default_factory=list)
    spliced_calls: int = 0  # calls whose prompt began with an earlier call's exact ids (see render.py)
    refused_calls: int = 0  # requests answered with an error
    malformed_tool_calls: int = 0  # replies whose tool call did not parse (their text is the content, as sampled)
    sampling_refusal: str | None = None  # the first request refused for its sampling settings (agent.sampling=strict)
    responses: dict[str, tuple[dict, ...]] = field(default_factory=dict, repr=False)  # stored Responses: their
    #   conversation items (input, then output), by response id, for previous_response_id


class StaleWeights(Exception):
    """A generate request for weights this replica does not hold (409)."""


class RolloutClosed(Exception):
    """The request's rollout was closed before it was sampled (404)."""


@dataclass
class _Job:
    key: str | None  # the rollout id; None for /v1 (serving)
    prompt: tuple[int, ...]
    temperature: float
    max_tokens: int
    future: concurrent.futures.Future
    images: tuple[bytes, ...] = ()  # the images of the prompt's blocks (vision policies)
    policy: str = ""  # the adapter that samples it (several policies), "" for the one policy


@dataclass(frozen=True)
class Settings:
    """How the user sets the gateway's port and context budget, as its errors name them: the config
    keys of a training run (``TRAINING``) or the flags of ``turnforge serve`` (``SERVE``)."""

    port: str  # the setting that takes a port ("agent.port", "--port")
    free_port: str  # that setting asking for a free port ("agent.port=0", "--port 0")
    context: str  # the context budget's setting ("rollout.max_context_tokens", "--context")


TRAINING = Settings("agent.port", "agent.port=0", "rollout.max_context_tokens")
SERVE = Settings("--port", "--port 0", "--context")


class Gateway:
    """See the module docstring. ``temperature``: the trainer's temperature, that every request
    is sampled at (when training), or None to use each request's (serving); ``sampling``: what
    happens to a request's other temperature or top_p while training (``agent.sampling``);
    ``settings``: what its errors tell the user to change (a port in use, a prompt over the budget);
    ``history``: what a reasoning template's re-sent history is spliced onto (``rollout.history``,
    ``turnforge.gateway.render``); ``tool_format``: how the model writes tool calls (a name of
    ``turnforge.envs.tool.formats.TOOL_FORMATS``, or ``auto``: the one its chat template shows);
    ``policies``: the names of the policy's LoRA adapters when it has several (``agent.policies``):
    a request's ``model`` names the one that samples it (else a 400 naming ``model``), and
    ``/v1/models`` lists them; with none, ``model`` is not read."""

    def __init__(self, policy: Policy, *, max_new_tokens: int, max_context_tokens: int, seed: int = 0,
                 temperature: float | None = None, sampling: SamplingPolicy = TrainerWins(), host: str = "127.0.0.1",
                 port: int = 0, batch_window_s: float = 0.005, max_wait_s: float = 0.05, max_batch: int = 64,
                 model_name: str | None = None, settings: Settings = TRAINING, history: str = "as_sampled",
                 thinking_budget: int | None = None, tool_format: str = "auto", policies: Sequence[str] = ()) -> None:
        if thinking_budget is not None and policy.chat.thinking is None:
            raise UserError(f"a thinking budget of {thinking_budget} tokens, but the chat template of {policy.path!r} has no "
                            "thinking markers (<think>...</think>); drop the budget or serve a reasoning model")
        self.policy, self.thinking_budget = policy, thinking_budget
        if len(policies) == 1:  # (a training run adds the adapters after its gateway is made)
            raise ValueError(f"policies {list(policies)}: name two or more, or none")
        self.policies = tuple(policies)
        self.renderer = Renderer(policy.tokenizer, policy.vision, policy.chat, HISTORIES[history], tool_format)
        self.max_new_tokens, self.max_context_tokens, self.temperature = max_new_tokens, max_context_tokens, temperature
        self.sampling, self.settings = sampling, settings
        self.batch_window_s, self.max_wait_s, self.max_batch = batch_window_s, max_wait_s, max_batch
        self.model_name = model_name or "turnforge-policy"
        self.actor = PolicyActor(policy, max_new_tokens, 1.0 if temperature is None else temperature,
                                 torch.Generator().manual_seed(seed))
        self.rollouts: dict[str, RolloutRecord] = {}
        self.served_responses: collections.OrderedDict[str, tuple[dict, ...]] = collections.OrderedDict()  # /v1's
        self.batch_sizes: list[int] = []
        self.fingerprint = model_fingerprint(policy.model, policy.tokenizer, policy.stop_ids)
        self.held = LoadedWeights()  # the weights' push and version (inference replica routes)
        self.member = GroupMember(str(next(policy.model.parameters()).device))  # pushes by broadcast
        self.lock = threading.Lock()  # held while sampling (and while the actor is swapped)
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._arriving = 0  # requests received and not yet queued (being rendered): the batcher waits for them
        self._stop = threading.Event()
        self._sock = _bind(host, port, settings)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Gateway":
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(self._app(), log_level="warning", lifespan="off"))
        self._threads = [threading.Thread(target=self._batch_loop, name="gateway-batcher", daemon=True),
                         threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                          name="gateway-http", daemon=True)]
        for t in self._threads:
            t.start()
        deadline = time.time() + 30
        while not self._server.started:
            if time.time() > deadline or not self._threads[1].is_alive():
                self.close()
                raise RuntimeError(f"the gateway did not start on {self.url}")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True
        for t in self._threads:
            t.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ rollouts
    def open_rollout(self, rollout_id: str) -> str:
        """Start recording ``rollout_id``; returns its OpenAI ``base_url``."""
        if rollout_id in self.rollouts:
            raise ValueError(f"rollout {rollout_id!r} is already open")
        if not rollout_id or "/" in rollout_id:
            raise ValueError(f"rollout id {rollout_id!r} must be non-empty and have no '/'")
        self.rollouts[rollout_id] = RolloutRecord(rollout_id)
        return f"{self.url}/rollouts/{rollout_id}/v1"

    def close_rollout(self, rollout_id: str) -> RolloutRecord:
        """Stop recording ``rollout_id`` and return what was recorded (later calls get 404)."""
        return self.rollouts.pop(rollout_id)

    # ------------------------------------------------------------------ sampling
    def _batch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            jobs, deadline = [first], time.monotonic() + self.max_wait_s
            while len(jobs) < self.max_batch:  # keep collecting while requests keep coming or are being rendered
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                more = self._arriving > 0 or len({j.key for j in jobs}) < len(self.rollouts)
                try:
                    jobs.append(self._jobs.get(timeout=left if more else min(left, self.batch_window_s)))
                except queue.Empty:
                    if not more:
                        break
            by_t: dict[tuple[float, int, str], list[_Job]] = {}
            for j in jobs:
                if j.key is not None and j.key not in self.rollouts:  # closed while queued (a timed-out agent):
                    j.future.set_exception(RolloutClosed(j.key))  # never sampled, so never during a weight update
                else:  # (with a thinking budget the answer's budget is the request's own: one group per max_tokens)
                    by_t.setdefault((j.temperature, j.max_tokens if self.thinking_budget else 0, j.policy), []).append(j)
            for (t, _, policy), group in by_t.items():
                try:
                    with self.lock:
                        if policy:
                            use_adapter(self.policy.model, policy)
                        done = self._sample(group, t)
                        version = self.policy.version
                    self.batch_sizes.append(len(group))
                    for j, (g, forced) in zip(group, done):
                        j.future.set_result((g, version, forced))
                except Exception as err:  # noqa: BLE001 - every waiting request gets the error
                    for j in group:
                        if not j.future.done():
                            j.future.set_exception(err)

    def _sample(self, group: list[_Job], temperature: float) -> list[tuple[Generation, tuple[int, int]]]:
        """One generation per job, and the span of its ids the gateway wrote. With a thinking
        budget, the engine's way (``turnforge.rollout.budget``): thinking up to the budget, then
        ``</think>`` written where it is still open, then the answer, up to the request's max_tokens."""
        images = [j.images for j in group] if any(j.images for j in group) else None
        if self.thinking_budget is None:
            gens = self.actor.generate([j.prompt for j in group], [j.key or "serve" for j in group],
                                       max_new_tokens=max(j.max_tokens for j in group), temperature=temperature, images=images)
            return [(_truncate(g, j.max_tokens), NO_FORCE) for j, g in zip(group, gens)]
        inputs = [ActorInput(j.prompt, None, j.key or "serve", 0, None, images=j.images) for j in group]  # type: ignore[arg-type]
        return think_then_answer(_Calls(self.actor, temperature), inputs, self.policy.chat.thinking,  # type: ignore[return-value]
                                 self.thinking_budget, group[0].max_tokens)

    # ------------------------------------------------------------------ HTTP
    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="turnforge gateway", docs_url=None, redoc_url=None, openapi_url=None)

        def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
            kind = "invalid_request_error" if status < 500 else "server_error"
            return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request, exc):  # noqa: ANN001
            return error(400, f"invalid request: {exc.errors()[:1]}")

        def models() -> dict:
            return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "turnforge"}
                                               for name in self.policies or (self.model_name,)]}

        def stream(events: list[dict], done: bool = False) -> StreamingResponse:
            return StreamingResponse(responses.sse(events, done), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def chat(body: dict, rollout: RolloutRecord | None, queued: list[bool]):
            completion = await self._complete(body, rollout, queued)
            if not body.get("stream"):
                return completion
            return stream(chat_chunks(completion, bool((body.get("stream_options") or {}).get("include_usage"))), True)

        async def respond(body: dict, rollout: RolloutRecord | None, queued: list[bool]):
            answer = await self._respond(body, rollout, queued)
            return stream(responses.stream_events(answer)) if body.get("stream") else answer

        async def serve(request: Request, rollout: RolloutRecord | None, route):
            """Answer a request with ``route(body, rollout, queued)``, its errors as OpenAI-style bodies."""
            self._arriving += 1
            queued = [False]
            try:
                try:
                    body = await request.json()
                except ValueError:
                    return error(400, "the request body is not JSON")
                if not isinstance(body, dict):
                    return error(400, "the request body must be a JSON object")
                try:
                    return await route(body, rollout, queued)
                except RolloutClosed as err:
                    return error(404, f"rollout {err} was closed", code="rollout_not_found")
                except RequestError as err:
                    if rollout is not None:
                        rollout.refused_calls += 1
                        if isinstance(err, SamplingRefused) and rollout.sampling_refusal is None:
                            rollout.sampling_refusal = str(err)
                    return error(400, str(err), err.param, err.code)
            finally:
                if not queued[0]:
                    self._arriving -= 1

        @app.get("/v1/models")
        async def _models():
            return models()

        @app.get("/rollouts/{rollout_id}/v1/models")
        async def _rollout_models(rollout_id: str):
            if rollout_id not in self.rollouts:
                return error(404, f"rollout {rollout_id!r} is not open", code="rollout_not_found")
            return models()

        @app.post("/v1/chat/completions")
        async def _chat(request: Request):
            return await serve(request, None, chat)

        @app.post("/v1/responses")
        async def _responses(request: Request):
            return await serve(request, None, respond)

        @app.get("/v1/weights")
        async def _weights():
            return self.weights_info()

        @app.post("/v1/weights")
        async def _load(request: Request):
            body = await request.json()
            try:
                if isinstance(body, dict) and "group" in body:
                    return await asyncio.to_thread(self.member.join, body["group"])
                if isinstance(body, dict) and "collective" in body:
                    return await asyncio.to_thread(self.receive_weights, body["collective"])
                return await asyncio.to_thread(self.load_weights, str(body["path"]))
            except (KeyError, TypeError, ValueError) as err:
                return error(400, "a weight request is {'path': '<push directory>'}, {'group': {...}} or "
                             f"{{'collective': {{...}}}} (turnforge.inference) ({type(err).__name__}: {err})", "path")
            except TornPush as err:
                return error(409, str(err), "collective", TORN)
            except PushError as err:
                return error(409, str(err), "path", "bad_push")

        @app.post("/v1/generate")
        async def _generate(request: Request):
            body = await request.json()
            try:
                return await asyncio.to_thread(self.generate_ids, body)
            except StaleWeights as err:
                return error(409, str(err), "push", "stale_weights")
            except RequestError as err:
                return error(400, str(err), err.param, err.code)

        @app.post("/rollouts/{rollout_id}/v1/chat/completions")
        async def _rollout_chat(rollout_id: str, request: Request):
            rollout = self.rollouts.get(rollout_id)
            if rollout is None:
                return error(404, f"rollout {rollout_id!r} is not open", code="rollout_not_found")
            return await serve(request, rollout, chat)

        @app.post("/rollouts/{rollout_id}/v1/responses")
        async def _rollout_responses(rollout_id: str, request: Request):
            rollout = self.rollouts.get(rollout_id)
            if rollout is None:
                return error(404, f"rollout {rollout_id!r} is not open", code="rollout_not_found")
            return await serve(request, rollout, respond)

        return app

    # ------------------------------------------------------------------ inference replica routes
    def weights_info(self) -> dict:
        """What ``GET /v1/weights`` answers: the push and trainer version served, the fingerprint."""
        return {"push": self.held.push, "version": self.held.version, "fingerprint": self.fingerprint,
                "model": self.model_name}

    def load_weights(self, path: str) -> dict:
        """Load a weight push (``turnforge.inference.weights``) between requests: sampling waits
        on the lock meanwhile. The policy's own version becomes the push id, so prefix caches of
        older weights are dropped even when the trainer's version did not change."""
        t0 = time.perf_counter()
        with self.lock:
            push, held = load_push(self.policy.model, path, self.held, self.fingerprint)
            self.held = held
            self.policy.version = push.push
        return {**self.weights_info(), "seconds": time.perf_counter() - t0}

    def receive_weights(self, spec: dict) -> dict:
        """Receive a push broadcast over this replica's group (``turnforge.inference.collective``),
        between requests like ``load_weights``; a broadcast cut off mid-way leaves a full push's
        weights torn, held as push -1 until a whole push lands."""
        t0 = time.perf_counter()
        with self.lock:
            try:
                push, held = self.member.receive(self.policy.model, spec, self.held, self.fingerprint)
            except TornPush as err:
                self.held = err.held
                if err.held.push == -1:  # torn weights: no prefix cache of them is kept either
                    self.policy.version = -1
                raise
            self.held = held
            self.policy.version = push.push
        return {**self.weights_info(), "seconds": time.perf_counter() - t0}

    def generate_ids(self, body: dict) -> dict:
        """``POST /v1/generate``, token ids in and out: ``prompts`` (lists of ids), ``keys`` (the
        episode of each: its prefix-cache entry), ``row_seeds`` (each row's seed, or null for the
        server's generator), ``max_new_tokens``, ``temperature``, and ``push``, the weights the
        client expects (a 409 ``stale_weights`` when this replica holds others). Answers each
        generation's ids, logprobs and whether it stopped, with the push and trainer version
        that sampled them. A server of several policies samples with the one ``model`` names."""
        try:
            prompts = [tuple(int(i) for i in p) for p in body["prompts"]]
            keys = [str(k) for k in body.get("keys") or ["serve"] * len(prompts)]
            seeds = body.get("row_seeds")
            seeds = None if seeds is None else [int(x) for x in seeds]
            n, t = int(body["max_new_tokens"]), float(body["temperature"])
        except (KeyError, TypeError, ValueError) as err:
            raise RequestError(f"a generate request needs prompts, max_new_tokens and temperature ({err})") from None
        if len(keys) != len(prompts) or (seeds is not None and len(seeds) != len(prompts)):
            raise RequestError("keys and row_seeds need one entry per prompt", "keys")
        if n < 1 or any(len(p) + n > self.max_context_tokens for p in prompts):
            raise RequestError(f"a prompt plus max_new_tokens={n} is over the context budget ({self.max_context_tokens}, "
                               f"{self.settings.context})", "prompts", "context_length_exceeded")
        policy = self._policy_of(body)  # a server of several policies: the one "model" names
        with self.lock:
            if policy:
                use_adapter(self.policy.model, policy)
            want = body.get("push")
            if want is not None and int(want) != self.held.push:
                raise StaleWeights(f"this replica holds push {self.held.push}, the request wants push {want}")
            gens = self.actor.generate(prompts, keys, max_new_tokens=n, temperature=t, row_seeds=seeds) if prompts else []
            held = self.held
        return {"generations": [{"ids": list(g.ids), "logprobs": list(g.logprobs), "stopped": g.stopped} for g in gens],
                "push": held.push, "version": held.version}

    def _params(self, body: dict) -> tuple[float, tuple[Override, ...], int | None, list[str], bool, list | None]:
        n = body.get("n", 1)
        if n not in (1, None):
            raise RequestError(f"n={n!r}: the gateway samples one choice per request (n=1)", "n")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise RequestError(f"stream={body['stream']!r} must be true or false", "stream")
        opts = body.get("stream_options")
        if opts is not None and (not body.get("stream") or not isinstance(opts, dict)
                                 or not set(opts) <= {"include_usage", "include_obfuscation"}):
            raise RequestError("stream_options is {'include_usage': bool}, with stream=true", "stream_options")
        for key in ("presence_penalty", "frequency_penalty"):
            if body.get(key) not in (None, 0, 0.0):
                raise RequestError(f"{key}={body[key]!r}: penalties are not supported (they change the sampling "
                                   "distribution the trainer scores)", key)
        if body.get("seed") is not None:
            raise RequestError("seed: per-request seeds are not supported; sampling is seeded by the run", "seed")
        if body.get("top_logprobs") not in (None, 0):
            raise RequestError("top_logprobs is not supported (logprobs=true gives each sampled token's)", "top_logprobs")
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise RequestError("response_format: only {'type': 'text'} is supported", "response_format")
        temperature, overrides = settle_sampling(body, self.temperature, self.sampling)
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise RequestError(f"max_tokens={cap!r} must be a positive integer", "max_tokens")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("stop must be a non-empty string or a list of at most 4 of them", "stop")
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise RequestError(f"tool_choice={choice!r}: only 'auto' and 'none' are supported", "tool_choice")
        if choice == "none":
            tools = None
        return temperature, overrides, cap, stops, bool(body.get("logprobs")), tools

    def _policy_of(self, body: dict) -> str:
        """The policy a request's ``model`` names ("" when the gateway serves one policy)."""
        if not self.policies:
            return ""
        model = body.get("model")
        if model not in self.policies:
            raise RequestError(f"model={model!r} names no policy; this run's policies: {', '.join(self.policies)}",
                               "model", "model_not_found")
        return model

    async def _call(self, body: dict, rollout: RolloutRecord | None, queued: list[bool], policy: str = "") -> "Served":
        """Render a chat request, sample it with ``policy``'s adapter and record the call on
        ``rollout``: what both routes answer from."""
        temperature, overrides, cap, stops, want_logprobs, tools = self._params(body)
        tok = self.policy.tokenizer
        prompt, spliced, images, rendered = self.renderer.prompt(body.get("messages"), tools, rollout.priors if rollout else [])
        room = self.max_context_tokens - len(prompt)
        if self.thinking_budget is not None:  # the thinking and its forced close come before the answer
            room -= self.thinking_budget + len(self.policy.chat.thinking.forced_close)
        if room < 1:
            thinking = f" plus a thinking budget of {self.thinking_budget}" if self.thinking_budget is not None else ""
            raise RequestError(f"the prompt is {len(prompt)} tokens{thinking}; the context budget is {self.max_context_tokens} "
                               f"({self.settings.context}): raise {self.settings.context} above {len(prompt)}, or send "
                               "a shorter prompt", "messages", "context_length_exceeded")
        max_tokens, capped = cap_tokens(cap, self.max_new_tokens, room)
        if capped is not None:
            overrides += (capped,)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        queued[0] = True
        self._arriving -= 1
        self._jobs.put(_Job(rollout.rollout_id if rollout else None, prompt, temperature, max_tokens, fut, images, policy))
        gen, version, forced = await asyncio.wrap_future(fut)
        ids, logprobs = list(gen.ids), list(gen.logprobs)
        body_ids = ids[:-1] if gen.stopped else ids
        text, finish = decode(tok, body_ids), ("stop" if gen.stopped else "length")
        if stops:  # cut at the first stop string: keep the tokens up to the one that completes it
            for k in range(1, len(body_ids) + 1):
                partial = decode(tok, body_ids[:k])
                hits = [partial.find(s) for s in stops if s in partial]
                if hits:
                    ids, logprobs, body_ids = ids[:k], logprobs[:k], body_ids[:k]
                    text, finish = partial[:min(hits)], "stop"
                    break
        message, finish, malformed = assistant_message(text, finish, self.policy.chat.thinking, self.renderer.format, tools)
        if rollout is not None:
            rollout.malformed_tool_calls += malformed is not None
            rollout.calls.append(CallRecord(len(rollout.calls), prompt, tuple(ids), tuple(logprobs), version,
                                            temperature, finish, images, overrides, forced, policy))
            rollout.priors.append(self.renderer.prior(rendered, prompt, tuple(ids)))
            rollout.spliced_calls += spliced
        token_logprobs = None
        if want_logprobs:
            token_logprobs = [{"token": (s := decode(tok, [i])), "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                              for i, lp in zip(body_ids, logprobs)]
        return Served(tuple(prompt), tuple(ids), message, finish, temperature, self._reasoning_tokens(ids, forced),
                      token_logprobs)

    async def _complete(self, body: dict, rollout: RolloutRecord | None, queued: list[bool]) -> dict:
        """A chat completion (``/v1/chat/completions``)."""
        policy = self._policy_of(body)
        got = await self._call(body, rollout, queued, policy)
        choice = {"index": 0, "message": got.message, "finish_reason": got.finish,
                  "logprobs": None if got.logprobs is None else {"content": got.logprobs}}
        details = {} if got.reasoning_tokens is None else {"completion_tokens_details": {"reasoning_tokens": got.reasoning_tokens}}
        n, m = len(got.prompt), len(got.ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": policy or self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m, **details},
        }

    async def _respond(self, body: dict, rollout: RolloutRecord | None, queued: list[bool]) -> dict:
        """A Responses answer (``/v1/responses``, ``turnforge.gateway.responses``), stored for chaining
        on its rollout (serving: the last ``SERVED_RESPONSES``) unless ``store=false``."""
        stored = rollout.responses if rollout is not None else self.served_responses
        policy = self._policy_of(body)
        req = responses.translate(body, stored)
        try:
            got = await self._call(req.chat, rollout, queued, policy)
        except RequestError as err:  # the chat path names its messages; here they are the input
            if err.param is not None and err.param.startswith("messages"):
                err.param = "input"
            raise
        out = responses.output_items(got.message, got.finish, got.logprobs)
        answer = responses.response(req, out, got.finish, model=policy or self.model_name, temperature=got.temperature,
                                    input_tokens=len(got.prompt), output_tokens=len(got.ids),
                                    reasoning_tokens=got.reasoning_tokens or 0)
        if req.store:
            stored[answer["id"]] = req.items + tuple(out)
            if rollout is None and len(stored) > responses.SERVED_RESPONSES:
                self.served_responses.popitem(last=False)
        return answer

    def _reasoning_tokens(self, ids: list[int], forced: tuple[int, int]) -> int | None:
        """The sampled thinking tokens of a reasoning model's completion (``reasoning_tokens``, as
        OpenAI reports them: the gateway's written close not counted); None for other models."""
        thinking = self.policy.chat.thinking
        if thinking is None:
            return None
        split = thinking.split(ids)
        return split - max(0, min(split, forced[1]) - forced[0])


@dataclass(frozen=True)
class Served:
    """One call as the gateway sampled and recorded it, for its route to answer."""

    prompt: tuple[int, ...]  # the prompt ids
    ids: tuple[int, ...]  # the sampled ids (cut at a stop string), the stop token included when sampled
    message: dict  # the OpenAI assistant message (``render.assistant_message``)
    finish: str  # "stop" | "length" | "tool_calls"
    temperature: float  # what it was sampled at
    reasoning_tokens: int | None  # thinking tokens sampled (reasoning templates; None for others)
    logprobs: list[dict] | None  # each answer token's logprob entry, when the request asked for them


def chat_chunks(completion: dict, include_usage: bool) -> list[dict]:
    """The ``chat.completion.chunk`` objects of a finished chat completion, as OpenAI streams one:
    the role, the reasoning, the content (with its logprobs), one chunk per tool call, the finish
    reason; then the usage alone when ``stream_options.include_usage``."""
    (choice,) = completion["choices"]
    msg = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    usage = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **usage}

    out = [chunk({"role": "assistant", "content": None if msg.get("content") is None else ""})]
    if msg.get("reasoning_content") is not None:
        out.append(chunk({"reasoning_content": msg["reasoning_content"]}))
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}, logprobs=choice["logprobs"]))
    for i, call in enumerate(msg.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, choice["finish_reason"], None if msg.get("content") else choice["logprobs"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": completion["usage"]})
    return out


def open_replica(checkpoint: Path, *, host: str, port: int, max_tokens: int, context: int, dtype: str, device: str,
                 seed: int, threads: int, prefix_cache: bool, thinking_budget: int | None = None,
                 tool_format: str = "auto") -> Gateway:
    """``turnforge serve``'s gateway on ``checkpoint`` (bound, not started): in its process, or in
    a Ray actor as an inference replica (``turnforge.inference.ray_replicas``). ``threads`` 0: one
    per CPU core. A checkpoint of several policies (``agent.policies``) serves each under its name."""
    from turnforge.policy.model import load_policy, quiet_hf, resolve_device

    device = resolve_device(device, "--device")
    quiet_hf()
    torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
    policy = load_policy(checkpoint, dtype, device)
    policies = saved_policies(checkpoint)  # a checkpoint of several policies: its base and each one's adapter
    if policies:
        add_lora(policy, None, seed, "serve", adapter_dir=Path(checkpoint) / ADAPTER_DIR, names=policies)
        policy.model.eval()
    policy.prefix_cache = prefix_cache
    return Gateway(policy, max_new_tokens=max_tokens, max_context_tokens=context, seed=seed, host=host, port=port,
                   model_name=Path(checkpoint).name, settings=SERVE,  # binds now: a port in use is one line
                   thinking_budget=thinking_budget, tool_format=tool_format, policies=policies)


class _Calls:
    """The gateway's ``PolicyActor`` as an ``Actor`` for ``think_then_answer``: each call's rows at
    one temperature, keyed by rollout (the prefix cache carries the thinking into the answer's call)."""

    needs_tokens = True

    def __init__(self, actor: PolicyActor, temperature: float) -> None:
        self.actor, self.temperature = actor, temperature
        self.version = actor.version

    def act(self, inputs: list[ActorInput]) -> list[Generation]:
        images = [x.images for x in inputs] if any(x.images for x in inputs) else None
        return self.actor.generate([x.prompt for x in inputs], [x.trajectory_id for x in inputs],
                                   max_new_tokens=inputs[0].max_new_tokens, temperature=self.temperature, images=images)


def _truncate(g: Generation, n: int) -> Generation:
    """The first ``n`` tokens of ``g``: what sampling with ``max_new_tokens=n`` would have given."""
    if len(g.ids) <= n:
        return g
    return Generation(g.ids[:n], g.logprobs[:n], False)


def _bind(host: str, port: int, settings: Settings) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use; give another {settings.port}, or {settings.free_port} "
                            "for a free one") from None
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(128)
    return sock
