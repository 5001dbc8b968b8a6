"""Every cross-key rule of a run's options, in one place, at the two moments they can be checked.

- ``config_conflict(cfg)``: when the config is loaded (``turnforge.app.config``), before anything
  is built: the rules of ``CONFIG_RULES``, one function per section, in order; the first that
  fails names both keys and the fix. The advantage estimator's own rules
  (``Estimator.conflict``, ``turnforge.algos.estimators``), each flywheel mechanism's
  (``Mechanism.conflict``, ``turnforge.train.mechanisms``) and each context policy's
  (``ContextPolicy.conflict``, ``turnforge.rollout.context``) run among them.
- ``check_run(cfg, env)``: at the start of a run, with its env built and before any model work:
  the checks of ``START_CHECKS``, the options against the env's capabilities
  (``turnforge.train.checks``: the estimator's and mechanisms' ``requirements`` plug in there)
  and against the model (``turnforge.policy.vision``).

A rule returns one line or None; a start check raises ``UserError``.
"""

from __future__ import annotations

from typing import Callable

from turnforge.algos.estimators import ESTIMATORS, names_where
from turnforge.config import TrainConfig
from turnforge.envs.base import Env
from turnforge.errors import UserError, spoken_list
from turnforge.policy.model import load_chat_format
from turnforge.policy.vision import check_vision_options
from turnforge.rollout.context import CONTEXTS
from turnforge.train.checks import check_options
from turnforge.train.mechanisms import enabled


def _model_and_budgets(cfg: TrainConfig) -> str | None:
    if cfg.model.gguf is not None and cfg.model.path not in (None, "tiny"):
        return f"set one of model.path ({cfg.model.path!r}) and model.gguf ({cfg.model.gguf!r}), not both"
    if cfg.model.path is None and cfg.model.gguf is None:
        return f"recipe {cfg.recipe!r} needs model.path=/local/hf/model/dir (a directory saved with save_pretrained)"
    if cfg.rollout.max_new_tokens >= cfg.rollout.max_context_tokens:
        return (f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) must be below "
                f"rollout.max_context_tokens ({cfg.rollout.max_context_tokens})")
    return None


def _estimator_and_critic(cfg: TrainConfig) -> str | None:
    rl, critic = cfg.rl, cfg.critic
    estimator = ESTIMATORS[rl.advantage]
    if estimator.single_states and not CONTEXTS[cfg.rollout.context].one_sample_per_turn:
        return (f"rl.advantage={rl.advantage} samples actions at single states and needs rollout.context=window "
                f"(got {cfg.rollout.context})")
    conflict = estimator.conflict(cfg)
    if conflict:
        return conflict
    readers = " or ".join(f"rl.advantage={n}" for n in names_where("reads_values"))
    if not estimator.reads_values and critic.enabled:
        return f"critic.enabled=true is only used by {readers} (got rl.advantage={rl.advantage})"
    if not estimator.reads_values and critic.mc_weight > 0:
        return f"critic.mc_weight={critic.mc_weight} is only used by {readers} (mc_grpo always uses Monte-Carlo values)"
    if not critic.enabled and 0 < critic.mc_weight < 1:
        return f"critic.mc_weight={critic.mc_weight} blends with a learned critic but critic.enabled=false; set one of them"
    return None


