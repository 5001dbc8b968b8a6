"""EnvPool alone: env steps/s of one env stepped four ways on exactly the same work.

    python benchmarks/envpool.py                          # sokoban-slow, 16 envs, 8 workers
    python benchmarks/envpool.py --env sokoban --num-envs 8 --num-workers 4 --steps-per-env 20
        [--env-kwargs '{"median_ms": 5}'] [--repeats 3] [--out runs/benchmarks/envpool.json]

Prints a Markdown table and writes the result as JSON to ``--out`` (default
``runs/benchmarks/envpool.json``) with the table next to it (``.md``). ``benchmarks/rollout.py``
adds it to the sync-vs-async benchmark; ``tests/bench/test_envpool_bench.py`` runs
``bench_envpool`` small.

Every mode steps ``num_envs`` copies of ``env_id`` ``steps_per_env`` times each, with the same
action texts (drawn once from ``random.Random(seed)`` over ``env.action_names``) and the same
reset seeds (env ``i``'s episode ``k`` resets with seed ``seed * 1_000_003 + k * num_envs + i``).
An env whose episode ends is reset before its next step, never after its last one. The
trajectories are deterministic, so every mode must end with the same per-env returns and last
observations: ``checksum`` says so, and ``same_trajectories`` is True only if all modes agree.

Modes:

- ``single_process``: all envs in this process, stepped in a loop (1 process);
- ``envpool_sync``: ``EnvPool.step_all`` over all envs, lock-step (``num_workers`` processes);
- ``envpool_async``: ``send_step`` for every env, then ``recv(batch_size=B)`` again and again,
  sending the next request of each env that came back at once: EnvPool's intended mode;
- ``gymnasium_async``: ``gymnasium.vector.AsyncVectorEnv`` over ``to_gymnasium`` envs, one
  process per env (that is how AsyncVectorEnv works), ``context='spawn'`` like EnvPool,
  ``autoreset_mode=DISABLED`` and ``reset(options={'reset_mask': ...})`` so that it resets
  with the same seeds as the other modes. Gymnasium's ``Text`` spaces carry the text, but
  only with ``shared_memory=False``: with the default ``shared_memory=True``, gymnasium 1.4
  reads ``Text`` observations from shared memory once, at construction, and every later
  ``reset``/``step`` returns those stale strings (all ``'\\t'``); so observations are pickled
  through pipes, as in EnvPool.

Timing: each mode builds its envs or starts its processes once (``startup_s``, not timed
with the steps), then runs ``repeats`` times; a run resets all envs (untimed) and then times
the steps and the mid-run resets. ``steps_per_s`` is the median over runs of steps / seconds.
The envs live on across runs, so later runs find the levels of mid-run resets in the envs'
level caches (generating them, with Sokoban's solver, makes every mode's first run slower).
``env_utilization`` = seconds spent inside the env (step and reset, measured where the env
runs) / (wall seconds * processes); None for gymnasium_async, whose workers do not report
their time. A sleeping env (``sokoban-slow``) counts as busy while it sleeps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol, Sequence

import gymnasium
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode

from _runs import RESULTS
from turnforge.envpool import EnvPool, EnvResult
from turnforge.envs import list_envs, make, register, stable_hash, to_gymnasium
from turnforge.envs.gym_adapter import TurnforgeGymEnv
from turnforge.envs.registry import EnvSpec
from turnforge.errors import UserError

MODES = ("single_process", "envpool_sync", "envpool_async", "gymnasium_async")
RATIOS = (("envpool_async", "single_process"), ("envpool_async", "gymnasium_async"), ("envpool_async", "envpool_sync"))


@dataclass(frozen=True)
class _Work:
    """The action texts and reset seeds every mode plays."""

    num_envs: int
    steps_per_env: int
    seed: int
    actions: tuple[tuple[str, ...], ...]  # [num_envs][steps_per_env]
    columns: tuple[tuple[str, ...], ...]  # [steps_per_env][num_envs], the same actions by step

    @classmethod
    def draw(cls, names: Sequence[str], num_envs: int, steps_per_env: int, seed: int) -> _Work:
        rng = random.Random(seed)
        actions = tuple(tuple(rng.choice(names) for _ in range(steps_per_env)) for _ in range(num_envs))
        return cls(num_envs, steps_per_env, seed, actions, tuple(zip(*actions)))

    def reset_seed(self, env: int, episode: int) -> int:
        return self.seed * 1_000_003 + episode * self.num_envs + env


@dataclass(frozen=True)
class _Run:
    """One timed run of one mode."""

    steps: int
    resets: int
    seconds: float
    busy_seconds: float
    checksum: str


class _Tally:
    """Bookkeeping of one run, the same for every mode: which action is next, episode counts,
    per-env returns and last observations (for the checksum)."""

    def __init__(self, work: _Work) -> None:
        n = work.num_envs
        self.work = work
        self.next_t = [0] * n
        self.episode = [0] * n
        self.returns = [0.0] * n
        self.last_obs = [""] * n
        self.steps = self.resets = 0
        self.busy = 0.0

    def record(self, env: int, obs: str, reward: float, done: bool) -> bool:
        """Count one step of ``env``; True if it must be reset before its next step."""
        self.steps += 1
        self.next_t[env] += 1
        self.returns[env] += reward
        self.last_obs[env] = obs
        return done and self.more(env)

    def more(self, env: int) -> bool:
        return self.next_t[env] < self.work.steps_per_env

    def action(self, env: int) -> str:
        return self.work.actions[env][self.next_t[env]]

    def reset_seed(self, env: int) -> int:
        """Seed of ``env``'s next episode (counts a mid-run reset)."""
        self.episode[env] += 1
        self.resets += 1
        return self.work.reset_seed(env, self.episode[env])

    def finish(self, seconds: float) -> _Run:
        digest = stable_hash(tuple(self.returns), tuple(self.last_obs))
        return _Run(self.steps, self.resets, seconds, self.busy, f"{digest:016x}")


