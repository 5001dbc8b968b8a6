"""What the stages of one run share: config, run directory, policy, the rollout engine, logs, counters.

The run directory is a ``turnforge.runs.RunDir``: stages take its paths and write through it, so
on several trainer ranks rank 0 alone writes (a stage never tests the rank itself).

The orchestrating ``turnforge.app.run.train`` builds one ``Session`` and hands it to the stages;
the pieces a stage computes with (``rl.learn``, ``rl.iteration_record``, ``credit.assign_credit``,
the flywheel's ``collect`` and ``route``, the mechanisms' hooks) take what they read instead, so a
unit test builds their inputs without a run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from turnforge.config import TrainConfig
from turnforge.policy.generate import PrefillCache
from turnforge.policy.model import Policy
from turnforge.rollout.engine import Engine, EngineEnv, RolloutEngine
from turnforge.rollout.episodic import EpisodicMemory
from turnforge.runs import RunDir
from turnforge.train.boundary import format_boundary, format_levels, measure_boundary, plan
from turnforge.train.common import event_counts
from turnforge.train.evaluate import evaluate, prefill_cache
from turnforge.train.metrics import BoundaryReport, EvalRecord
from turnforge.train.reporting import MetricsLog, Progress
from turnforge.train.run_dir.checkpoint import TrainerState
from turnforge.train.run_dir.interrupts import Interrupts
from turnforge.types import EvalResult, Trajectory


@dataclass
class Session:
    cfg: TrainConfig
    run: RunDir
    policy: Policy
    engine: Engine  # plays evaluation, demonstrations, value pretraining, Monte-Carlo and synchronous RL episodes
    metrics: MetricsLog
    progress: Progress
    state: TrainerState
    started: float = field(default_factory=time.time)
    wall_offset: float = 0.0  # wall seconds of earlier (interrupted) parts of the run
    rl_started: float | None = None  # time.time() when this process began the RL stage (rl.max_seconds)
    stop: Interrupts | None = None  # SIGINT/SIGTERM handling of the run (None: not handled)
    memory: EpisodicMemory | None = None  # episodic memory (memory.enabled), the engine's too

    def remember(self, trajectories: Iterable[tuple[Trajectory, str]], stage: str, iteration: int) -> int:
        """Add a stage's ``(trajectory, source)`` pairs to the episodic memory (its successes of
        the sources ``memory.sources`` names) and rewrite ``memory.parquet``; returns the entries
        added or shortened (0 without memory)."""
        if self.memory is None or self.memory.frozen:
            return 0
        changed = self.memory.add(trajectories, stage, iteration)  # (on several ranks: alike on each, from the same episodes)
        self.run.write(self.run.memory, self.memory.write)
        return changed

    @property
    def stop_requested(self) -> bool:
        """A signal asked the RL loop to stop after the iteration it is in."""
        return self.stop is not None and self.stop.requested is not None

    @property
    def env(self) -> EngineEnv:
        """The run's tasks (the engine's local env instance, or an agent run's task file)."""
        return self.engine.env

    @property
    def rollout_engine(self) -> RolloutEngine:
        """The engine, for stages that play env episodes (demonstrations, the flywheel, value
        pretraining, Monte-Carlo values, group streams); agent runs have none of them."""
        if not isinstance(self.engine, RolloutEngine):
            raise TypeError(f"this stage needs env episodes; the run's engine is a {type(self.engine).__name__}")
        return self.engine

    def wall_seconds(self) -> float:
        return self.wall_offset + time.time() - self.started

    def prefills(self) -> PrefillCache | None:
        """A prefill cache for evaluations of the current weights (``eval.prefill_cache_mb``), or
        None where it does not apply (see ``prefill_cache``; agent runs sample through the gateway)."""
        return prefill_cache(self.policy, self.cfg.eval.prefill_cache_mb) if isinstance(self.engine, RolloutEngine) else None

    def evaluate(self, tag: str, episodes: int | None = None, temperature: float | None = None,
                 prefills: PrefillCache | None = None) -> EvalResult:
        """Held-out evaluation (``eval`` section; ``episodes``/``temperature`` override it),
        logged as an ``eval`` event at the current env step. ``prefills``: a cache shared with other
        evaluations of the same weights (default: one of its own)."""
        e = self.cfg.eval
        episodes = e.episodes if episodes is None else episodes
        temperature = e.temperature if temperature is None else temperature
        with self.progress.activity(f"eval {tag}", episodes) as advance:
            result, trajectories = evaluate(
                self.engine, self.policy, episodes=episodes, split=e.split, temperature=temperature, seed=self.cfg.seed,
                max_failure_share=self.cfg.max_failure_share, stage=f"eval {tag}",
                prefills=prefills if prefills is not None else self.prefills(), on_progress=advance,
                episode_seed=self.cfg.episode_seed("eval", e.split, episodes))
        events = event_counts([t for t in trajectories if t.infra_failure is None])
        self.metrics.log(EvalRecord(tag, self.state.iteration, result, events, temperature), self.state.env_steps)
        first = next((t.infra_failure for t in trajectories if t.infra_failure is not None), None)
        failures = (f", {result.infra_failures} infrastructure failures left out; the first: {first[:160]}"
                    if result.infra_failures else "")
        self.progress.message(
            f"eval {tag}: success {result.success_rate:.3f}  return {result.mean_return:.2f}  "
            f"invalid {result.invalid_action_rate:.3f}  turns {result.mean_turns:.1f}  "
            f"{'' if result.tool_call_rate is None else f'tool calls {result.tool_call_rate:.3f}  '}"
            f"{'' if result.memory_recall_rate is None else f'shown a memory {result.memory_recall_rate:.2f}  '}({result.episodes} {e.split} episodes"
            f"{'' if temperature == e.temperature else f', T={temperature}'}{failures})"
        )
        if result.by_label:
            self.progress.message("  per task: " + ", ".join(f"{x.label} {x.success_rate:.2f} ({x.episodes})" for x in result.by_label))
        return result

    def boundary(self, tag: str, evaluation: EvalResult, prefills: PrefillCache | None = None) -> BoundaryReport | None:
        """pass@k and the other boundary figures of the current weights (``turnforge.train.boundary``;
        None with ``eval.pass_at_k_samples=0``), logged as a ``boundary`` event. Run after the
        evaluations of these weights (``evaluation``: the one at ``eval.temperature``); ``prefills``:
        their cache (default: one of its own)."""
        p = plan(self.cfg)
        if p is None:
            return None
        with self.progress.activity(f"pass@k {tag}", p.tasks * p.samples) as advance:
            report = measure_boundary(self.engine, self.policy, p, tag=tag, evaluation=evaluation,
                                      eval_temperature=self.cfg.eval.temperature,
                                      prefills=prefills if prefills is not None else self.prefills(),
                                      max_failure_share=self.cfg.max_failure_share, on_progress=advance)
        report = self.metrics.log(report, self.state.env_steps)
        self.progress.message(format_boundary(report))
        start = self.state.boundary_start
        if tag != "start" and start is not None and (line := format_levels(start, report)) is not None:
            self.progress.message(line)
        return report
