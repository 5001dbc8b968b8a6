"""One training run, top to bottom: set-up -> BC warm start -> eval, pass@k -> flywheel -> critic -> RL -> eval, pass@k -> save.

What the run writes and where (the run directory's layout, and the rule that rank 0 alone writes
it) is ``turnforge.runs``.

``train(cfg, out, resume=True)`` on a directory with ``checkpoints/last`` continues
from there: weights, optimizer state and counters are restored and every random stream
is derived from (seed, stage, iteration), so the resumed run ends with the same weights
as an uninterrupted one. The set-up (checks, lock, policy, engine) is ``turnforge.app.setup``.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch

from turnforge.app.setup import freeze_bc, make_critic, open_run, preflight, rl_references
from turnforge.config import TrainConfig
from turnforge.dist import attach_trainer, init_world, load_optimizer_state
from turnforge.envs.base import close_env
from turnforge.policy.generate import PrefillCache
from turnforge.policy.lora import trainable_parameters
from turnforge.policy.model import quiet_hf
from turnforge.train.bc import run_bc
from turnforge.train.flywheel import run_flywheel
from turnforge.train.flywheel_report import write_flywheel_report
from turnforge.train.metrics import BestTemperature, RunSummary, TemperatureEval, read_metrics, to_json
from turnforge.train.reporting import final_line, plot_learning_curve, plot_pass_at_k, run_summary, start_name
from turnforge.train.rl import budget_spent, run_rl, training_state
from turnforge.train.run_dir.checkpoint import TrainingState, save_model, save_resumable
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
        opened = open_run(cfg, run_dir, checked, stack, resume=resume, live=live)
        if isinstance(opened, RunSummary):  # --resume of a finished run
            return opened
        s, state, policy = opened.session, opened.session.state, opened.session.policy

        # 2. behaviour cloning warm start, then the reference evaluations: at eval.temperature and
        #    at each of eval.bc_temperatures (the best of them is the baseline learning is stated against),
        #    then pass@k of the start (eval.pass_at_k_samples; its own random stream, after the evaluations)
        if opened.resumed is None:
            warm_start(s)

        # 3. the data flywheel (flywheel.rounds > 0): rounds of collect -> filter -> train -> evaluate
        if policy.trainer is None:
            attach_trainer(policy)  # on several ranks: the sharded copy updates run through (turnforge.dist)
        optimizer = torch.optim.AdamW(trainable_parameters(policy.train_model), lr=cfg.rl.lr, weight_decay=0.0)
        training = opened.training  # the resumed checkpoint's optimizer (and critic) state, if any
        if cfg.flywheel.rounds > 0 and state.stage == "bc":
            flywheel_stage(s, optimizer, training)
            training = None  # the optimizer is the flywheel's own now

        # 4. the critic (rl.advantage=gae with critic.enabled): the BC policy's trunk plus a
        #    value head, pretrained on Monte-Carlo returns of the BC policy
        critic = make_critic(s, training)

        # 5. RL (a first SIGINT/SIGTERM finishes the iteration, checkpoints and stops)
        if training is not None and training.optimizer is not None:
            load_optimizer_state(policy.train_model, optimizer, training.optimizer)
        bc_policy, reference = rl_references(cfg, s.run, policy)
        s.stop.graceful = True
        run_rl(s, optimizer, reference, critic, bc_policy, stop_after)
        s.stop.graceful = False
        if s.stop.requested is not None:
            raise s.stop.stop_now(s.stop.requested)
        rl_seconds = time.time() - s.rl_started if s.rl_started is not None else None
        if state.iteration < cfg.rl.iterations and not budget_spent(s):
            return None

        # 6. final evaluation and pass@k, checkpoint, summary, plots, flywheel report
        return finish(s, rl_seconds)


def warm_start(s: Session) -> None:
    """Step 2 of a new run: behaviour cloning (``bc.enabled``), the BC policy frozen as
    ``checkpoints/bc``, its evaluations (``evaluate_start``) and pass@k, then the first resumable
    checkpoint."""
    state = s.state
    state.bc = run_bc(s) if s.cfg.bc.enabled else None
    freeze_bc(s)
    prefills = s.prefills()
    state.eval_before_rl, state.bc_temperatures = evaluate_start(s, prefills)
    state.boundary_start = s.boundary("start", state.eval_before_rl, prefills)
    state.wall_seconds = s.wall_seconds()
    save_resumable(s.run, s.policy, state, training_state(s.policy, None, memory=s.memory))


def flywheel_stage(s: Session, optimizer: torch.optim.Optimizer, training: TrainingState | None) -> None:
    """Step 3: the flywheel's rounds (``run_flywheel``), from where ``training`` (a checkpoint
    taken between two rounds) stopped; then the stage's resumable checkpoint."""
    state = s.state
    if training is not None and training.flywheel is not None:  # stopped between two rounds
        load_optimizer_state(s.policy.train_model, optimizer, training.optimizer)
    rounds = run_flywheel(s, optimizer, training.flywheel if training is not None else None)
    state.hints = rounds[-1].expert_queries
    state.anchor_moves = rounds[-1].anchor_expert_moves
    state.stage = "flywheel"
    state.wall_seconds = s.wall_seconds()
    save_resumable(s.run, s.policy, state, training_state(s.policy, optimizer, memory=s.memory))


def finish(s: Session, rl_seconds: float | None) -> RunSummary:
    """Step 6: the final evaluation and pass@k, ``checkpoints/final``, then the run's record:
    ``summary.json``, the learning curve, pass@k (when measured) and the flywheel's report
    (rank 0 writes them, through ``turnforge.runs.RunDir``)."""
    cfg, state, policy, run = s.cfg, s.state, s.policy, s.run
    prefills = s.prefills()
    after = s.evaluate("after-rl", prefills=prefills)
    boundary_after = s.boundary("after", after, prefills)
    save_model(run, policy, run.checkpoint("final"))
    state.wall_seconds = s.wall_seconds()
    summary = run_summary(cfg, state, policy, s.engine, run, after, rl_seconds, boundary_after)
    title = f"{cfg.recipe} (seed {cfg.seed})"
    run.write_json(run.summary, to_json(summary))
    run.write(run.learning_curve, lambda out: plot_learning_curve(out, read_metrics(run), title))
    if summary.boundary_start is not None or summary.boundary_after is not None:
        run.write(run.pass_at_k, partial(plot_pass_at_k, summary=summary, title=title))
    if cfg.flywheel.rounds > 0:
        write_flywheel_report(run, summary, cfg)
    s.progress.message(final_line(summary, cfg, run))  # (quiet on the other ranks)
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