def _flywheel(cfg: TrainConfig) -> str | None:
    fw = cfg.flywheel
    if fw.pass_at_k and cfg.eval.pass_at_k_samples == 0:
        return "flywheel.pass_at_k=true measures pass@k after each round with eval.pass_at_k_samples samples per task; set it above 0"
    if fw.weighting != "success" and fw.rounds > 0:
        w = f"flywheel.weighting={fw.weighting}"
        if fw.mechanisms:
            return f"{w} trains on the round's own episodes; flywheel.mechanisms={fw.mechanisms} add or replay others: set flywheel.mechanisms=[]"
        if "rft" not in fw.stages:
            return f"{w} weighs the samples of the rft stage: add rft to flywheel.stages"
        if not CONTEXTS[cfg.rollout.context].one_sample_per_turn:
            return f"{w} weighs each turn's sample and needs rollout.context=window (got {cfg.rollout.context})"
        if fw.weighting == "group_awr" and fw.group_size < 2:
            return "flywheel.weighting=group_awr compares the turns of a task's group taken in one state: set flywheel.group_size >= 2"
    if fw.rounds > 0 and fw.pass_k > 1:
        if fw.pass_k > fw.group_size:
            return (f"flywheel.pass_k={fw.pass_k} weighs a success by the task's other rollouts, but flywheel.group_size="
                    f"{fw.group_size} plays fewer: set flywheel.pass_k <= {fw.group_size}")
        if fw.weighting != "success" or "rft" not in fw.stages:
            return (f"flywheel.pass_k={fw.pass_k} weighs the kept successes of the rft stage: set flywheel.weighting=success "
                    "with rft in flywheel.stages, or flywheel.pass_k=1")
    if fw.rounds > 0 and fw.allocation != "uniform" and fw.probe_rollouts > fw.group_size:
        return (f"flywheel.probe_rollouts={fw.probe_rollouts} is above flywheel.group_size={fw.group_size}, the rollouts of a "
                f"task; set flywheel.probe_rollouts <= {fw.group_size}")
    if fw.rounds > 0 and fw.allocation == "boundary":
        if fw.group_size == fw.probe_rollouts:
            return (f"flywheel.allocation=boundary deals (group_size - probe_rollouts) rollouts per task by closeness to "
                    f"the boundary; with flywheel.group_size=flywheel.probe_rollouts={fw.group_size} there are none: raise "
                    "flywheel.group_size or lower flywheel.probe_rollouts")
        if fw.boundary_max_rollouts < fw.group_size:
            return (f"flywheel.boundary_max_rollouts={fw.boundary_max_rollouts} is below flywheel.group_size={fw.group_size}: "
                    f"a wave's budget could not be dealt; set it to at least {fw.group_size}")
    if fw.rounds > 0:
        # a round's budget must give each level it plays first one episode (rollout.max_turns steps
        # at most): a fresh task, each task of a boundary wave, each kept level's re-test
        turns, budget = cfg.rollout.max_turns, fw.env_steps_per_round
        first = [(f"one episode of rollout.max_turns={turns}", turns)]
        if fw.allocation == "boundary":
            first.append((f"one episode on each task of a boundary wave (flywheel.tasks_per_wave={fw.tasks_per_wave} "
                          f"x rollout.max_turns={turns})", fw.tasks_per_wave * turns))
        if "keep" in fw.mechanisms:
            first.append((f"one episode on each kept level re-tested (flywheel.keep_tasks={fw.keep_tasks} x "
                          f"rollout.max_turns={turns})", fw.keep_tasks * turns))
        for what, steps in first:
            if budget < steps:
                return (f"flywheel.env_steps_per_round={budget} is smaller than {what}, {steps} env steps: raise it to "
                        f"at least {steps} or play fewer levels a round")
        for mechanism in enabled(fw.mechanisms):
            conflict = mechanism.conflict(cfg)
            if conflict:
                return conflict
    return None


def _reference_resets(cfg: TrainConfig) -> str | None:
    rl = cfg.rl
    if rl.reference_reset_every == 0:
        return None
    if rl.kl_coef == 0:
        return (f"rl.reference_reset_every={rl.reference_reset_every} resets the KL reference, but rl.kl_coef=0 uses none; "
                "set rl.kl_coef > 0 (ProRL: 1e-4 to 1e-3) or rl.reference_reset_every=0")
    if cfg.model.lora.r > 0:
        return ("rl.reference_reset_every > 0 copies the policy as the new reference; under LoRA the reference is the "
                "adapter's frozen base: set model.lora.r=0 or rl.reference_reset_every=0")
    return None


def _critic_pretraining(cfg: TrainConfig) -> str | None:
    if cfg.critic.pretrain_episodes > 0 and not cfg.critic.enabled:
        return "critic.pretrain_episodes > 0 pretrains the learned critic, but critic.enabled=false"
    return None


def _rollout(cfg: TrainConfig) -> str | None:
    r = cfg.rollout
    context = CONTEXTS[r.context]
    conflict = context.conflict(cfg)
    if conflict:
        return conflict
    renders = " or ".join(n for n, c in CONTEXTS.items() if c.renders_history)
    if r.history == "as_rendered" and not context.renders_history:
        return (f"rollout.history=as_rendered writes each turn's prompt as the template renders it; it needs "
                f"rollout.context={renders} (got {r.context}); or set rollout.history=as_sampled")
    if r.thinking_budget is not None and not context.renders_history:
        return (f"rollout.thinking_budget={r.thinking_budget} closes thinking inside a turn's action; it needs "
                f"rollout.context={renders} (got {r.context}); or set rollout.thinking_budget=null")
    if not context.values_per_turn and cfg.critic.enabled:
        return (f"critic.enabled=true reads values per turn of whole episodes or single turns, not of {r.context} "
                f"{context.sample}s; use critic.mc_weight=1 (Monte-Carlo values) or another rollout.context")
    return None


