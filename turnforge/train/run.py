"""One training run, top to bottom: set-up -> BC warm start -> eval -> critic -> RL -> eval -> save.

Run directory layout::

    DIR/config.yaml             the full resolved config
    DIR/metrics.jsonl, DIR/tb/  typed records (``turnforge.train.metrics``) and TensorBoard
    DIR/learning_curve.png      held-out success and return vs env steps, stages marked
    DIR/summary.json            headline numbers (``turnforge.train.metrics.RunSummary``)
    DIR/trajectories/*.parquet  one row per training sample (see turnforge.data.store)
    DIR/base_model/             the initial model (tiny recipes build it here)
    DIR/checkpoints/bc/         after behaviour cloning (HF format)
    DIR/checkpoints/last/       resumable: HF model + optimizer + counters
    DIR/checkpoints/final/      the trained policy (HF format)

``train(cfg, out, resume=True)`` on a directory with ``checkpoints/last`` continues
from there: weights, optimizer state and counters are restored and every random stream
is derived from (seed, stage, iteration), so the resumed run ends with the same weights
as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import closing
from pathlib import Path

import torch
import yaml

from turnforge.config import TrainConfig, config_from_dict
from turnforge.critic.value import build_value_model
from turnforge.envs.registry import build_env
from turnforge.errors import UserError
from turnforge.policy.model import load_policy
from turnforge.policy.tiny import build_tiny_model
from turnforge.rollout.context import PromptSpec
from turnforge.rollout.engine import make_engine
from turnforge.envs.checker import check_action_lengths
from turnforge.train.checks import check_env_at_start, check_options
from turnforge.train.bc import run_bc
from turnforge.train.checkpoint import TrainerState, TrainingState, load_trainer_state, save_model, save_resumable
from turnforge.train.metrics import RunSummary, RunWarning, to_json
from turnforge.train.rl import Critic, budget_spent, make_reference, pretrain_values, run_rl
from turnforge.train.reporting import MetricsLog, Progress, plot_learning_curve
from turnforge.train.session import Session



def _quiet_hf() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_run_config(run_dir: Path) -> TrainConfig:
    path = run_dir / "config.yaml"
    if not path.exists():
        raise UserError(f"--resume {str(run_dir)!r}: no config.yaml there; is it a turnforge run directory?")
    return config_from_dict(yaml.safe_load(path.read_text()))


def train(cfg: TrainConfig, out: str | Path, *, resume: bool = False, live: bool | None = None,
          stop_after: int | None = None) -> RunSummary | None:
    """Run the whole job; returns its ``RunSummary`` (also written to ``out/summary.json``),
    or None when ``stop_after`` stopped it early.

    ``stop_after`` ends the process-level run after that many RL iterations in total,
    leaving a resumable checkpoint (used to test resume; a real interruption works the
    same from the last checkpoint).
    """
    _quiet_hf()
    run_dir = Path(out)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    # 1. the env (first: a bad env id, option or missing capability fails before any model work),
    #    run directory, policy, the rollout engine
    env = build_env(cfg.env.id, cfg.env.kwargs, cfg.env.tasks, cfg.env.heldout_fraction)
    check_options(cfg, env)
    if cfg.check_env:
        check_env_at_start(cfg)
    if cfg.cluster == "ray":  # an unreachable cluster is a one-line error now, not after the BC stage
        from turnforge.envpool.ray_pool import connect_ray

        connect_ray(cfg.engine.ray_address)
    if cfg.model.path != "tiny" and not (Path(cfg.model.path) / "config.json").exists():
        load_policy(cfg.model.path)  # raises the UserError that says what is wrong with the path
    resumed = load_trainer_state(run_dir) if resume else None
    if not resume:
        if (run_dir / "checkpoints").exists():
            raise UserError(f"output directory {str(run_dir)!r} already holds a run; use --resume {run_dir} or another --out")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    if resumed is not None:
        model_path, state, training = resumed
    else:
        state, training = TrainerState(), None
        if cfg.model.path == "tiny":
            model_path = run_dir / "base_model"
            if not (model_path / "config.json").exists():
                build_tiny_model(model_path, cfg.model.tiny)
        else:
            model_path = Path(cfg.model.path)
    policy = load_policy(model_path, cfg.model.dtype)
    policy.model.eval()
    prompt = PromptSpec.of(env, cfg.rollout.include_instructions)
    policy.chat.start(prompt.system, prompt.tools), policy.chat.turn(prompt.observation_role)  # template fits the env
    n_envs = max(cfg.rl.tasks_per_iteration * cfg.rl.group_size, min(cfg.eval.episodes, 256))
    engine = make_engine(cfg, policy, n_envs)
    too_long = check_action_lengths(engine.env, policy.chat, cfg.rollout.max_new_tokens) if cfg.check_env else []
    if training is not None:
        policy.version = training.version
    metrics = MetricsLog(run_dir, keep_until_env_steps=state.env_steps if resumed else None)
    if not resumed:
        (run_dir / "metrics.jsonl").write_text("")

    with Progress(cfg.recipe, live=live) as progress, closing(engine):
        s = Session(cfg, run_dir, policy, engine, metrics, progress, state, wall_offset=state.wall_seconds)
        if resumed is not None:
            progress.message(f"resuming {run_dir} at RL iteration {state.iteration} ({state.env_steps} env steps)")
        for warning in too_long:
            progress.message(f"warning: {warning}")
            metrics.log(RunWarning(warning), state.env_steps)

        # 2. behaviour cloning warm start, then the reference evaluation
        if resumed is None:
            state.bc = run_bc(s) if cfg.bc.enabled else None
            save_model(policy, run_dir / "checkpoints" / "bc")
            state.eval_before_rl = s.evaluate("before-rl")
            state.wall_seconds = s.wall_seconds()
            save_resumable(run_dir, policy, state, TrainingState(version=policy.version))

        # 3. the critic (rl.advantage=gae with critic.enabled): the BC policy's trunk plus a
        #    value head, pretrained on Monte-Carlo returns of the BC policy
        critic = None
        if cfg.critic.enabled:
            model = build_value_model(policy.model, cfg.critic.init, cfg.seed)
            critic = Critic(model, torch.optim.AdamW(model.parameters(), lr=cfg.critic.lr, weight_decay=0.0))
            if training is not None and training.critic is not None:
                critic.model.load_state_dict(training.critic)
                critic.optimizer.load_state_dict(training.critic_optimizer)
            elif cfg.critic.pretrain_episodes > 0:
                state.value_pretrain = pretrain_values(s, critic)

        # 4. RL
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=cfg.rl.lr, weight_decay=0.0)
        if training is not None and training.optimizer is not None:
            optimizer.load_state_dict(training.optimizer)
        bc_policy = None
        mc_by_bc = cfg.critic.mc_policy == "bc" and (cfg.critic.mc_weight > 0 or cfg.rl.advantage == "mc_grpo")
        if cfg.rl.kl_coef > 0 or mc_by_bc:
            bc_policy = load_policy(run_dir / "checkpoints" / "bc", cfg.model.dtype)
            bc_policy.model = make_reference(bc_policy.model)
        reference = bc_policy.model if bc_policy is not None and cfg.rl.kl_coef > 0 else None
        run_rl(s, optimizer, reference, critic, bc_policy, stop_after)
        rl_seconds = time.time() - s.rl_started if s.rl_started is not None else None
        if state.iteration < cfg.rl.iterations and not budget_spent(s):
            metrics.close()
            return None

        # 5. final evaluation, checkpoint, summary, plot
        after = s.evaluate("after-rl")
        save_model(policy, run_dir / "checkpoints" / "final")
        state.wall_seconds = s.wall_seconds()
        before = state.eval_before_rl
        summary = RunSummary(
            recipe=cfg.recipe, seed=cfg.seed, wall_seconds=round(state.wall_seconds, 2), env_steps=state.env_steps,
            mc_env_steps=state.mc_env_steps, train_tokens=state.train_tokens, eval_before_rl=before, eval_after_rl=after,
            success_gain_points=round(100 * (after.success_rate - before.success_rate), 2), rl_iterations=state.iteration,
            rl_seconds=None if rl_seconds is None else round(rl_seconds, 2), engine_mode=cfg.engine.mode,
            eta=cfg.engine.eta, env_workers=cfg.engine.env_workers, cluster=cfg.cluster, policy_version=policy.version,
            skipped_steps=state.skipped_steps, advantage=cfg.rl.advantage, bc=state.bc, value_pretrain=state.value_pretrain,
            env_id=cfg.env.id, env_kwargs=dict(cfg.env.kwargs), model=cfg.model.path,
            num_parameters=sum(p.numel() for p in policy.model.parameters()), torch_threads=cfg.threads,
            env_pool=engine.backend.stats() if cfg.engine.env_workers > 0 else None,
        )
        (run_dir / "summary.json").write_text(json.dumps(to_json(summary), indent=2) + "\n")
        metrics.close()
        plot_learning_curve(run_dir, f"{cfg.recipe} (seed {cfg.seed})")
        progress.message(
            f"done in {summary.wall_seconds:.0f}s: held-out success {before.success_rate:.3f} after BC -> "
            f"{after.success_rate:.3f} after RL ({summary.success_gain_points:+.1f} points); run dir {run_dir}"
        )
    return summary
