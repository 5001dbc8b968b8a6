"""The multi-turn rollout loop: many episodes advanced turn by turn, one batched
generation call per turn for all episodes still running.

An ``Actor`` produces the next action ids for a batch of prompts: ``PolicyActor``
samples from the LM, ``ExpertActor`` asks each env's expert (demonstrations go through
the same context code as rollouts, so BC trains on exactly the prompts RL will see).

Finished episodes leave the batch at once (no generation for finished envs). An env
that raises inside ``reset``/``restore``/``step`` ends its episode as an infrastructure
failure (``Trajectory.infra_failure``), which the trainer excludes from advantages and
metrics; the other episodes go on.

An episode may start from an env snapshot (``EpisodeRequest.start``) instead of a reset:
it plays on from that state (step counter included), but its context starts there, so
the policy does not see the turns the original episode played before it. Each turn
records the env's shaping potential before and after its step (``Turn.potential``,
``Turn.next_potential``), and with ``keep_snapshots`` the snapshot before its action.

Departure from an asynchronous engine: turns are batched in lock-step across the
episodes of one call (the async per-trajectory scheduler comes with the EnvPool).
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from turnforge.config import RolloutConfig
from turnforge.envs.base import Env, EnvSnapshot, stable_hash
from turnforge.errors import UserError
from turnforge.policy.generate import Generation, sample
from turnforge.policy.model import Policy
from turnforge.rollout.context import ContextOverflow, EpisodeContext, PromptSpec
from turnforge.types import Task, Trajectory, Turn


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode to play: which task, which env seed, which GRPO group.

    With ``start`` the env is restored to that snapshot (``env_seed`` is then only a
    label: the snapshot carries the env's RNG) and the episode plays on from there.
    ``max_turns`` overrides ``RolloutConfig.max_turns`` for this episode (e.g. the turns
    left of a budget when starting mid-episode).
    """

    task: Task
    env_seed: int
    group_id: str
    trajectory_id: str
    start: EnvSnapshot | None = None
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"EpisodeRequest.max_turns must be >= 1 or None; got {self.max_turns}")


class Actor(Protocol):
    version: int

    def act(self, prompts: Sequence[Sequence[int]], envs: Sequence[Env]) -> list[Generation | None]:
        """Next action of each prompt (``None`` logprobs for non-sampled actions)."""
        ...


class PolicyActor:
    """Samples actions from the policy LM (temperature 0 = greedy)."""

    def __init__(self, policy: Policy, max_new_tokens: int, temperature: float, generator: torch.Generator) -> None:
        self.policy, self.max_new_tokens, self.temperature, self.generator = policy, max_new_tokens, temperature, generator

    @property
    def version(self) -> int:
        return self.policy.version

    def act(self, prompts, envs):
        return sample(
            self.policy.model,
            prompts,
            max_new_tokens=self.max_new_tokens,
            stop_ids=self.policy.stop_ids,
            pad_id=self.policy.pad_id,
            temperature=self.temperature,
            generator=self.generator,
        )


class ExpertActor:
    """The env's expert policy, written as the tokens the LM should produce: the action
    text's ids followed by the first stop id. Logprobs are NaN (nothing was sampled).

    With ``noise > 0`` it is an imperfect demonstrator: at each turn, with probability
    ``noise``, it plays a uniformly random action of ``env.action_names`` instead of the
    expert's (which may be the expert's by chance). The draw is a function of ``seed``,
    the episode's task and the turn index only, so the demonstrations do not depend on
    how many envs play at once or in which order episodes finish (two episodes of the
    same task get the same draws).
    """

    version = -1

    def __init__(self, policy: Policy, noise: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1]; got {noise}")
        self.policy, self.noise, self.seed = policy, noise, int(seed)
        self.random_actions = 0  # turns where the random action replaced the expert's

    def act(self, prompts, envs):
        out = []
        for env in envs:
            text = env.expert_action()
            if self.noise > 0:
                draw = random.Random(stable_hash(self.seed, "expert-noise", env.current_task.task_id, env.steps))
                if draw.random() < self.noise:
                    if not env.action_names:
                        raise UserError(
                            f"a noisy demonstrator needs an env with a discrete action set (Env.action_names); "
                            f"{type(env).__name__} has none: set bc.expert_noise=0"
                        )
                    text = draw.choice(env.action_names)
                    self.random_actions += 1
            ids = self.policy.chat.encode(text) + (self.policy.stop_ids[0],)
            out.append(Generation(ids, tuple([float("nan")] * len(ids)), True))
        return out


@dataclass
class _Running:
    request: EpisodeRequest
    env: Env
    ctx: EpisodeContext
    observation: str
    turns: list[Turn]
    max_turns: int
    snapshots: list[EnvSnapshot] = field(default_factory=list)
    ret: float = 0.0
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    reason: str | None = None
    failure: str | None = None
    cut: int = 0
    done: bool = False