def _lora(cfg: TrainConfig) -> str | None:
    if cfg.model.lora.r > 0 and cfg.cluster == "ray":
        return "model.lora.r > 0 with cluster=ray: Ray rollout workers sync full weights, not adapters; use cluster=local"
    if cfg.model.lora.r > 0 and cfg.critic.enabled:
        return "model.lora.r > 0 with critic.enabled=true: the learned critic copies the full policy trunk; use critic.mc_weight=1 or no critic"
    return None


def _agent(cfg: TrainConfig) -> str | None:
    a, eng = cfg.agent, cfg.engine
    if a.entrypoint is None and a.tasks is None:
        return "agent.policies names the policies of an agent run; set agent.entrypoint and agent.tasks" if a.policies else None
    if a.entrypoint is None or a.tasks is None:
        missing = "agent.entrypoint=module:callable" if a.entrypoint is None else "agent.tasks=PATH.jsonl"
        return f"an agent run needs both agent.entrypoint and agent.tasks; set {missing}"
    if cfg.bc.enabled or cfg.flywheel.rounds > 0:
        what = "bc.enabled=true" if cfg.bc.enabled else f"flywheel.rounds={cfg.flywheel.rounds}"
        return f"{what} needs an env's expert; an agent run starts from the model as it is (set bc.enabled=false flywheel.rounds=0)"
    if not ESTIMATORS[cfg.rl.advantage].returns_baseline:
        return (f"rl.advantage={cfg.rl.advantage} needs env states; an agent run takes "
                f"{spoken_list(names_where('returns_baseline'))}")
    if eng.mode != "sync" or cfg.cluster != "local" or eng.env_workers > 0:
        return "an agent run uses engine.mode=sync, cluster=local and engine.env_workers=0 (the gateway runs in the trainer's process)"
    return _policies(cfg)


def _policies(cfg: TrainConfig) -> str | None:
    """Several policies (``agent.policies``): adapters on one base, sampled by the built-in sampler
    of the trainer's process, each with its own state."""
    names = cfg.agent.policies
    if not names:
        return None
    off = [("model.lora.r=0 (each policy is a LoRA adapter: set model.lora.r > 0)", cfg.model.lora.r == 0),
           (f"rollout.backend={cfg.rollout.backend} (the built-in sampler switches adapters: use rollout.backend=hf)",
            cfg.rollout.backend != "hf"),
           ("model.thinking=true (its token rows would be shared by the adapters)", cfg.model.thinking),
           (f"rl.reference_reset_every={cfg.rl.reference_reset_every} (the reference is the adapters' shared base)",
            cfg.rl.reference_reset_every > 0),
           (f"rl.rehearsal_coef={cfg.rl.rehearsal_coef} (rehearsal replays one policy's episodes)", cfg.rl.rehearsal_coef > 0),
           ("agent.reward=judge (a judge gives one reward, not one per policy)", cfg.agent.reward == "judge")]
    for what, on in off:
        if on:
            return f"agent.policies={names} with {what}"
    return None


def _judge(cfg: TrainConfig) -> str | None:
    if cfg.reward.judge.enabled and cfg.agent.entrypoint is not None:
        return "reward.judge.enabled=true is for env runs; an agent run sets agent.reward=judge (with the reward.judge.* keys)"
    judged = cfg.reward.judge.enabled or (cfg.agent.entrypoint is not None and cfg.agent.reward == "judge")
    if judged and cfg.flywheel.rounds > 0:
        return "a judge reward scores the RL stage; the flywheel selects by the env's success (set flywheel.rounds=0)"
    return None


def _vllm(cfg: TrainConfig) -> str | None:
    if cfg.rollout.backend != "vllm":
        return None
    if cfg.cluster == "ray":
        return "rollout.backend=vllm runs vLLM in the trainer's process; use cluster=local"
    if cfg.engine.mode == "async":
        return "rollout.backend=vllm with engine.mode=async: the one vLLM engine is not shared across threads; use engine.mode=sync"
    if cfg.rollout.prefix_cache:
        return "rollout.prefix_cache=true is the built-in sampler's; vLLM keeps its own prefix cache (set rollout.prefix_cache=false)"
    return None


