"""The set-up of a training run, so that ``turnforge.app.run.train`` reads as the job itself.

- ``preflight``: every check that can fail before any work (env id, options against the env's
  capabilities, ``check_env``, agent entrypoint and tasks, Ray, vLLM, the model, LoRA
  targets, the run directory), with nothing written;
- ``open_run``: under the run's lock, a new run directory (config, base model) or the
  checkpoint to resume from, signal handling, the policy (LoRA, vLLM sampler), the engine
  (the rollout engine, or the gateway's agent engine), the metrics log and the ``Session``;
- ``freeze_bc``: the BC policy saved as ``checkpoints/bc`` (LoRA merged in, a fresh adapter
  for what follows);
- ``make_critic`` and ``rl_references``: what the RL stage needs beside the policy (the
  learned critic, the frozen BC policy and the KL reference).
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack, closing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from turnforge import errors
from turnforge.algos.estimators import ESTIMATORS
from turnforge.app.config import config_from_dict
from turnforge.app.rules import check_run
from turnforge.config import TrainConfig
from turnforge.critic.value import build_value_model
from turnforge.dist import (
    attach_trainer,
    broadcast,
    broadcast_weights,
    load_optimizer_state,
    publish_weights,
    sharded_copy,
    world,
)
from turnforge.envs.base import Env
from turnforge.envs.checker import check_action_lengths
from turnforge.envs.registry import build_env
from turnforge.errors import UserError
from turnforge.inference.client import open_sampler, start_replicas
from turnforge.paths import check_out_dir
from turnforge.policy.gguf import cached_import, find_gguf
from turnforge.policy.lora import (
    ADAPTER_DIR,
    FrozenBase,
    add_lora,
    check_lora_targets,
    is_lora,
    merge_lora,
    skeleton,
    thinking_rows,
)
from turnforge.policy.model import (
    ChatFormat,
    Policy,
    check_model_dir,
    load_policy,
    resolve_device,
    use_gradient_checkpointing,
)
from turnforge.policy.tiny import (
    add_thinking,
    build_tiny_model,
    build_tokenizer,
    cached_thinking,
    default_corpus,
    tiny_hf_config,
)
from turnforge.policy.vision import check_first_images
from turnforge.rollout.context import CONTEXTS, PromptSpec, check_summary_budget
from turnforge.rollout.engine import Engine, RolloutEngine, make_engine
from turnforge.rollout.episodic import EpisodicMemory, read_store
from turnforge.runs import RunDir
from turnforge.train.checks import check_env_at_start
from turnforge.train.metrics import RunSummary, RunWarning, read_summary
from turnforge.train.reporting import MetricsLog, Progress, SilentMetricsLog
from turnforge.train.rl import Critic, make_reference, pretrain_values
from turnforge.train.run_dir.checkpoint import Resumable, TrainerState, TrainingState, find_resumable, save_model
from turnforge.train.run_dir.interrupts import Interrupts
from turnforge.train.session import Session


def load_run_config(run_dir: Path) -> TrainConfig:
    """The config a run directory was started with (``--resume``)."""
    path = RunDir(run_dir).config
    if not path.exists():
        raise UserError(f"--resume {str(run_dir)!r}: no {path.name} there; is it a turnforge run directory?")
    return config_from_dict(yaml.safe_load(path.read_text()))


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse, before anything is written, a run directory this run cannot use: a file, an
    unwritable place, a directory that is not a run's, or (without ``--resume``) one that
    holds a run with a checkpoint. A directory left by a run that stopped before its first
    checkpoint is accepted (the new run starts it over)."""
    check_out_dir(run_dir, "run directory")
    if resume:
        return
    run = RunDir(run_dir)
    if run_dir.exists() and any(p.name != run.lock.name for p in run_dir.iterdir()):
        if not run.config.exists():
            raise UserError(f"--out {str(run_dir)!r} is not empty and is not a turnforge run directory; "
                            "give a new or empty directory")
        if run.summary.exists() or find_resumable(run) is not None:
            raise UserError(f"output directory {str(run_dir)!r} already holds a run; use --resume {run_dir} or another --out")


@dataclass(frozen=True)
class Checked:
    """What ``preflight`` built while checking: the run's env, or the agent's tasks and callable."""

    env: Env | None
    agent_tasks: Any = None  # turnforge.gateway.agents.AgentTasks (agent runs)
    agent_fn: Callable[..., Any] | None = None
    memory: EpisodicMemory | None = None  # memory.store's (read-only) memory


