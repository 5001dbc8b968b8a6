"""Held-out evaluation: success rate, mean return, invalid-action rate, mean turns.

Evaluation episodes are the tasks ``0..episodes-1`` of a split with env seed = task
index, so every evaluation of every run sees the same tasks. Infrastructure failures
are excluded from the rates and counted separately (``EvalResult.infra_failures``); more
than ``max_failure_share`` of them, or no episode scored at all, raises ``RunStopped``
(``turnforge.train.run_dir.failures``): an evaluation that scored nothing is never a success rate of 0.
"""

from __future__ import annotations

from typing import Callable, Sequence

from turnforge.policy.generate import PrefillCache
from turnforge.policy.model import Policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import Engine, EpisodeRequest
from turnforge.seeding import generator
from turnforge.train.run_dir.failures import check_trajectories
from turnforge.types import EvalResult, LabelSuccess, Trajectory


def evaluate(
    engine: Engine,
    policy: Policy,
    *,
    episodes: int,
    split: str = "heldout",
    temperature: float = 0.0,
    seed: int = 0,
    max_failure_share: float = 1.0,
    stage: str = "evaluation",
    prefills: PrefillCache | None = None,
    on_progress: Callable[[int], None] | None = None,
    episode_seed: int | None = None,
) -> tuple[EvalResult, list[Trajectory]]:
    """Play ``episodes`` tasks of ``split`` with the policy (greedy when temperature is 0).
    ``prefills``: prompts other evaluations of these weights prefilled are not prefilled again
    (same result, bit for bit). ``on_progress(n)``: episodes finished so far, as they finish.
    ``episode_seed``: each episode's sampling draws from its own seed (``PolicyActor``), not a
    batch generator (a run's ``rollout.noise``).

    Raises ``RunStopped`` (named ``stage``) when more than ``max_failure_share`` of the
    episodes, or all of them, were infrastructure failures. The default 1.0 only refuses an
    evaluation that scored nothing (a stand-alone evaluation reports its failures in
    ``EvalResult.infra_failures``); a training run passes its ``max_failure_share``."""
    if episodes < 1:
        raise ValueError(f"evaluate needs episodes >= 1; got {episodes}")
    env = engine.env
    actor = PolicyActor(policy, engine.cfg.max_new_tokens, temperature, generator(seed, "eval", split, episodes), prefills=prefills,
                        episode_seed=episode_seed)
    requests = [EpisodeRequest(env.task(split, i), i, f"eval-{i}", f"eval-{split}-{i}") for i in range(episodes)]
    trajectories, _ = engine.play(requests, actor, on_progress=on_progress)
    check_trajectories(stage, env.env_id, trajectories, max_failure_share, kind=f"{split} evaluation episodes")
    memory = getattr(engine, "memory", None) is not None
    label = getattr(env, "task_label", None)
    labels = [label(t.task) for t in trajectories] if callable(label) else None
    return summarize(env.env_id, split, trajectories, has_tools=bool(env.tools), memory=memory, labels=labels), trajectories


def prefill_cache(policy: Policy, budget_mb: int) -> PrefillCache | None:
    """A ``PrefillCache`` of ``budget_mb`` for evaluations of the policy's current weights, or None
    where it does not apply: a budget of 0, the prefix cache (``rollout.prefix_cache``), another
    sampler (vLLM)."""
    if budget_mb <= 0 or policy.prefix_cache or policy.sampler is not None:
        return None
    return PrefillCache(budget_mb << 20, policy.version)


def summarize(env_id: str, split: str, trajectories: Sequence[Trajectory], has_tools: bool = False,
              memory: bool = False, labels: Sequence[str] | None = None) -> EvalResult:
    """Aggregate episodes into an ``EvalResult`` (infra failures excluded and counted);
    ``has_tools``: the env offers tools, so the share of episodes that called one (an
    ``n_tool_calls`` event in any turn) is counted too; ``memory``: episodic memory was on, so
    the share of episodes shown a past success is counted; ``labels`` (one per trajectory, the env's
    ``task_label``): success per label too. Raises ``ValueError`` when no episode is left to score."""
    ok = [t for t in trajectories if t.infra_failure is None]
    n = len(ok)
    if n == 0:
        raise ValueError(f"no {split} episode of env {env_id!r} to score ({len(trajectories)} infrastructure failures)")
    actions = sum(t.num_turns for t in ok)
    return EvalResult(
        env_id=env_id,
        split=split,
        episodes=n,
        success_rate=sum(t.success for t in ok) / n,
        mean_return=sum(t.episode_return for t in ok) / n,
        invalid_action_rate=sum(t.num_invalid for t in ok) / actions if actions else 0.0,
        mean_turns=actions / n,
        infra_failures=len(trajectories) - n,
        tool_call_rate=sum(any(turn.info.get("n_tool_calls", 0) for turn in t.turns) for t in ok) / n if has_tools else None,
        memory_recall_rate=sum(t.memory_tokens > 0 for t in ok) / n if memory else None,
        by_label=by_label(trajectories, labels) if labels is not None else (),
    )


def by_label(trajectories: Sequence[Trajectory], labels: Sequence[str]) -> tuple[LabelSuccess, ...]:
    """Success per label of the scored trajectories (``labels[i]`` is trajectory ``i``'s), sorted by label."""
    counts: dict[str, list[int]] = {}
    for t, label in zip(trajectories, labels, strict=True):
        if t.infra_failure is None:
            c = counts.setdefault(label, [0, 0])
            c[0] += 1
            c[1] += t.success
    return tuple(LabelSuccess(k, n, s) for k, (n, s) in sorted(counts.items()))


def load_for_eval(cfg, checkpoint) -> Policy:
    """The checkpoint's policy set up as a run with ``cfg`` samples (threads, dtype, the prefix
    cache and its budget): what ``turnforge eval`` and ``turnforge merge --sweep`` evaluate."""
    import torch

    from turnforge.policy.lora import several_policies
    from turnforge.policy.model import load_policy, resolve_device

    several_policies(checkpoint, str(checkpoint), "serve it (turnforge serve {path}) and evaluate each by its name")
    torch.set_num_threads(cfg.threads)
    policy = load_policy(checkpoint, cfg.model.dtype, resolve_device(cfg.model.device))
    policy.prefix_cache, policy.kv_cache_gib = cfg.rollout.prefix_cache, cfg.rollout.kv_cache_gib
    return policy
