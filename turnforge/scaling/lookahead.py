"""Lookahead at evaluation (``turnforge eval CKPT --lookahead K --lookahead-rollouts M``).

At every turn the policy samples K candidate actions; each distinct one is scored by its
Monte-Carlo Q-value from the env's snapshot of the current state (``turnforge.critic.mc``:
M rollouts that play the candidate, then the policy for at most ``horizon - 1`` more turns, on
a second engine with env slots of its own; the candidates of one state share their rollouts'
env draws, and every waiting episode's candidates are scored in one batched call), and the
episode plays the best (ties: the first sampled). The played action is the candidate's own generation, so its tokens and sampling
logprobs are recorded as sampled. ProAct's MC critic uses a random rollout policy; here the
rollouts are the policy's own at the evaluation temperature (or greedy at temperature 0): the
Q-value is that of the policy acting after the candidate, which is what the pick is for.

The episodes are the evaluation's own (tasks 0..episodes-1 of the split, env seed = task
index), so the result compares with ``turnforge eval`` at the same settings; the cost
(Monte-Carlo env steps and wall seconds) is reported beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from turnforge.critic.mc import MCStart, estimate
from turnforge.envpool.host import Probe
from turnforge.policy.generate import Generation
from turnforge.policy.model import Policy
from turnforge.rollout.actors import ActorInput, PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine
from turnforge.seeding import generator, stable_hash
from turnforge.train.evaluate import summarize
from turnforge.types import EvalResult, Task


@dataclass(frozen=True)
class LookaheadStats:
    """What lookahead cost and did, over an evaluation."""

    candidates: int  # K per turn
    rollouts: int  # M per distinct candidate
    horizon: int  # turns per rollout, the candidate's included
    turns: int  # turns played (decisions made)
    distinct_candidates: float  # mean distinct candidate actions per turn
    changed: float  # share of turns whose pick is not the first sampled candidate
    mc_env_steps: int  # env steps of the Monte-Carlo rollouts
    mc_failed: int  # rollouts lost to infrastructure failures (left out of the means)
    seconds: float  # wall seconds of the whole evaluation


class LookaheadActor:
    """Picks, at each turn, the candidate action with the highest Monte-Carlo Q-value."""

    needs_tokens = True

    def __init__(self, policy: Policy, mc_engine: RolloutEngine, *, max_new_tokens: int, temperature: float, k: int,
                 rollouts: int, horizon: int, max_turns: int, gamma: float, seed: int) -> None:
        self.policy, self.mc_engine = policy, mc_engine
        self.k, self.rollouts, self.horizon, self.max_turns, self.gamma, self.seed = k, rollouts, horizon, max_turns, gamma, seed
        self.candidates = PolicyActor(policy, max_new_tokens, temperature, generator(seed, "lookahead", "candidates"))
        self.rollout_actor = PolicyActor(policy, max_new_tokens, temperature, generator(seed, "lookahead", "rollouts"))
        self.turns = self.distinct = self.changed = self.mc_env_steps = self.mc_failed = 0
        self.estimate = estimate  # turnforge.critic.mc.estimate (a test may replace it)

    @property
    def version(self) -> int:
        return self.policy.version

    def probe(self, task: Task, trajectory_id: str, turn: int) -> Probe:
        return Probe(snapshot=True)  # the engine plays with keep_snapshots=True (see ``evaluate_lookahead``)

    def act(self, inputs: Sequence[ActorInput]) -> list[Generation | str]:
        """K candidates per input in one batched call, then every distinct candidate of every
        input scored in one Monte-Carlo call (one ``engine.play``), then the picks."""
        prompts = [x.prompt for x in inputs for _ in range(self.k)]
        keys = [f"{x.trajectory_id}/c{j}" for x in inputs for j in range(self.k)]
        gens = self.candidates.generate(prompts, keys)  # type: ignore[arg-type]
        texts = self.policy.tokenizer.batch_decode([g.ids for g in gens], skip_special_tokens=True)
        starts, owners = [], []
        for i, x in enumerate(inputs):
            assert x.after.snapshot is not None, "lookahead needs the engine to keep snapshots"
            budget = max(1, min(self.horizon, self.max_turns - x.turn))
            for text in dict.fromkeys(texts[i * self.k:(i + 1) * self.k]):
                # candidates of one state share their rollouts' env draws (common random numbers)
                starts.append(MCStart(x.task, x.after.snapshot, budget, (text,), noise_key=(x.trajectory_id, x.turn)))
                owners.append(i)
        est = self.estimate(self.mc_engine, starts, self.rollout_actor, rollouts=self.rollouts, gamma=self.gamma,
                            seed=stable_hash(self.seed, "lookahead"), prefix="lookahead")
        self.mc_env_steps += est.env_steps
        self.mc_failed += est.failed
        q = np.where(np.isnan(est.values), -np.inf, est.values)
        picks: list[Generation | str] = []
        for i in range(len(inputs)):
            mine = [j for j, o in enumerate(owners) if o == i]
            best = starts[mine[int(np.argmax(q[mine]))]].first_actions[0]  # the first of the best, in sampled order
            first = texts[i * self.k]
            self.turns += 1
            self.distinct += len(mine)
            self.changed += best != first
            picks.append(gens[i * self.k + texts[i * self.k:(i + 1) * self.k].index(best)])
        return picks


def evaluate_lookahead(engine: RolloutEngine, mc_engine: RolloutEngine, policy: Policy, *, k: int, rollouts: int, horizon: int,
                       episodes: int, split: str, temperature: float, seed: int, gamma: float = 1.0,
                       on_progress: Callable[[int], None] | None = None) -> tuple[EvalResult, LookaheadStats]:
    """The evaluation's episodes played with a ``LookaheadActor``; ``engine`` plays them (with
    snapshots), ``mc_engine`` (the same env, other slots) plays the Monte-Carlo rollouts;
    ``on_progress(n)``: episodes finished so far."""
    t0 = time.perf_counter()
    engine.caps.require("snapshot", engine.env.env_id, "--lookahead (Monte-Carlo Q-values from env snapshots)")
    actor = LookaheadActor(policy, mc_engine, max_new_tokens=engine.cfg.max_new_tokens, temperature=temperature, k=k,
                           rollouts=rollouts, horizon=horizon, max_turns=engine.cfg.max_turns, gamma=gamma, seed=seed)
    env = engine.env
    requests = [EpisodeRequest(env.task(split, i), i, f"eval-{i}", f"lookahead-{split}-{i}") for i in range(episodes)]
    trajectories, _ = engine.play(requests, actor, keep_snapshots=True, on_progress=on_progress)
    result = summarize(env.env_id, split, trajectories, has_tools=bool(env.tools))
    stats = LookaheadStats(k, rollouts, horizon, actor.turns, actor.distinct / max(1, actor.turns),
                           actor.changed / max(1, actor.turns), actor.mc_env_steps, actor.mc_failed,
                           round(time.perf_counter() - t0, 2))
    return result, stats
