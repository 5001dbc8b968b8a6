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
import shutil
import time
from contextlib import ExitStack, closing
from pathlib import Path

import torch
import yaml

from turnforge.config import TrainConfig, config_from_dict
from turnforge.critic.value import build_value_model
from turnforge.envs.registry import build_env
from turnforge import errors
from turnforge.errors import UserError
from turnforge.memory import peak_memory
from turnforge.paths import check_out_dir, write_atomic
from turnforge.policy.gguf import cached_import, find_gguf
from turnforge.policy.lora import (
    ADAPTER_DIR, FrozenBase, add_lora, check_lora_targets, is_lora, merge_lora, skeleton, trainable_parameters,
)
from turnforge.policy.model import check_model_dir, load_policy
from turnforge.policy.tiny import build_tiny_model, tiny_hf_config
from turnforge.rollout.context import PromptSpec
from turnforge.rollout.engine import make_engine
from turnforge.envs.checker import check_action_lengths
from turnforge.train.checks import check_env_at_start, check_options
from turnforge.train.bc import run_bc
from turnforge.train.checkpoint import TrainerState, TrainingState, find_resumable, save_model, save_resumable
from turnforge.train.interrupts import Interrupts
from turnforge.train.flywheel import run_flywheel, write_flywheel_report
from turnforge.train.metrics import BestTemperature, ExpertQueries, RunSummary, RunWarning, Software, TemperatureEval, read_summary, to_json
from turnforge.train.rl import Critic, budget_spent, make_reference, pretrain_values, run_rl
from turnforge.train.reporting import MetricsLog, Progress, plot_learning_curve
from turnforge.train.rundir import LOCK, RunLock
from turnforge.train.session import Session
from turnforge.types import EvalResult



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


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse, before anything is written, a run directory this run cannot use: a file, an
    unwritable place, a directory that is not a run's, or (without ``--resume``) one that
    holds a run with a checkpoint. A directory left by a run that stopped before its first
    checkpoint is accepted (the new run starts it over)."""
    check_out_dir(run_dir, "run directory")
    if resume:
        return
    if run_dir.exists() and any(p.name != LOCK for p in run_dir.iterdir()):
        if not (run_dir / "config.yaml").exists():
            raise UserError(f"--out {str(run_dir)!r} is not empty and is not a turnforge run directory; "
                            "give a new or empty directory")
        if (run_dir / "summary.json").exists() or find_resumable(run_dir) is not None:
            raise UserError(f"output directory {str(run_dir)!r} already holds a run; use --resume {run_dir} or another --out")


def _clear_leftovers(run_dir: Path) -> bool:
    """Remove what a run that stopped before its first checkpoint left; True if there was any."""
    found = False
    for name in ("config.yaml", "metrics.jsonl", "tb", "trajectories", "base_model", "base_model.tmp", "checkpoints",
                 "learning_curve.png", "summary.json"):
        path = run_dir / name
        if path.exists():
            found = True
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return found


def train(cfg: TrainConfig, out: str | Path, *, resume: bool = False, live: bool | None = None,
          stop_after: int | None = None) -> RunSummary | None:
    """Run the whole job; returns its ``RunSummary`` (also written to ``out/summary.json``),
    or None when ``stop_after`` stopped it early.

    The run holds a lock on ``out`` for its life (a second writer gets a ``UserError``).
    SIGINT/SIGTERM raise ``Interrupted`` after leaving a resumable checkpoint (see
    ``turnforge.train.interrupts``). ``stop_after`` ends the process-level run after that
    many RL iterations in total, leaving a resumable checkpoint (used to test resume).
    """
    _quiet_hf()
    run_dir = Path(out)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    # 1. checks before any work (a bad env id, option, capability, model or run directory fails
    #    before anything is written), then the lock, the policy and the rollout engine
    agent = cfg.agent.entrypoint is not None
    if agent:  # an agent program through the gateway: its tasks file and entrypoint are checked now
        from turnforge.gateway.agents import AgentEngine, AgentTasks, load_agent

        agent_tasks, agent_fn = AgentTasks(cfg.agent.tasks, cfg.agent.heldout_fraction), load_agent(cfg.agent.entrypoint)
    else:
        env = build_env(cfg.env.id, cfg.env.kwargs, cfg.env.tasks, cfg.env.heldout_fraction)
        check_options(cfg, env)
        if cfg.check_env:
            check_env_at_start(cfg)
    if cfg.cluster == "ray":  # an unreachable cluster is a one-line error now, not after the BC stage
        from turnforge.envpool.ray_pool import connect_ray

        connect_ray(cfg.engine.ray_address)
    if cfg.rollout.backend == "vllm":  # not installed: one line now, not after set-up
        from turnforge.policy.vllm_sampler import require_vllm

        require_vllm()
    if cfg.model.gguf is not None:
        find_gguf(cfg.model.gguf)  # a missing package or file is one line now, not after set-up
    elif cfg.model.path != "tiny":
        check_model_dir(cfg.model.path)
    if cfg.model.lora.r > 0 and cfg.model.gguf is None:  # (a GGUF model's modules are checked once it is converted)
        from transformers import AutoConfig

        hf = tiny_hf_config(cfg.model.tiny) if cfg.model.path == "tiny" else AutoConfig.from_pretrained(cfg.model.path)
        check_lora_targets(skeleton(hf), list(cfg.model.lora.target_modules))
    check_run_dir(run_dir, resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        stack.enter_context(RunLock(run_dir))
        errors.current_run_dir.append(str(run_dir))
        stack.callback(errors.current_run_dir.remove, str(run_dir))
        progress = stack.enter_context(Progress(cfg.recipe, live=live))
        if resume and (run_dir / "summary.json").exists():
            summary = read_summary(run_dir)
            progress.message(f"run {run_dir} is finished ({summary.rl_iterations} RL iterations, held-out success "
                             f"{summary.eval_after_rl.success_rate:.3f}; see summary.json): nothing to resume")
            return summary
        found = find_resumable(run_dir) if resume else None
        if found is None:  # a new run, or one that stopped before its first checkpoint: start over
            if not resume:
                check_run_dir(run_dir, resume=False)  # again, under the lock
            if _clear_leftovers(run_dir):
                progress.message(f"{run_dir} held a run stopped before its first checkpoint; starting it over")
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
            state, training = TrainerState(), None
            if cfg.model.gguf is not None:
                model_path = cached_import(cfg.model.gguf)
            elif cfg.model.path == "tiny":
                model_path = run_dir / "base_model"
                build_tiny_model(model_path, cfg.model.tiny)
            else:
                model_path = Path(cfg.model.path)
        else:
            model_path, state, training = found.path, found.state, found.training
            for problem in found.skipped:
                progress.message(f"warning: {problem}; resuming from the previous checkpoint")
        stop = stack.enter_context(Interrupts(lambda: _where(run_dir, state, stop, cfg.flywheel.rounds > 0)))
        lora = cfg.model.lora
        if lora.r > 0 and found is not None:  # the BC policy (merged) plus the checkpoint's adapter
            policy = load_policy(run_dir / "checkpoints" / "bc", cfg.model.dtype)
            add_lora(policy, lora, cfg.seed, "rl", adapter_dir=found.path / ADAPTER_DIR)
        else:
            policy = load_policy(model_path, cfg.model.dtype)
            if lora.r > 0 and cfg.bc.enabled:
                add_lora(policy, lora, cfg.seed, "bc")
        policy.model.eval()
        policy.prefix_cache, policy.kv_cache_gib = cfg.rollout.prefix_cache, cfg.rollout.kv_cache_gib
        if cfg.rollout.backend == "vllm":  # the engine loads model_path; the policy's own weights are synced before use
            from turnforge.policy.vllm_sampler import VLLMSampler

            policy.sampler = VLLMSampler(model_path, seed=cfg.seed, max_model_len=cfg.rollout.max_context_tokens,
                                         dtype=cfg.model.dtype, kv_cache_gib=cfg.rollout.vllm_kv_cache_gib)
        if agent:  # the gateway starts with the run and stops with it
            engine = stack.enter_context(closing(AgentEngine(cfg, policy, run_dir, agent_tasks, agent_fn)))
            too_long = []
        else:
            prompt = PromptSpec.of(env, cfg.rollout.include_instructions, cfg.rollout.example_turns,
                                   cfg.rollout.tools_in_system_prompt)
            policy.chat.start(prompt.system, prompt.tools, prompt.examples, prompt.observation_role), policy.chat.turn(prompt.observation_role)  # template fits the env
            engine = stack.enter_context(closing(make_engine(cfg, policy)))
            too_long = check_action_lengths(engine.env, policy.chat, cfg.rollout.max_new_tokens) if cfg.check_env else []
        if training is not None:
            policy.version = training.version
        metrics = MetricsLog(run_dir, keep_until_env_steps=state.env_steps if found else None)
        stack.callback(metrics.close)
        if found is None:
            (run_dir / "metrics.jsonl").write_text("")

        s = Session(cfg, run_dir, policy, engine, metrics, progress, state, wall_offset=state.wall_seconds, stop=stop)
        if found is not None:
            progress.message(f"resuming {run_dir} from {found.path.name}/ at RL iteration {state.iteration} "
                             f"({state.env_steps} env steps)")
        for warning in too_long:
            progress.message(f"warning: {warning}")
            metrics.log(RunWarning(warning), state.env_steps)

        # 2. behaviour cloning warm start, then the reference evaluations: at eval.temperature and
        #    at each of eval.bc_temperatures (the best of them is the baseline learning is stated against)
        if found is None:
            state.bc = run_bc(s) if cfg.bc.enabled else None
            if policy.sampler is not None:  # BC changed the weights without a version bump
                policy.sampler.invalidate()
            if is_lora(policy.model):  # BC's adapter becomes part of the frozen base
                merge_lora(policy)
            save_model(policy, run_dir / "checkpoints" / "bc")
            if lora.r > 0:  # the flywheel and RL train a fresh adapter on top of the BC policy
                add_lora(policy, lora, cfg.seed, "rl")
            state.eval_before_rl = s.evaluate("before-rl")
            state.bc_temperatures = bc_at_temperatures(s, state.eval_before_rl)
            state.wall_seconds = s.wall_seconds()
            save_resumable(run_dir, policy, state, TrainingState(version=policy.version))

        # 3. the data flywheel (flywheel.rounds > 0): rounds of collect -> filter -> train -> evaluate
        optimizer = torch.optim.AdamW(trainable_parameters(policy.model), lr=cfg.rl.lr, weight_decay=0.0)
        if cfg.flywheel.rounds > 0 and state.stage == "bc":
            rounds = run_flywheel(s, optimizer)
            state.hints = rounds[-1].expert_queries
            state.stage = "flywheel"
            state.wall_seconds = s.wall_seconds()
            save_resumable(run_dir, policy, state, TrainingState(version=policy.version, optimizer=optimizer.state_dict()))

        # 4. the critic (rl.advantage=gae with critic.enabled): the BC policy's trunk plus a
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

        # 5. RL (a first SIGINT/SIGTERM finishes the iteration, checkpoints and stops)
        if training is not None and training.optimizer is not None:
            optimizer.load_state_dict(training.optimizer)
        bc_policy = None
        mc_by_bc = cfg.critic.mc_policy == "bc" and (cfg.critic.mc_weight > 0 or cfg.rl.advantage == "mc_grpo")
        if mc_by_bc or (cfg.rl.kl_coef > 0 and lora.r == 0):
            bc_policy = load_policy(run_dir / "checkpoints" / "bc", cfg.model.dtype)
            bc_policy.model = make_reference(bc_policy.model)
        if cfg.rl.kl_coef > 0 and is_lora(policy.model):  # the frozen base is the BC policy: no copy needed
            reference = FrozenBase(policy.model)
        else:
            reference = bc_policy.model if bc_policy is not None and cfg.rl.kl_coef > 0 else None
        stop.graceful = True
        run_rl(s, optimizer, reference, critic, bc_policy, stop_after)
        stop.graceful = False
        if stop.requested is not None:
            raise stop.stop_now(stop.requested)
        rl_seconds = time.time() - s.rl_started if s.rl_started is not None else None
        if state.iteration < cfg.rl.iterations and not budget_spent(s):
            return None

        # 6. final evaluation, checkpoint, summary, plot, flywheel report
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
            env_id=engine.env.env_id,
            env_kwargs={"entrypoint": cfg.agent.entrypoint, "tasks": cfg.agent.tasks} if agent else dict(cfg.env.kwargs), model=f"gguf:{cfg.model.gguf}" if cfg.model.gguf else cfg.model.path,
            num_parameters=sum(p.numel() for p in policy.model.parameters()),
            trainable_parameters=sum(p.numel() for p in trainable_parameters(policy.model)), torch_threads=cfg.threads,
            env_pool=engine.backend.stats() if cfg.engine.env_workers > 0 else None, software=Software.current(),
            peak_memory=peak_memory(),
            eval_bc_best_temperature=state.bc_temperatures, flywheel_rounds=cfg.flywheel.rounds,
            gain_over_bc_best_points=None if state.bc_temperatures is None else
            round(100 * (after.success_rate - state.bc_temperatures.eval.success_rate), 2),
            expert_queries=ExpertQueries(demos := (state.bc.demo_env_steps - state.bc.demo_random_actions) if state.bc else 0,
                                         state.hints, demos + state.hints),
        )
        write_atomic(run_dir / "summary.json", json.dumps(to_json(summary), indent=2) + "\n")
        plot_learning_curve(run_dir, f"{cfg.recipe} (seed {cfg.seed})")
        if cfg.flywheel.rounds > 0:
            write_flywheel_report(run_dir, summary)
        progress.message(
            f"done in {summary.wall_seconds:.0f}s: held-out success {before.success_rate:.3f} "
            f"{'after BC' if cfg.bc.enabled else 'at the start'} -> "
            f"{after.success_rate:.3f} at the end ({summary.success_gain_points:+.1f} points)"
            + ("" if summary.gain_over_bc_best_points is None else
               f", {summary.gain_over_bc_best_points:+.1f} points over the {start_name(cfg)} at its best temperature "
               f"(T={state.bc_temperatures.temperature}: {state.bc_temperatures.eval.success_rate:.3f})")
            + f"; run dir {run_dir}"
        )
    return summary


def start_name(cfg: TrainConfig) -> str:
    """What RL starts from, in messages: the BC policy, or the model itself without BC."""
    return "BC policy" if cfg.bc.enabled else "starting policy (no BC)"


def bc_at_temperatures(s: Session, at_default: EvalResult) -> BestTemperature | None:
    """The BC policy evaluated at each of ``eval.bc_temperatures`` (the evaluation at
    ``eval.temperature`` is reused); the best success rate wins, the lower temperature on a tie."""
    temps = s.cfg.eval.bc_temperatures
    if not temps:
        return None
    evals = [TemperatureEval(t, at_default if t == s.cfg.eval.temperature else s.evaluate("bc", temperature=t)) for t in temps]
    best = max(evals, key=lambda e: (e.result.success_rate, -e.temperature))
    s.progress.message(f"{start_name(s.cfg)} at its best temperature: T={best.temperature} success {best.result.success_rate:.3f} "
                       f"({', '.join(f'T={e.temperature}: {e.result.success_rate:.3f}' for e in evals)})")
    return BestTemperature(best.temperature, best.result, evals)


def _where(run_dir: Path, state: TrainerState, stop: Interrupts, flywheel: bool = False) -> str:
    """Where an interrupted run stopped and what ``--resume`` continues from."""
    resume = f"resume with: turnforge train --resume {run_dir}"
    if stop.requested is not None:
        return f"at RL iteration {state.iteration} (checkpoint saved); {resume}"
    found = find_resumable(run_dir)
    if found is None:
        return f"before the first checkpoint (during behaviour cloning or the first evaluation); {resume} (starts it over)"
    if flywheel and state.stage == "bc" and found.state.stage == "bc":
        return f"during the flywheel stage; {resume} (plays the flywheel again from the BC checkpoint)"
    return f"during RL iteration {state.iteration + 1}; {resume} (continues from RL iteration {found.state.iteration})"