def _on_gpu(device: str) -> bool:
    """Whether ``model.device`` puts the model on a GPU ('auto': when this machine has one)."""
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def _server(cfg: TrainConfig) -> str | None:
    """Inference replicas (``turnforge.inference``): what they cannot do yet is refused by name."""
    srv = cfg.rollout.server
    if cfg.rollout.backend != "server":
        return None
    if srv.replicas == 0 and not srv.urls:
        return "rollout.backend=server with rollout.server.replicas=0 and no rollout.server.urls: no replica to sample on"
    bad = [u for u in srv.urls if not u.startswith(("http://", "https://"))]
    if bad:
        return f"rollout.server.urls: {bad[0]!r} is not an http://host:port address"
    if srv.transport == "nccl" and not _on_gpu(cfg.model.device):
        return (f"rollout.server.transport=nccl broadcasts between GPUs and needs model.device=cuda (got "
                f"model.device={cfg.model.device}); use rollout.server.transport=gloo (or file) on a CPU")
    if cfg.rollout.noise == "batch":
        return ("rollout.backend=server with rollout.noise=batch: one generator in the trainer cannot draw for several "
                "replicas; use rollout.noise=episode (or auto)")
    if cfg.cluster == "ray":
        return "rollout.backend=server samples from this process's replicas; use cluster=local"
    if cfg.agent.entrypoint is not None:
        return "rollout.backend=server is for env rollouts; an agent run samples through its gateway (rollout.backend=hf)"
    return None


def _engine(cfg: TrainConfig) -> str | None:
    eng = cfg.engine
    if eng.mode == "sync" and (eng.eta > 0 or eng.partial_rollouts):
        what = f"engine.eta={eng.eta}" if eng.eta > 0 else "engine.partial_rollouts=true"
        return f"{what} needs engine.mode=async (the sync loop is always on-policy)"
    if eng.partial_rollouts and eng.eta < 1:
        return "engine.partial_rollouts=true needs engine.eta >= 1: a carried-over trajectory is at least one version old"
    if eng.env_slots is not None and eng.env_slots < cfg.rl.group_size:
        return f"engine.env_slots={eng.env_slots} cannot hold one group of rl.group_size={cfg.rl.group_size}"
    return None


def _memory(cfg: TrainConfig) -> str | None:
    if cfg.memory.enabled:
        if cfg.engine.mode == "async" or cfg.cluster == "ray":
            what = "engine.mode=async" if cfg.engine.mode == "async" else "cluster=ray"
            return (f"memory.enabled=true with {what}: episodes would start while the memory grows, in no fixed order; "
                    "use engine.mode=sync and cluster=local")
        if cfg.agent.entrypoint is not None:
            return "memory.enabled=true is for env runs: an agent run's prompts are its own (set memory.enabled=false)"
    elif cfg.memory.store is not None:
        return f"memory.store={cfg.memory.store} is read by episodic memory; set memory.enabled=true"
    return None


def _ray(cfg: TrainConfig) -> str | None:
    ray_replicas = cfg.rollout.backend == "server" and cfg.rollout.server.launch == "ray"
    if cfg.engine.ray_address is not None and cfg.cluster != "ray" and not ray_replicas:
        return (f"engine.ray_address={cfg.engine.ray_address} is only used with cluster=ray or rollout.server.launch=ray "
                f"(got cluster={cfg.cluster})")
    if cfg.rollout.server.ray_resources and not ray_replicas:
        return "rollout.server.ray_resources places replica actors; set rollout.backend=server rollout.server.launch=ray"
    return None