class _Runner(Protocol):
    processes: int
    reports_busy: bool

    def run(self, work: _Work) -> _Run: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- the four modes
class _SingleProcess:
    processes, reports_busy = 1, True

    def __init__(self, env_id: str, env_kwargs: dict, num_envs: int, num_workers: int, batch_size: int) -> None:
        self.envs = [make(env_id, **env_kwargs) for _ in range(num_envs)]

    def run(self, work: _Work) -> _Run:
        tally = _Tally(work)
        for i, env in enumerate(self.envs):
            env.reset(seed=work.reset_seed(i, 0))
        clock = time.perf_counter
        t0 = clock()
        for column in work.columns:
            for i, env in enumerate(self.envs):
                s = clock()
                r = env.step(column[i])
                if tally.record(i, r.observation, r.reward, r.terminated or r.truncated):
                    env.reset(seed=tally.reset_seed(i))
                tally.busy += clock() - s
        return tally.finish(clock() - t0)

    def close(self) -> None:
        self.envs.clear()


def _busy(results: list[EnvResult]) -> float:
    """Worker seconds of ``results``; an env that failed is an error, not a slow step."""
    for r in results:
        if r.status != "ok":
            raise RuntimeError(f"env {r.env_id} {r.kind} came back {r.status!r}: {r.error}")
    return sum(r.seconds for r in results)


class _EnvPoolSync:
    reports_busy = True

    def __init__(self, env_id: str, env_kwargs: dict, num_envs: int, num_workers: int, batch_size: int) -> None:
        self.pool = EnvPool(env_id, num_envs, num_workers, env_kwargs)
        self.processes = self.pool.num_workers
        self.ids = list(range(num_envs))
        self.batch_size = batch_size

    def reset_all(self, work: _Work) -> None:
        self.pool.send_reset(self.ids, [work.reset_seed(i, 0) for i in self.ids])
        _busy(self.pool.recv(len(self.ids)))

    def run(self, work: _Work) -> _Run:
        tally = _Tally(work)
        self.reset_all(work)
        t0 = time.perf_counter()
        for column in work.columns:
            results = self.pool.step_all(self.ids, column)
            tally.busy += _busy(results)
            again = [r.env_id for r in results if tally.record(r.env_id, r.observation, r.reward,
                                                                r.terminated or r.truncated)]
            if again:
                self.pool.send_reset(again, [tally.reset_seed(i) for i in again])
                tally.busy += _busy(self.pool.recv(len(again)))
        return tally.finish(time.perf_counter() - t0)

    def close(self) -> None:
        self.pool.close()


