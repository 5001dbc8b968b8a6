"""One training run, top to bottom: set-up -> BC warm start -> eval, pass@k -> flywheel -> critic -> RL -> eval, pass@k -> save.

Run directory layout::

    DIR/config.yaml             the full resolved config
    DIR/metrics.jsonl, DIR/tb/  typed records (``turnforge.train.metrics``) and TensorBoard
    DIR/learning_curve.png      held-out success and return vs env steps, stages marked
    DIR/pass_at_k.png           pass@k of the start and after training (eval.pass_at_k_samples > 0)
    DIR/summary.json            headline numbers (``turnforge.train.metrics.RunSummary``)
    DIR/trajectories/*.parquet  one row per training sample (see turnforge.data.store)
    DIR/base_model/             the initial model (tiny recipes build it here)
    DIR/checkpoints/bc/         after behaviour cloning (HF format)
    DIR/checkpoints/last/       resumable: HF model + optimizer + counters
    DIR/checkpoints/final/      the trained policy (HF format)

``train(cfg, out, resume=True)`` on a directory with ``checkpoints/last`` continues
from there: weights, optimizer state and counters are restored and every random stream
is derived from (seed, stage, iteration), so the resumed run ends with the same weights
as an uninterrupted one. The set-up (checks, lock, policy, engine) is ``turnforge.app.setup``.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from turnforge.app.setup import freeze_bc, make_critic, open_run, preflight, rl_references
from turnforge.config import TrainConfig
from turnforge.dist import attach_trainer, init_world, load_optimizer_state
from turnforge.envs.base import close_env
from turnforge.paths import write_atomic
from turnforge.policy.generate import PrefillCache
from turnforge.policy.lora import trainable_parameters
from turnforge.policy.model import quiet_hf
from turnforge.train.bc import run_bc
from turnforge.train.flywheel import run_flywheel
from turnforge.train.flywheel_report import write_flywheel_report
from turnforge.train.metrics import BestTemperature, RunSummary, TemperatureEval, to_json
from turnforge.train.reporting import final_line, plot_learning_curve, plot_pass_at_k, run_summary, start_name
from turnforge.train.rl import budget_spent, run_rl, training_state
from turnforge.train.run_dir.checkpoint import save_model, save_resumable
from turnforge.train.session import Session
from turnforge.types import EvalResult


def train(cfg: TrainConfig, out: str | Path, *, resume: bool = False, live: bool | None = None,
          stop_after: int | None = None) -> RunSummary | None:
    """Run the whole job; returns its ``RunSummary`` (also written to ``out/summary.json``),
    or None when ``stop_after`` stopped it early.

    The run holds a lock on ``out`` for its life (a second writer gets a ``UserError``).
    SIGINT/SIGTERM raise ``Interrupted`` after leaving a resumable checkpoint (see
    ``turnforge.train.run_dir.interrupts``). ``stop_after`` ends the process-level run after
    that many RL iterations in total, leaving a resumable checkpoint (used to test resume).
    """
    quiet_hf()
    run_dir = Path(out)
    w = init_world(cfg.dist.backend, cfg.dist.timeout_s, cfg.model.device)  # a world of one unless launched on ranks
    torch.set_num_threads(cfg.threads if not w.distributed else max(1, cfg.threads // w.local_size))
    torch.manual_seed(cfg.seed)

    # 1. set-up: every check before any work, then (under the run's lock) a new run directory or
    #    the checkpoint to resume from, the policy, the engine, the metrics log
    checked = preflight(cfg, run_dir, resume)
    with ExitStack() as stack:
        stack.callback(close_env, checked.env)  # what the checks' env holds (a browser env's browser)
        run = open_run(cfg, run_dir, checked, stack, resume=resume, live=live)
        if isinstance(run, RunSummary):  # --resume of a finished run
            return run
        s, state, policy = run.session, run.session.state, run.session.policy

        # 2. behaviour cloning warm start, then the reference evaluations: at eval.temperature and
        #    at each of eval.bc_temperatures (the best of them is the baseline learning is stated against),
        #    then pass@k of the start (eval.pass_at_k_samples; its own random stream, after the evaluations)
        if run.resumed is None:
            state.bc = run_bc(s) if cfg.bc.enabled else None
            freeze_bc(s)
            prefills = s.prefills()
            state.eval_before_rl, state.bc_temperatures = evaluate_start(s, prefills)
            state.boundary_start = s.boundary("start", state.eval_before_rl, prefills)
            state.wall_seconds = s.wall_seconds()
            save_resumable(run_dir, policy, state, training_state(policy, None, memory=s.memory))

        # 3. the data flywheel (flywheel.rounds > 0): rounds of collect -> filter -> train -> evaluate
        if policy.trainer is None:
            attach_trainer(policy)  # on several ranks: the sharded copy updates run through (turnforge.dist)
        optimizer = torch.optim.AdamW(trainable_parameters(policy.train_model), lr=cfg.rl.lr, weight_decay=0.0)
        training = run.training  # the resumed checkpoint's optimizer (and critic) state, if any
        if cfg.flywheel.rounds > 0 and state.stage == "bc":
            if training is not None and training.flywheel is not None:  # stopped between two rounds
                load_optimizer_state(policy.train_model, optimizer, training.optimizer)
            rounds = run_flywheel(s, optimizer, training.flywheel if training is not None else None)
            training = None  # the optimizer is the flywheel's own now
            state.hints = rounds[-1].expert_queries
            state.anchor_moves = rounds[-1].anchor_expert_moves
            state.stage = "flywheel"
            state.wall_seconds = s.wall_seconds()
            save_resumable(run_dir, policy, state, training_state(policy, optimizer, memory=s.memory))

        # 4. the critic (rl.advantage=gae with critic.enabled): the BC policy's trunk plus a
        #    value head, pretrained on Monte-Carlo returns of the BC policy
        critic = make_critic(s, training)

        # 5. RL (a first SIGINT/SIGTERM finishes the iteration, checkpoints and stops)
        if training is not None and training.optimizer is not None:
            load_optimizer_state(policy.train_model, optimizer, training.optimizer)
        bc_policy, reference = rl_references(cfg, run_dir, policy)
        s.stop.graceful = True
        run_rl(s, optimizer, reference, critic, bc_policy, stop_after)
        s.stop.graceful = False
        if s.stop.requested is not None:
            raise s.stop.stop_now(s.stop.requested)
        rl_seconds = time.time() - s.rl_started if s.rl_started is not None else None
        if state.iteration < cfg.rl.iterations and not budget_spent(s):
            return None

        # 6. final evaluation and pass@k, checkpoint, summary, plots, flywheel report
        prefills = s.prefills()
        after = s.evaluate("after-rl", prefills=prefills)
        boundary_after = s.boundary("after", after, prefills)
        save_model(policy, run_dir / "checkpoints" / "final")
        state.wall_seconds = s.wall_seconds()
        summary = run_summary(cfg, state, policy, s.engine, run_dir, after, rl_seconds, boundary_after)
        if not w.main:  # rank 0 writes the summary, plots and report
            return summary
        write_atomic(run_dir / "summary.json", json.dumps(to_json(summary), indent=2) + "\n")
        plot_learning_curve(run_dir, f"{cfg.recipe} (seed {cfg.seed})")
        if summary.boundary_start is not None or summary.boundary_after is not None:
            plot_pass_at_k(run_dir, summary, f"{cfg.recipe} (seed {cfg.seed})")
        if cfg.flywheel.rounds > 0:
            write_flywheel_report(run_dir, summary, cfg)
        s.progress.message(final_line(summary, cfg, run_dir))
    return summary


def evaluate_start(s: Session, prefills: PrefillCache | None = None) -> tuple[EvalResult, BestTemperature | None]:
    """The policy RL starts from (the BC policy, or the model without BC) evaluated at
    ``eval.temperature`` (the run's evaluation before RL) and at each other of
    ``eval.bc_temperatures``; the best success rate wins, the lower temperature on a tie.
    They play the same tasks with the same weights, so they share one ``PrefillCache``: a
    prompt is prefilled once, whichever evaluation meets it first (same results, bit for bit);
    ``prefills``: that cache, to share it further (default: one of its own)."""
    prefills = prefills if prefills is not None else s.prefills()
    before = s.evaluate("before-rl", prefills=prefills)
    temps = s.cfg.eval.bc_temperatures
    if not temps:
        return before, None
    evals = [TemperatureEval(t, before if t == s.cfg.eval.temperature else s.evaluate("bc", temperature=t, prefills=prefills))
             for t in temps]
    best = max(evals, key=lambda e: (e.result.success_rate, -e.temperature))
    s.progress.message(f"{start_name(s.cfg)} at its best temperature: T={best.temperature} success {best.result.success_rate:.3f} "
                       f"({', '.join(f'T={e.temperature}: {e.result.success_rate:.3f}' for e in evals)})")
    return before, BestTemperature(best.temperature, best.result, evals)
