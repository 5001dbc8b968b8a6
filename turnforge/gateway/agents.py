"""Agent programs as the source of episodes: ``agent(task, base_url) -> reward``.

An agent is any Python callable ``agent(task: dict, base_url: str) -> float | dict``, sync
or async, that talks to ``base_url`` (an OpenAI-compatible ``/v1`` root, one per rollout)
with any client. ``AgentEngine.play`` has the rollout engine's shape (requests and an actor
in, trajectories and counters out), so held-out evaluation and the RL loop use it as they
use the env engine; each rollout runs the agent in a thread of a pool of
``agent.concurrency``, its model calls served by the run's ``Gateway``.

A rollout becomes a one-turn ``Trajectory``: the reward is the agent's, the samples are
its compiled calls (``compile_trace``; all on turn 0, so GRPO-family credit puts the
episode's advantage on every sampled token), and the turn's ``info`` counts the calls,
the spliced calls, each kind of split and the calls whose sampling settings the trainer
overrode, in all and per setting (``n_overridden_calls``, ``n_overridden_<param>``; see
``turnforge.gateway.sampling``): ``n_*`` counters, summed per iteration and per evaluation in
the metrics (``env_events``). Every split is also written to ``RUN/gateway_splits.jsonl``
with the tokens on both sides, decoded. The first call with overridden settings is told in
one warning line per run (``on_warning``).

Failures: an agent that raises, runs past ``agent.timeout_s`` (its rollout is closed, so
its later calls get 404), makes no model call or had a request refused for its sampling
settings (``agent.sampling=strict``; even if it went on) is an infrastructure failure,
excluded and counted, never reward 0. An agent that returns something other than a finite
number or a dict with a numeric ``reward`` is a bug in the agent: the run stops with one line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import inspect
import json
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from turnforge.envs.tasks import TaskDataset
from turnforge.errors import UserError
from turnforge.gateway.render import decode
from turnforge.gateway.sampling import SAMPLING_PARAMS, SAMPLING_POLICIES, warning
from turnforge.gateway.server import Gateway, RolloutRecord
from turnforge.gateway.trace import SPLIT_REASONS, compile_trace
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutStats
from turnforge.runs import RunDir
from turnforge.types import Task, Trajectory, Turn

AGENT_ENV_ID = "agent"


def load_agent(entrypoint: str) -> Callable[..., Any]:
    """The callable named by ``module:callable`` (imported as ``python -m`` would, the working
    directory first on the path); a ``UserError`` line if it cannot be had."""
    module, _, name = entrypoint.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` does: agents in the working directory import
        sys.path.insert(0, os.getcwd())
    if not module or not name:
        raise UserError(f"agent.entrypoint={entrypoint!r} must be 'module:callable', e.g. my_agents.solve:agent")
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import-time error of the user's module
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"agent.entrypoint={entrypoint!r}: cannot import module {module!r} ({type(err).__name__}: {first})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise UserError(f"agent.entrypoint={entrypoint!r}: module {module!r} has no callable {name!r}")
    return fn


def parse_result(value: Any, entrypoint: str, policies: Sequence[str] = ()) -> tuple[float, bool | None, dict[str, float],
                                                                                   dict[str, float]]:
    """(reward, success or None, metrics, each policy's reward) of what an agent returned;
    ``UserError`` otherwise. With several ``policies`` a dict may carry ``rewards``, a reward per
    policy name; a policy it leaves out gets ``reward``."""
    success, metrics, rewards = None, {}, {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise UserError(f"agent {entrypoint} returned a dict without 'reward' (keys: {sorted(value)[:8]}); "
                            "return a number or {'reward': float, 'success': bool, 'metrics': {...}}")
        success, metrics, rewards = value.get("success"), value.get("metrics") or {}, value.get("rewards") or {}
        if rewards and not policies:
            raise UserError(f"agent {entrypoint} returned 'rewards' per policy, but the run has one policy "
                            "(name them in agent.policies, or return 'reward' alone)")
        if not isinstance(rewards, dict) or any(k not in policies or not _finite(v) for k, v in rewards.items()):
            raise UserError(f"agent {entrypoint} returned rewards={rewards!r}; it must map policy names "
                            f"({', '.join(policies)}) to finite numbers")
        if success is not None and not isinstance(success, bool):
            raise UserError(f"agent {entrypoint} returned success={success!r}; it must be true or false")
        if not isinstance(metrics, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in metrics.values()):
            raise UserError(f"agent {entrypoint} returned metrics={metrics!r}; it must be a dict of numbers")
        value = value["reward"]
    if not _finite(value):
        raise UserError(f"agent {entrypoint} returned {value!r} ({type(value).__name__}) as the reward; "
                        "return a finite number or a dict with a numeric 'reward'")
    per_policy = {p: float(rewards.get(p, value)) for p in policies}
    return float(value), success, {str(k): float(v) for k, v in metrics.items()}, per_policy


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


class AgentTasks:
    """The tasks of an agent run (``agent.tasks``), where an env would be: ``task(split, i)``."""

    env_id = AGENT_ENV_ID
    action_names: tuple[str, ...] = ()
    tools: tuple[dict, ...] = ()  # an agent's tools are its own (no env tools to count calls of)

    def __init__(self, path: str, heldout_fraction: float | None = None) -> None:
        self.dataset = TaskDataset.from_jsonl(path, heldout_fraction=heldout_fraction)
        for split in ("train", "heldout"):
            if self.dataset.size(split) == 0:
                raise UserError(f"task file {path!r} has no {split} tasks; give some a 'split' of {split!r} "
                                "(or set agent.heldout_fraction)")

    def task(self, split: str, index: int) -> Task:
        return dataclasses.replace(self.dataset.task(split, index), env_id=self.env_id)


@dataclasses.dataclass
class _Outcome:
    result: Any = None
    error: BaseException | None = None
    record: RolloutRecord | None = None


class AgentEngine:
    """Plays episode requests by running the agent against the gateway (module docstring);
    a ``turnforge.rollout.engine.Engine``, as the rollout engine is."""

    def __init__(self, cfg, policy, run_dir: Path, tasks: AgentTasks, agent: Callable[..., Any]) -> None:
        self.cfg, self.env, self.agent, self.agent_cfg = cfg.rollout, tasks, agent, cfg.agent
        self.entrypoint = cfg.agent.entrypoint
        self.splits_file = RunDir(Path(run_dir)).gateway_splits
        self.gateway = Gateway(policy, max_new_tokens=cfg.rollout.max_new_tokens,
                               max_context_tokens=cfg.rollout.max_context_tokens, seed=cfg.seed,
                               temperature=cfg.rollout.temperature, sampling=SAMPLING_POLICIES[cfg.agent.sampling],
                               port=cfg.agent.port, history=cfg.rollout.history,
                               thinking_budget=cfg.rollout.thinking_budget, tool_format=cfg.model.tool_format,
                               policies=cfg.agent.policies).start()
        self.policies = tuple(cfg.agent.policies)
        self.tokenizer = policy.tokenizer
        # told the first overridden sampling settings once; the trainer makes it a run warning (printed and logged)
        self.on_warning: Callable[[str], None] = lambda message: print(f"warning: {message}", file=sys.stderr)
        self.warned = False  # the overridden sampling settings are told once per run

    def play(self, requests: Sequence[EpisodeRequest], actor: PolicyActor, *, keep_snapshots: bool = False,
             on_wave: Callable[[int], None] | None = None,
             on_progress: Callable[[int], None] | None = None) -> tuple[list[Trajectory], RolloutStats]:
        """Run one agent rollout per request, sampling with ``actor`` (its temperature and
        generator); trajectories in request order, and counters. All requests are one wave
        (``on_wave(0)`` runs first); agent rollouts have no env snapshots to keep;
        ``on_progress(n)`` is told how many rollouts have finished, as they finish."""
        if keep_snapshots:
            raise ValueError("agent rollouts have no env snapshots (keep_snapshots=True)")
        if on_wave is not None:
            on_wave(0)
        gw = self.gateway
        with gw.lock:
            gw.actor, gw.temperature = actor, actor.temperature
        with concurrent.futures.ThreadPoolExecutor(self.agent_cfg.concurrency, thread_name_prefix="agent") as pool:
            futures = [pool.submit(self._run, r.task, r.trajectory_id) for r in requests]
            for n, _ in enumerate(concurrent.futures.as_completed(futures), 1):
                if on_progress is not None:
                    on_progress(n)
            outcomes = [f.result() for f in futures]
        first = next((c.overrides for o in outcomes for c in o.record.calls if c.overrides), None)
        if first is not None and not self.warned:
            self.warned = True
            self.on_warning(warning(first, gw.sampling))
        trajs, bad = [], None
        for req, out in zip(requests, outcomes):
            if isinstance(out.error, UserError):
                bad = bad or out.error
                continue
            trajs.append(self._trajectory(req, out.record, out, actor.version))
        if bad is not None:
            raise bad
        return trajs, RolloutStats(
            episodes=len(trajs), turns=sum(t.turns[0].info["n_calls"] for t in trajs if t.turns),
            obs_truncations=0, context_overflows=0,
            generation_truncations=sum(t.turns[0].info["n_length_stops"] for t in trajs if t.turns),
            history_dropped=0, infra_failures=sum(t.infra_failure is not None for t in trajs),
            generated_tokens=sum(x.num_action_tokens for t in trajs for x in t.samples),
        )

    def _run(self, task: Task, rollout_id: str) -> _Outcome:
        """One agent rollout; its gateway rollout is open exactly while the agent runs (the
        gateway's batcher waits for the open rollouts' requests)."""
        out = _Outcome()
        url = self.gateway.open_rollout(rollout_id)

        def target() -> None:
            try:
                value = self.agent(dict(task.data or {}), url)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
                out.result = parse_result(value, self.entrypoint, self.policies)
            except BaseException as err:  # noqa: BLE001 - reported as the rollout's failure
                out.error = err

        thread = threading.Thread(target=target, name=f"agent-{rollout_id}", daemon=True)
        thread.start()
        thread.join(self.agent_cfg.timeout_s)
        out.record = self.gateway.close_rollout(rollout_id)
        if thread.is_alive():  # left running as a daemon; its rollout is closed, so its calls now get 404
            out.error = TimeoutError(f"the agent ran past agent.timeout_s={self.agent_cfg.timeout_s}")
        return out

    def _trajectory(self, req: EpisodeRequest, record: RolloutRecord, out: _Outcome, version: int) -> Trajectory:
        failure = None
        if out.error is not None:
            err = out.error
            failure = f"agent {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
        elif not record.calls:
            failure = "the agent made no model call (is it using base_url?)"
        elif record.sampling_refusal is not None:  # the agent went on without the refused call's answer
            failure = f"the gateway refused a request: {record.sampling_refusal[:300]}"
        if failure is not None:
            return Trajectory(req.trajectory_id, req.task, req.group_id, req.env_seed, (), (), 0.0, False, False, False,
                              None, version, infra_failure=failure)
        reward, success, metrics, per_policy = out.result
        compiled = compile_trace(record.calls, req.trajectory_id)
        if compiled.splits:
            with self.splits_file.open("a") as f:
                for sp in compiled.splits:
                    f.write(json.dumps({"rollout": req.trajectory_id, "call": sp.call_index, "reason": sp.reason,
                                        "position": sp.position, "expected": decode(self.tokenizer, sp.expected),
                                        "got": decode(self.tokenizer, sp.got)}) + "\n")
        overridden = [o.param for c in record.calls for o in c.overrides]
        info: dict[str, Any] = {
            "n_calls": len(record.calls), "n_spliced_calls": record.spliced_calls, "n_refused_calls": record.refused_calls,
            "n_malformed_tool_calls": record.malformed_tool_calls,
            "n_length_stops": sum(c.finish_reason == "length" for c in record.calls),
            **{f"n_splits_{r}": compiled.count(r) for r in SPLIT_REASONS},
            "n_overridden_calls": sum(bool(c.overrides) for c in record.calls),
            **{f"n_calls_{p}": sum(c.policy == p for c in record.calls) for p in self.policies},
            **{f"n_overridden_{p}": overridden.count(p) for p in SAMPLING_PARAMS},
            **{f"agent_{k}": v for k, v in metrics.items()},
        }
        last = record.calls[-1]
        turn = Turn(observation=json.dumps(req.task.data, sort_keys=True)[:2000],
                    action_text=decode(self.tokenizer, last.completion_ids), reward=reward, invalid_action=False,
                    anchor_key="", generation_truncated=last.finish_reason == "length", info=info)
        samples = tuple(dataclasses.replace(x, turn_index=0) for x in compiled.samples)
        return Trajectory(req.trajectory_id, req.task, req.group_id, req.env_seed, (turn,), samples, reward,
                          reward > 0 if success is None else success, True, False, None,
                          min(c.version for c in record.calls), policy_rewards=per_policy)

    def pool_stats(self) -> None:
        """Agent programs run in this process's threads: no env worker pool."""
        return None

    def close(self) -> None:
        self.gateway.close()


async def _awaited(value):
    return await value