class _EnvPoolAsync(_EnvPoolSync):
    def run(self, work: _Work) -> _Run:
        tally = _Tally(work)
        self.reset_all(work)
        pool = self.pool
        t0 = time.perf_counter()
        pool.send_step(self.ids, work.columns[0])
        pending = len(self.ids)  # envs with steps left (a request of each is in flight)
        while pending:
            results = pool.recv(min(self.batch_size, pending))
            tally.busy += _busy(results)
            step_ids, step_texts, reset_ids, reset_seeds = [], [], [], []
            for r in results:
                i = r.env_id
                if r.kind == "step" and tally.record(i, r.observation, r.reward, r.terminated or r.truncated):
                    reset_ids.append(i)
                    reset_seeds.append(tally.reset_seed(i))
                elif tally.more(i):
                    step_ids.append(i)
                    step_texts.append(tally.action(i))
                else:
                    pending -= 1
            if step_ids:
                pool.send_step(step_ids, step_texts)
            if reset_ids:
                pool.send_reset(reset_ids, reset_seeds)
        return tally.finish(time.perf_counter() - t0)


def _make_gym_env(spec: EnvSpec, env_kwargs: dict) -> TurnforgeGymEnv:
    """Build one wrapped env in a Gymnasium worker (registering ``spec`` there, as EnvPool does)."""
    if list_envs().get(spec.env_id) != spec:
        register(spec.env_id, spec.factory, overwrite=True, **spec.kwargs)
    return to_gymnasium(make(spec.env_id, **env_kwargs))


class _GymnasiumAsync:
    reports_busy = False

    def __init__(self, env_id: str, env_kwargs: dict, num_envs: int, num_workers: int, batch_size: int) -> None:
        factory = partial(_make_gym_env, list_envs()[env_id], env_kwargs)
        self.vec = AsyncVectorEnv([factory] * num_envs, shared_memory=False, context="spawn",
                                  autoreset_mode=AutoresetMode.DISABLED)
        self.processes = num_envs

    def run(self, work: _Work) -> _Run:
        tally = _Tally(work)
        n = work.num_envs
        self.vec.reset(seed=[work.reset_seed(i, 0) for i in range(n)])
        seeds: list[int | None] = [None] * n
        mask = np.zeros(n, dtype=bool)
        t0 = time.perf_counter()
        for column in work.columns:
            obs, rewards, terminated, truncated, _ = self.vec.step(column)
            done = terminated | truncated
            mask[:] = False
            for i in range(n):
                if tally.record(i, obs[i], float(rewards[i]), bool(done[i])):
                    mask[i], seeds[i] = True, tally.reset_seed(i)
            if mask.any():
                self.vec.reset(seed=seeds, options={"reset_mask": mask})
        return tally.finish(time.perf_counter() - t0)

    def close(self) -> None:
        self.vec.close()


RUNNERS: dict[str, type] = {
    "single_process": _SingleProcess,
    "envpool_sync": _EnvPoolSync,
    "envpool_async": _EnvPoolAsync,
    "gymnasium_async": _GymnasiumAsync,
}


# ---------------------------------------------------------------------------- benchmark
def _measure(runner_cls: type, work: _Work, env_id: str, env_kwargs: dict, num_workers: int, batch_size: int,
             repeats: int) -> dict:
    t0 = time.perf_counter()
    runner: _Runner = runner_cls(env_id, env_kwargs, work.num_envs, num_workers, batch_size)
    startup = time.perf_counter() - t0
    try:
        runs = [runner.run(work) for _ in range(repeats)]
    finally:
        runner.close()
    rates = [r.steps / r.seconds for r in runs]
    utils = [r.busy_seconds / (r.seconds * runner.processes) for r in runs] if runner.reports_busy else None
    return {
        "steps_per_s": statistics.median(rates),
        "runs": rates,
        "seconds": [r.seconds for r in runs],
        "steps": [r.steps for r in runs],
        "resets": [r.resets for r in runs],
        "env_utilization": statistics.median(utils) if utils else None,
        "processes": runner.processes,
        "startup_s": startup,
        "checksum": runs[0].checksum if len({r.checksum for r in runs}) == 1 else "runs differ",
    }