@dataclass(frozen=True)
class RolloutStats:
    """Counters of one rollout call (budget events are counted, never silent)."""

    episodes: int
    turns: int
    obs_truncations: int  # observations cut by the context budget
    context_overflows: int  # episodes ended because nothing more fit
    generation_truncations: int  # turns that hit max_new_tokens before a stop token
    history_dropped: int  # window turns dropped to fit the budget
    infra_failures: int
    generated_tokens: int


def rollout(
    actor: Actor,
    envs: Sequence[Env],
    requests: Sequence[EpisodeRequest],
    cfg: RolloutConfig,
    policy: Policy,
    *,
    keep_snapshots: bool = False,
) -> tuple[list[Trajectory], RolloutStats]:
    """Play ``requests`` (one env of ``envs`` each, same order) to the end.

    With ``keep_snapshots`` each trajectory records the env snapshot taken before each
    turn's action (``Trajectory.snapshots``, one per turn)."""
    if len(envs) < len(requests):
        raise ValueError(f"{len(requests)} episodes need as many envs, got {len(envs)}")
    tokenizer, chat = policy.tokenizer, policy.chat
    marker = chat.encode(cfg.truncation_marker)
    running: list[_Running] = []
    for req, env in zip(requests, envs):
        ctx = EpisodeContext(chat, cfg, PromptSpec.of(env, cfg.include_instructions), marker, req.trajectory_id)
        run = _Running(req, env, ctx, "", [], req.max_turns or cfg.max_turns)
        try:
            if req.start is None:
                run.observation = env.reset(seed=req.env_seed, task=req.task)
            else:
                env.restore(req.start)
                if env.done:
                    raise ValueError("the start snapshot is of a finished episode")
                run.observation = env.render()
        except Exception:
            run.failure, run.done = _describe("reset" if req.start is None else "restore", req), True
        running.append(run)

    obs_truncations = overflows = gen_truncations = gen_tokens = 0
    for turn_index in range(max((r.max_turns for r in running), default=0)):
        active = [r for r in running if not r.done]
        for r in active:
            try:
                r.cut = r.ctx.observe(r.observation)
                obs_truncations += r.cut > 0
            except ContextOverflow:
                r.done, r.truncated, r.reason = True, True, "context_budget"
                overflows += 1
        active = [r for r in active if not r.done]
        if not active:
            break
        gens = actor.act([r.ctx.prompt() for r in active], [r.env for r in active])
        texts = tokenizer.batch_decode([g.ids for g in gens], skip_special_tokens=True)
        for r, gen, text in zip(active, gens, texts):
            sampled = actor.version >= 0
            r.ctx.act(gen.ids, gen.logprobs if sampled else None, actor.version)
            gen_tokens += len(gen.ids)
            gen_truncations += not gen.stopped
            try:
                anchor = r.env.anchor_key()
                snapshot = r.env.snapshot() if keep_snapshots else None
                potential = r.env.potential()
                step = r.env.step(text)
                next_potential = 0.0 if step.terminated else r.env.potential()  # terminal states have Phi = 0
            except Exception:
                r.failure, r.done = _describe("step", r.request), True
                continue
            r.turns.append(
                Turn(
                    r.observation, text, step.reward, step.invalid_action, anchor, r.cut, not gen.stopped,
                    potential=potential, next_potential=next_potential, info=dict(step.info),
                )
            )
            if snapshot is not None:
                r.snapshots.append(snapshot)
            r.ret += step.reward
            r.observation = step.observation
            if step.terminated or step.truncated:
                r.done, r.success = True, step.success
                r.terminated, r.truncated = step.terminated, step.truncated
                r.reason = "env" if step.truncated else None
            elif turn_index == r.max_turns - 1:
                r.done, r.truncated, r.reason = True, True, "max_turns"

    trajectories = []
    for r in running:
        samples = tuple(r.ctx.finish())
        trajectories.append(
            Trajectory(
                trajectory_id=r.request.trajectory_id,
                task=r.request.task,
                group_id=r.request.group_id,
                env_seed=r.request.env_seed,
                turns=tuple(r.turns),
                samples=samples,
                episode_return=r.ret,
                success=r.success,
                terminated=r.terminated,
                truncated=r.truncated,
                truncation_reason=r.reason,
                policy_version=actor.version,
                infra_failure=r.failure,
                snapshots=tuple(r.snapshots),
            )
        )
    stats = RolloutStats(
        episodes=len(running),
        turns=sum(len(r.turns) for r in running),
        obs_truncations=obs_truncations,
        context_overflows=overflows,
        generation_truncations=gen_truncations,
        history_dropped=sum(r.ctx.history_dropped for r in running),
        infra_failures=sum(r.failure is not None for r in running),
        generated_tokens=gen_tokens,
    )
    return trajectories, stats


def _describe(where: str, req: EpisodeRequest) -> str:
    """One-line description of the exception being handled (for the infra-failure record)."""
    last = traceback.format_exc().strip().splitlines()[-1]
    return f"env {where}() raised on {req.task.task_id} (seed {req.env_seed}): {last}"