def preflight(cfg: TrainConfig, run_dir: Path, resume: bool) -> Checked:
    """Every check that can fail before any work; a bad env id, option, capability, model or run
    directory is one ``UserError`` line with nothing written. Creates ``run_dir`` at the end."""
    if cfg.agent.entrypoint is not None:  # an agent program through the gateway: its tasks file and entrypoint now
        from turnforge.gateway.agents import AgentTasks, load_agent

        checked = Checked(None, AgentTasks(cfg.agent.tasks, cfg.agent.heldout_fraction), load_agent(cfg.agent.entrypoint))
    else:
        env = build_env(cfg.env.id, cfg.env.kwargs, cfg.env.tasks, cfg.env.heldout_fraction)
        stored = read_store(cfg.memory, env.env_id) if cfg.memory.enabled and cfg.memory.store is not None else None
        checked = Checked(env, memory=stored)
        check_run(cfg, checked.env)  # the options against the env and the model (turnforge.app.rules)
        if cfg.check_env:
            check_env_at_start(cfg)
    if cfg.cluster == "ray" or (cfg.rollout.backend == "server" and cfg.rollout.server.launch == "ray"):
        # an unreachable cluster (or Ray not installed) is a one-line error now, not after the BC stage
        from turnforge.envpool.ray_pool import connect_ray

        connect_ray(cfg.engine.ray_address)
    resolve_device(cfg.model.device)  # a GPU asked for and absent: one line now, not after set-up
    if cfg.rollout.backend == "vllm":  # not installed: one line now, not after set-up
        from turnforge.policy.vllm_sampler import require_vllm

        require_vllm()
    if cfg.rollout.backend == "server":  # a replica that does not answer: one line now, before the run dir is written
        from turnforge.inference.client import check_urls

        check_urls(cfg.rollout.server)
    if cfg.model.gguf is not None:
        find_gguf(cfg.model.gguf)  # a missing package or file is one line now, not after set-up
    elif cfg.model.path != "tiny":
        check_model_dir(cfg.model.path)
    if cfg.model.lora.r > 0 and cfg.model.gguf is None:  # (a GGUF model's modules are checked once it is converted)
        from transformers import AutoConfig

        hf = tiny_hf_config(cfg.model.tiny) if cfg.model.path == "tiny" else AutoConfig.from_pretrained(cfg.model.path)
        check_lora_targets(skeleton(hf), list(cfg.model.lora.target_modules))
    if CONTEXTS[cfg.rollout.context].writes_summaries and cfg.model.gguf is None:  # (a GGUF model's: once converted)
        check_summary_budget(ChatFormat(_tokenizer(cfg)), cfg.rollout)
    RunDir(run_dir).write(run_dir, partial(_make_run_dir, resume=resume))
    return checked


def _make_run_dir(run_dir: Path, *, resume: bool) -> None:
    """``check_run_dir``, then the directory made (with its parents)."""
    check_run_dir(run_dir, resume)
    run_dir.mkdir(parents=True, exist_ok=True)


def _tokenizer(cfg: TrainConfig) -> Any:
    """The run's tokenizer, before any model is built: the tiny model's is trained (seconds)."""
    if cfg.model.path == "tiny":
        tiny = cfg.model.tiny
        return build_tokenizer(default_corpus(tiny.corpus_episodes, tiny.corpus_envs), tiny.vocab_size, tiny.split_digits,
                               cfg.model.thinking)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    return add_thinking(tok) if cfg.model.thinking else tok


@dataclass(frozen=True)
class OpenRun:
    """A run ready to train (``open_run``)."""

    session: Session
    resumed: Resumable | None  # the checkpoint this run resumes from (None: a new run)

    @property
    def training(self) -> TrainingState | None:
        """The optimizer and critic state to resume with (None for a new run)."""
        return self.resumed.training if self.resumed is not None else None