def bench_envpool(
    env_id: str,
    num_envs: int,
    num_workers: int,
    steps_per_env: int,
    env_kwargs: dict | None = None,
    seed: int = 0,
    repeats: int = 3,
    batch_size: int | None = None,
) -> dict:
    """Env steps/s of ``env_id`` in each of ``MODES`` on the same actions and reset seeds (see the
    module docstring); ``batch_size`` is envpool_async's ``recv`` batch (default ``num_envs // 2``).
    Returns a JSON-serialisable dict: the settings, ``modes[mode]`` (``steps_per_s`` median,
    ``runs``, ``steps``, ``resets``, ``env_utilization``, ``processes``, ``startup_s``,
    ``checksum``), ``same_trajectories`` and ``ratios`` (``'a/b'``: steps/s of a over b)."""
    if num_envs < 1 or num_workers < 1 or steps_per_env < 1 or repeats < 1:
        raise UserError("bench_envpool: num_envs, num_workers, steps_per_env and repeats must be >= 1")
    batch_size = max(1, num_envs // 2) if batch_size is None else int(batch_size)
    if not 1 <= batch_size <= num_envs:
        raise UserError(f"bench_envpool: batch_size must be in [1, num_envs={num_envs}], got {batch_size}")
    env_kwargs = dict(env_kwargs or {})
    names = make(env_id, **env_kwargs).action_names
    if not names:
        raise UserError(f"bench_envpool: env {env_id!r} has no action_names to draw random actions from; "
                        "benchmark an env with a discrete action set")
    work = _Work.draw(names, num_envs, steps_per_env, seed)
    modes = {m: _measure(RUNNERS[m], work, env_id, env_kwargs, num_workers, batch_size, repeats) for m in MODES}
    return {
        "env_id": env_id,
        "env_kwargs": env_kwargs,
        "num_envs": num_envs,
        "num_workers": num_workers,
        "steps_per_env": steps_per_env,
        "batch_size": batch_size,
        "seed": seed,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "gymnasium_version": gymnasium.__version__,
        "modes": modes,
        "same_trajectories": len({m["checksum"] for m in modes.values()}) == 1,
        "ratios": {f"{a}/{b}": modes[a]["steps_per_s"] / modes[b]["steps_per_s"] for a, b in RATIOS},
    }


def to_markdown(result: dict) -> str:
    """A small Markdown table of ``bench_envpool``'s result, with the ratios below it."""
    kwargs = f" {json.dumps(result['env_kwargs'])}" if result["env_kwargs"] else ""
    lines = [
        f"EnvPool alone: `{result['env_id']}`{kwargs}, {result['num_envs']} envs, {result['num_workers']} "
        f"workers, {result['steps_per_env']} steps/env, recv batch {result['batch_size']}, median of "
        f"{result['repeats']} runs, {result['cpu_count']} CPUs",
        "",
        "| mode | processes | steps/s (median) | runs (steps/s) | env utilisation | startup (s) |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for mode, m in result["modes"].items():
        util = "n/a" if m["env_utilization"] is None else f"{m['env_utilization']:.2f}"
        runs = ", ".join(f"{r:.0f}" for r in m["runs"])
        lines.append(f"| {mode} | {m['processes']} | {m['steps_per_s']:.0f} | {runs} | {util} | {m['startup_s']:.2f} |")
    lines.append("")
    lines.append("Ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in result["ratios"].items())
                 + f"; same trajectories in every mode: {'yes' if result['same_trajectories'] else 'NO'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="sokoban-slow", help="registered env id")
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--num-workers", type=int, default=8)
    p.add_argument("--steps-per-env", type=int, default=40)
    p.add_argument("--env-kwargs", type=json.loads, default=None, help='JSON object, e.g. \'{"median_ms": 5}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=None, help="envpool_async recv batch (default num_envs // 2)")
    p.add_argument("--out", type=Path, default=RESULTS / "envpool.json",
                   help="JSON result file, Markdown next to it (default %(default)s)")
    args = p.parse_args(argv)
    try:
        result = bench_envpool(args.env, args.num_envs, args.num_workers, args.steps_per_env, args.env_kwargs,
                               args.seed, args.repeats, args.batch_size)
    except UserError as err:
        p.error(str(err))
    md = to_markdown(result)
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(md + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