def _dist(cfg: TrainConfig) -> str | None:
    """What runs on several trainer ranks so far (``turnforge.dist``; with ``cluster=ray`` the ranks
    are Ray actors, ``turnforge.app.ray_ranks``): BC, the flywheel, synchronous RL with or without the
    learned critic (and its value pretraining), Monte-Carlo values and rehearsal, sampling in the
    ranks' processes or on shared inference replicas (``rollout.backend=server``); the other
    stages are refused by name."""
    n = cfg.dist.nproc
    if cfg.rollout.noise == "episode" and cfg.rollout.backend == "vllm":
        return "rollout.noise=episode is the built-in sampler's; vLLM draws its own noise (use rollout.noise=auto)"
    if cfg.rollout.noise == "episode" and ((cfg.cluster == "ray" and n == 1) or cfg.agent.entrypoint is not None):
        what = "cluster=ray (its rollout worker)" if cfg.agent.entrypoint is None else "agent.entrypoint"
        return f"rollout.noise=episode is for env rollouts in the trainer's processes, not with {what} (use rollout.noise=auto)"
    if n > 1 and cfg.rollout.noise == "batch":
        return (f"dist.nproc={n} with rollout.noise=batch: an episode's tokens would depend on which rank plays it; "
                "use rollout.noise=episode (or auto)")
    if cfg.dist.ray_resources and cfg.cluster != "ray":
        return f"dist.ray_resources places trainer ranks on a Ray cluster; set cluster=ray (got cluster={cfg.cluster})"
    if cfg.engine.ray_env_resources and cfg.cluster != "ray":
        return f"engine.ray_env_resources places env workers on a Ray cluster; set cluster=ray (got cluster={cfg.cluster})"
    if n == 1:
        if cfg.dist.backend == "nccl":
            return "dist.backend=nccl is for several ranks on GPUs; with dist.nproc=1 there is no process group"
        return None
    if cfg.dist.backend == "nccl" and not cfg.model.device.startswith("cuda"):
        return f"dist.backend=nccl needs model.device=cuda (got model.device={cfg.model.device}); use dist.backend=gloo on a CPU"
    if cfg.rl.iterations > 0 and cfg.rl.tasks_per_iteration % n:
        return (f"dist.nproc={n} does not divide rl.tasks_per_iteration={cfg.rl.tasks_per_iteration}: each rank plays "
                f"whole groups; use a multiple of {n}")
    unsupported = [
        ("engine.mode=async", cfg.engine.mode == "async"),
        ("rollout.backend=vllm", cfg.rollout.backend == "vllm"),
        ("agent.entrypoint", cfg.agent.entrypoint is not None), ("reward.judge.enabled=true", cfg.reward.judge.enabled),
        ("model.thinking=true under LoRA (its token rows train beside the adapter)", cfg.model.thinking and cfg.model.lora.r > 0),
    ]
    for key, on in unsupported:
        if on:
            return (f"dist.nproc={n} with {key}: that stage does not run on several trainer ranks yet "
                    "(BC, the flywheel, synchronous RL, the critic, Monte-Carlo values, rehearsal and inference replicas do); "
                    "use dist.nproc=1 or turn it off")
    return None


#: The config-time rules, in the order they are asked.
CONFIG_RULES: tuple[Callable[[TrainConfig], str | None], ...] = (
    _model_and_budgets, _estimator_and_critic, _flywheel, _reference_resets, _critic_pretraining, _rollout, _lora, _agent, _judge, _vllm,
    _server, _engine, _memory, _ray, _dist,
)


def config_conflict(cfg: TrainConfig) -> str | None:
    """The first of ``CONFIG_RULES`` that ``cfg`` breaks, as one line, or None."""
    for rule in CONFIG_RULES:
        conflict = rule(cfg)
        if conflict:
            return conflict
    return None


def _env_capabilities(cfg: TrainConfig, env: Env) -> None:
    check_options(cfg, env)


def _vision(cfg: TrainConfig, env: Env) -> None:
    variants = {**{f"rollout.context={n}": cfg.rollout.context == n for n, c in CONTEXTS.items() if not c.takes_images},
                **{f"rl.advantage={n}": cfg.rl.advantage == n for n, e in ESTIMATORS.items() if not e.with_images}}
    check_vision_options(cfg, env, variants)


def _chat_template(cfg: TrainConfig, env: Env) -> None:
    """A local model's chat template is one turnforge can write token-exactly (its tokenizer only: a
    template that rewrites earlier turns other than by dropping their thinking is refused here);
    ``model.thinking`` is for a model without thinking markers; a thinking budget needs a template
    with thinking markers (the tiny model's ChatML has them with model.thinking only). A GGUF
    model's template is checked once it is converted (the rollout engine)."""
    if cfg.model.gguf is not None:  # converted later: the rollout engine checks its template then
        return
    path, budget = cfg.model.path, cfg.rollout.thinking_budget
    chat = load_chat_format(path) if path not in (None, "tiny") else None
    if cfg.model.thinking and chat is not None and chat.thinking is not None:
        raise UserError(f"model.thinking=true but the chat template of {path!r} already has thinking markers "
                        f"({chat.thinking.open}...{chat.thinking.close}); set model.thinking=false")
    if budget is None or cfg.model.thinking:
        return
    if chat is None or chat.thinking is None:
        what = "the tiny model's ChatML template" if chat is None else f"the chat template of {path!r}"
        raise UserError(f"rollout.thinking_budget={budget} but {what} has no thinking markers (<think>...</think>); "
                        f"set rollout.thinking_budget=null, or model.thinking=true to add them")


#: The start-time checks (the run's env built, no model work yet), in the order they run.
START_CHECKS: tuple[Callable[[TrainConfig, Env], None], ...] = (_env_capabilities, _vision, _chat_template)


def check_run(cfg: TrainConfig, env: Env) -> None:
    """Every start-time check of ``START_CHECKS``; the first failure is one ``UserError`` line."""
    for check in START_CHECKS:
        check(cfg, env)