def open_run(cfg: TrainConfig, run_dir: Path, checked: Checked, stack: ExitStack, *, resume: bool,
             live: bool | None) -> OpenRun | RunSummary:
    """Take the run directory (its lock, for the life of ``stack``) and build what the stages share:
    a new run's config and base model, or the newest complete checkpoint with ``resume``;
    SIGINT/SIGTERM handling; the policy and the engine; the metrics log; the ``Session``.
    ``--resume`` of a run that already finished returns its summary (nothing to do)."""
    run = RunDir(run_dir)  # its writers obey the rank rule: on several trainer ranks rank 0 alone writes
    stack.enter_context(run.hold())
    errors.current_run_dir.append(str(run_dir))
    stack.callback(errors.current_run_dir.remove, str(run_dir))
    progress = stack.enter_context(Progress(cfg.recipe, live=live, quiet=not world().main))  # rank 0's display is the run's
    what = f"agent {cfg.agent.entrypoint}" if cfg.agent.entrypoint is not None else f"env {cfg.env.id}"
    progress.message(f"run directory {run_dir}: recipe {cfg.recipe}, {what}, seed {cfg.seed}")  # first: a log's head says what runs
    if resume and run.summary.exists():
        summary = read_summary(run)
        progress.message(f"run {run_dir} is finished ({summary.rl_iterations} RL iterations, held-out success "
                         f"{summary.eval_after_rl.success_rate:.3f}; see {run.summary.name}): nothing to resume")
        return summary
    found = find_resumable(run) if resume else None
    if found is None:  # a new run, or one that stopped before its first checkpoint: start over
        state, training = TrainerState(), None
        # rank 0 writes the config and the base model; every rank loads the model it names
        model_path = Path(broadcast(run.write(run.root, partial(_new_run, cfg, resume=resume, progress=progress))))
    else:
        model_path, state, training = found.path, found.state, found.training
        for problem in found.skipped:
            progress.message(f"warning: {problem}; resuming from the previous checkpoint")
    stop = stack.enter_context(Interrupts(lambda: _where(run, state, stop, cfg.flywheel.rounds > 0)))
    policy = _load_policy(cfg, run, model_path, found)
    broadcast_weights(policy.model)  # every rank starts from rank 0's weights (a no-op in a world of one)
    if cfg.rollout.backend == "server":  # the inference replicas (closed with the run), each checked to serve this model
        from turnforge.gateway.ray_replicas import start_ray_replicas  # Ray and the gateway: optional extras

        srv = cfg.rollout.server
        launch = (partial(start_ray_replicas, address=cfg.engine.ray_address, resources=srv.ray_resources)
                  if srv.launch == "ray" else start_replicas)
        policy.sampler = open_sampler(srv, policy, model_dir=model_path, run=run,
                                      context=cfg.rollout.max_context_tokens, max_new_tokens=cfg.rollout.max_new_tokens,
                                      dtype=cfg.model.dtype, device=cfg.model.device, prefix_cache=cfg.rollout.prefix_cache,
                                      seed=cfg.seed, launch=launch, log=progress.message)
        stack.callback(policy.sampler.close)
    engine, too_long = _make_engine(cfg, policy, run, checked, stack)
    if training is not None:
        policy.version = training.version
    if found is not None:  # on several ranks with inference replicas: the weights resumed from, to them
        publish_weights(policy)  # (a new run's first push is freeze_bc's)
    memory = None
    if cfg.memory.enabled and isinstance(engine, RolloutEngine):  # memory.store's, or the run's own (as checkpointed)
        memory = checked.memory or EpisodicMemory.from_state(cfg.memory, engine.env.env_id,
                                                             training.memory if training is not None else None)
        engine.memory = memory
    if found is None:
        run.write_text(run.metrics, "")  # a new run's log starts empty
    # rank 0's log is the run's; the other ranks' records are stamped alike and dropped
    metrics = run.write(run.root, partial(MetricsLog, keep_until_env_steps=state.env_steps if found else None)) or SilentMetricsLog()
    stack.callback(metrics.close)
    s = Session(cfg, run, policy, engine, metrics, progress, state, wall_offset=state.wall_seconds, stop=stop,
                memory=memory)
    if found is not None:
        where = (f"after flywheel round {state.flywheel_rounds_done}" if state.stage == "bc" and state.flywheel_rounds_done
                 else f"at RL iteration {state.iteration}")
        progress.message(f"resuming {run_dir} from {found.path.name}/ {where} ({state.env_steps} env steps)")
    for warning in too_long:
        progress.message(f"warning: {warning}")
        metrics.log(RunWarning(warning), state.env_steps)
    if checked.env is None:  # the agent engine's one warning (sampling settings the trainer overrode) is the run's
        def warn(message: str) -> None:
            progress.message(f"warning: {message}")
            metrics.log(RunWarning(message), s.state.env_steps)

        engine.on_warning = warn
    return OpenRun(s, found)


def _new_run(cfg: TrainConfig, root: Path, *, resume: bool, progress: Progress) -> Path:
    """A new run's files in ``root`` (rank 0, through ``RunDir.write``): the directory checked
    again (under the lock), what a run stopped before its first checkpoint left cleared, the
    config and the base model; returns the path of the model the run starts from."""
    run = RunDir(root)
    if not resume:
        check_run_dir(root, resume=False)  # again, under the lock
    if _clear_leftovers(run):
        progress.message(f"{run} held a run stopped before its first checkpoint; starting it over")
    run.write_text(run.config, yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return _base_model(cfg, run, progress)


def _clear_leftovers(run: RunDir) -> bool:
    """Remove what a run that stopped before its first checkpoint left; True if there was any."""
    found = False
    for path in run.leftovers:
        if path.exists():
            found = True
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return found


def _base_model(cfg: TrainConfig, run: RunDir, progress: Progress) -> Path:
    """The model a new run starts from: a GGUF import (cached; its slow steps are logged), the
    tiny model built in ``RUN/base_model``, or ``model.path``; with ``model.thinking``, its
    reasoning copy (cached)."""
    if cfg.model.path == "tiny" and cfg.model.gguf is None:
        path = run.base_model
        build_tiny_model(path, cfg.model.tiny, thinking=cfg.model.thinking)
        return path
    path = cached_import(cfg.model.gguf, log=progress.message) if cfg.model.gguf is not None else Path(cfg.model.path)
    return cached_thinking(path, log=progress.message) if cfg.model.thinking else path


def lora_tokens(cfg: TrainConfig, policy: Policy) -> list[int]:
    """Token ids whose embedding rows train beside a LoRA adapter: the markers ``model.thinking`` added."""
    return thinking_rows(policy) if cfg.model.thinking else []


def _load_policy(cfg: TrainConfig, run: RunDir, model_path: Path, found: Resumable | None) -> Policy:
    """The policy in eval mode: with LoRA on a resume, the BC policy (merged) plus the
    checkpoint's adapter; otherwise the model (with a BC adapter when BC trains through LoRA);
    the prefix cache and the vLLM sampler as configured."""
    lora = cfg.model.lora
    if lora.r > 0 and found is not None:
        policy = load_policy(run.checkpoint("bc"), cfg.model.dtype, resolve_device(cfg.model.device))
        add_lora(policy, lora, cfg.seed, "rl", adapter_dir=found.path / ADAPTER_DIR, names=cfg.agent.policies)
    else:
        policy = load_policy(model_path, cfg.model.dtype, resolve_device(cfg.model.device))
        if lora.r > 0 and cfg.bc.enabled:
            add_lora(policy, lora, cfg.seed, "bc", tokens=lora_tokens(cfg, policy))
    if cfg.model.gradient_checkpointing:
        use_gradient_checkpointing(policy.model)
    policy.model.eval()
    policy.prefix_cache, policy.kv_cache_gib = cfg.rollout.prefix_cache, cfg.rollout.kv_cache_gib
    if policy.vision is not None:
        policy.vision.cache_images = cfg.model.image_cache
    if cfg.rollout.backend == "vllm":  # the engine loads model_path; the policy's own weights are synced before use
        from turnforge.policy.vllm_sampler import VLLMSampler

        policy.sampler = VLLMSampler(model_path, seed=cfg.seed, max_model_len=cfg.rollout.max_context_tokens,
                                     dtype=cfg.model.dtype, kv_cache_gib=cfg.rollout.vllm_kv_cache_gib)
    return policy


def _make_engine(cfg: TrainConfig, policy: Policy, run: RunDir, checked: Checked,
                 stack: ExitStack) -> tuple[Engine, list[str]]:
    """The run's engine (closed with ``stack``) and warnings about actions longer than
    ``rollout.max_new_tokens``: the gateway's agent engine (it starts with the run and stops
    with it), or the rollout engine once the chat template is known to fit the env's prompt."""
    if checked.env is None:
        from turnforge.gateway.agents import AgentEngine

        return stack.enter_context(closing(AgentEngine(cfg, policy, run.root, checked.agent_tasks, checked.agent_fn))), []
    prompt = PromptSpec.of(checked.env, cfg.rollout.include_instructions, cfg.rollout.example_turns,
                           cfg.rollout.tools_in_system_prompt)
    policy.chat.start(prompt.system, prompt.tools, prompt.examples, prompt.observation_role)  # the template fits the env
    policy.chat.turn(prompt.observation_role)
    check_first_images(checked.env, policy.vision)
    engine = stack.enter_context(closing(make_engine(cfg, policy)))
    return engine, check_action_lengths(engine.env, policy.chat, cfg.rollout.max_new_tokens) if cfg.check_env else []


def _where(run: RunDir, state: TrainerState, stop: Interrupts, flywheel: bool = False) -> str:
    """Where an interrupted run stopped and what ``--resume`` continues from."""
    resume = f"resume with: turnforge train --resume {run}"
    if stop.requested is not None:
        return f"at RL iteration {state.iteration} (checkpoint saved); {resume}"
    found = find_resumable(run)
    if found is None:
        return f"before the first checkpoint (during behaviour cloning or the first evaluation); {resume} (starts it over)"
    if flywheel and state.stage == "bc" and found.state.stage == "bc":
        done = found.state.flywheel_rounds_done
        return (f"during flywheel round {state.flywheel_rounds_done + 1}; {resume} "
                + (f"(continues with round {done + 1})" if done else "(plays the flywheel again from the BC checkpoint)"))
    return f"during RL iteration {state.iteration + 1}; {resume} (continues from RL iteration {found.state.iteration})"


def freeze_bc(s: Session) -> None:
    """After BC: the weights as trained (a LoRA adapter merged into the base) saved as
    ``checkpoints/bc``; with LoRA, the flywheel and RL train a fresh adapter on top of them (one
    per policy with ``agent.policies``)."""
    policy = s.policy
    if policy.sampler is not None:  # BC changed the weights without a version bump
        policy.sampler.invalidate()
    if is_lora(policy.model):  # BC's adapter becomes part of the frozen base
        merge_lora(policy)
    save_model(s.run, policy, s.run.checkpoint("bc"))
    if s.cfg.model.lora.r > 0:
        add_lora(policy, s.cfg.model.lora, s.cfg.seed, "rl", tokens=lora_tokens(s.cfg, policy), names=s.cfg.agent.policies)
    attach_trainer(policy)  # on several ranks: a sharded copy of what the next stages train
    publish_weights(policy)  # on several ranks with inference replicas: the weights as trained, to them


def make_critic(s: Session, training: TrainingState | None) -> Critic | None:
    """The learned critic (``critic.enabled``): the BC policy's trunk plus a value head, with
    the state ``training`` resumes (when it has one), else pretrained on Monte-Carlo returns of
    the BC policy (``critic.pretrain_episodes``; recorded in ``s.state.value_pretrain``)."""
    cfg = s.cfg
    if not cfg.critic.enabled:
        return None
    model = build_value_model(s.policy.model, cfg.critic.init, cfg.seed)
    resumed = training is not None and training.critic is not None
    if resumed:
        model.load_state_dict(training.critic)
    trainer = sharded_copy(model)  # on several ranks the updates' sharded copy (turnforge.dist)
    critic = Critic(model, torch.optim.AdamW((model if trainer is None else trainer).parameters(), lr=cfg.critic.lr, weight_decay=0.0), trainer)
    if resumed:
        load_optimizer_state(critic.train_model, critic.optimizer, training.critic_optimizer)
    elif cfg.critic.pretrain_episodes > 0:
        s.state.value_pretrain = pretrain_values(s, critic)
    return critic


def rl_references(cfg: TrainConfig, run: RunDir, policy: Policy) -> tuple[Policy | None, torch.nn.Module | None]:
    """``(bc_policy, reference)`` for the RL stage: the frozen BC policy when Monte-Carlo
    rollouts play it (``critic.mc_policy=bc``) or it is the KL reference of full fine-tuning;
    the KL reference (``rl.kl_coef > 0``): under LoRA the adapter's frozen base (no copy),
    else the frozen BC model (after a reference reset, ``rl.reference_reset_every``: the last
    reset's, ``checkpoints/reference``)."""
    bc_policy = None
    mc_by_bc = cfg.critic.mc_policy == "bc" and ESTIMATORS[cfg.rl.advantage].monte_carlo(cfg)
    if mc_by_bc or (cfg.rl.kl_coef > 0 and cfg.model.lora.r == 0):
        bc_policy = load_policy(run.checkpoint("bc"), cfg.model.dtype, resolve_device(cfg.model.device))
        bc_policy.model = make_reference(bc_policy.model)
    if cfg.rl.kl_coef > 0 and is_lora(policy.model):  # the frozen base is the BC policy: no copy needed
        reference: torch.nn.Module | None = FrozenBase(policy.model)
    else:
        reference = bc_policy.model if bc_policy is not None and cfg.rl.kl_coef > 0 else None
    last_reset = run.checkpoint("reference")  # rl.reference_reset_every: a resume after a reset
    if reference is not None and cfg.rl.reference_reset_every > 0 and last_reset.exists():
        reference = make_reference(load_policy(last_reset, cfg.model.dtype, resolve_device(cfg.model.device)).model)
    return bc_policy, reference
