"""Who acts in an episode: the policy LM, the env's expert, a random policy.

An ``Actor`` gets one ``ActorInput`` per episode that awaits an action and returns, for each,
either a ``Generation`` (token ids it sampled, with their logprobs: a language model) or an
action text (the engine writes it as the tokens the LM should produce, for behaviour
cloning). Actors that need something read off the env before they act (the expert's move,
an env-side random action) say so with ``probe``; the env host reads it after the previous
request, wherever the env runs (this process, a worker process, a Ray actor).

Actors hold no per-episode state that changes what they do (a ``PolicyActor`` may keep KV
caches, which only save compute): every draw is a function of the actor's seed, the episode
and the turn (or, for the LM, of a shared generator unless ``PolicyActor.episode_seed`` is set),
so what they do does not depend on how many episodes play at once or in which order they
finish. (With ``episode_seed``, ``PolicyActor.generate`` calls without turns, the gateway's,
count the calls per key.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from turnforge.envpool.host import NO_PROBE, AfterState, Probe
from turnforge.policy.generate import Generation, PrefillCache, PrefixCache, sample
from turnforge.policy.lora import active_adapter, adapter_names
from turnforge.policy.model import Policy
from turnforge.seeding import stable_hash
from turnforge.types import Task


@dataclass(frozen=True)
class ActorInput:
    """What an actor sees of one episode that awaits an action."""

    prompt: tuple[int, ...] | None  # the context ids; None when the engine records no tokens
    task: Task
    trajectory_id: str
    turn: int  # turns this episode played before this one
    after: AfterState  # what the env host read off the env in this state (see ``probe``)
    #: True: the episode's context asks for a summary (``rollout.context=summarize``), not an
    #: action; the answer goes into the context only, never to the env.
    summary: bool = False
    max_new_tokens: int | None = None  # the generation budget of this answer (None: the actor's own)
    images: tuple[bytes, ...] = ()  # the images whose blocks ``prompt`` holds, in order (vision policies)
    part: str = ""  # "answer": the answer after a thinking cut at its budget (``turnforge.rollout.budget``), own row seed


class Actor(Protocol):
    """Produces the next action of each episode (see the module docstring)."""

    #: Policy version of the tokens it samples; -1 when it samples none (expert, random).
    version: int
    #: True when it acts on token ids (the engine then keeps the episode's token context).
    needs_tokens: bool

    def probe(self, task: Task, trajectory_id: str, turn: int) -> Probe:
        """What the env host must read off the env before this actor's action at ``turn``."""
        ...

    def act(self, inputs: Sequence[ActorInput]) -> list[Generation | str]:
        """One action per input: sampled ids (``Generation``) or an action text."""
        ...


class PolicyActor:
    """Samples actions from the policy LM (temperature 0 = greedy), with the built-in sampler
    or the policy's other backend (``Policy.sampler``, e.g. vLLM).

    ``episode_seed`` (opt-in; built-in sampler only): each input draws from its own generator,
    seeded ``stable_hash(episode_seed, trajectory_id, turn)`` (a summary request adds
    ``"summary"``), instead of the batch sharing ``generator`` (then unused). An episode's
    tokens then depend on the seed, its trajectory id, the turn and the weights only, not on
    which episodes are sampled with it (up to float rounding of the batched forward pass)."""

    needs_tokens = True

    def __init__(self, policy: Policy, max_new_tokens: int, temperature: float, generator: torch.Generator | None, *,
                 prefills: PrefillCache | None = None, episode_seed: int | None = None) -> None:
        self.policy, self.max_new_tokens, self.temperature, self.generator = policy, max_new_tokens, temperature, generator
        budget = None if policy.kv_cache_gib is None else int(policy.kv_cache_gib * 2**30)
        self.caches: dict[str, PrefixCache] | None = {} if policy.prefix_cache else None  # per adapter (agent.policies)
        self.budget = budget
        self.prefills = prefills  # prefills shared with other actors of the same weights (built-in plain sampler only)
        self.episode_seed = episode_seed
        self.calls: dict[str, int] = {}  # generate() calls per key without turns (episode_seed only)

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache of the active adapter (``rollout.prefix_cache``; one per adapter), or None."""
        if self.caches is None:
            return None
        return self.caches.setdefault(active_adapter(self.policy.model), PrefixCache(self.budget))

    @property
    def version(self) -> int:
        return self.policy.version

    def probe(self, task: Task, trajectory_id: str, turn: int) -> Probe:
        return NO_PROBE

    def act(self, inputs: Sequence[ActorInput]) -> list[Generation | str]:
        """One generation per input; the inputs of one call share ``max_new_tokens``."""
        budgets = {x.max_new_tokens for x in inputs}
        if len(budgets) > 1:
            raise ValueError(f"one act() call must share max_new_tokens; got {sorted(budgets, key=str)}")
        images = [x.images for x in inputs] if any(x.images for x in inputs) else None
        turns = [(int(x.turn), "summary") if x.summary else (int(x.turn), x.part) if x.part else int(x.turn) for x in inputs]
        return self.generate([x.prompt for x in inputs], [x.trajectory_id for x in inputs],
                             max_new_tokens=budgets.pop() if budgets else None, images=images, turns=turns)

    def row_seeds(self, keys: Sequence[str], turns: Sequence[object] | None = None) -> list[int] | None:
        """Each row's seed, ``stable_hash(episode_seed, key, turn)``; without ``turns``, a key's
        turn is the number of earlier turn-less calls for it (a key twice in one call counts
        twice). None without ``episode_seed``."""
        if self.episode_seed is None:
            return None
        if turns is None:
            turns = []
            for key in keys:
                turns.append(self.calls.get(key, 0))
                self.calls[key] = turns[-1] + 1
        elif len(turns) != len(keys):
            raise ValueError(f"{len(turns)} turns for {len(keys)} keys")
        return [stable_hash(self.episode_seed, key, *(turn if isinstance(turn, tuple) else (turn,)))
                for key, turn in zip(keys, turns)]

    def generate(self, prompts: Sequence[Sequence[int]], keys: Sequence[str], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, images: Sequence[Sequence[bytes]] | None = None,
                 turns: Sequence[object] | None = None, row_seeds: Sequence[int] | None = None) -> list[Generation]:
        """Sample one continuation per prompt (``keys``: the episode each belongs to, for the
        prefix cache and the row seeds); ``max_new_tokens`` and ``temperature`` default to the
        actor's. The one sampling path of env episodes and of the gateway's requests. ``images``:
        per prompt, the images of its blocks (vision policies; the id-keyed caches are bypassed,
        since equal ids may hold different images). ``turns``: per prompt, its turn in its
        episode (with ``episode_seed``; see ``row_seeds``). ``row_seeds``: each row's seed as
        given (an inference replica samples with the seeds its client drew), instead of the
        actor's own. With another backend (``Policy.sampler``: vLLM, inference replicas) the
        backend samples, with the row seeds when it takes them."""
        n = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        t = self.temperature if temperature is None else temperature
        if (self.episode_seed is not None or row_seeds is not None) and images is not None:
            raise ValueError("episode_seed is not supported for prompts with images")
        seeds = self.row_seeds(keys, turns) if row_seeds is None else list(row_seeds)
        generator = self.generator if seeds is None else None
        if images is not None:
            if self.policy.vision is None:
                raise ValueError("prompts with images need a vision policy")
            return sample(self.policy.model, prompts, max_new_tokens=n, stop_ids=self.policy.stop_ids,
                          pad_id=self.policy.pad_id, temperature=t, generator=self.generator,
                          vision=self.policy.vision.inputs(images, self.policy.device))
        if self.policy.sampler is not None:  # vLLM, or inference replicas (their own prefix caches)
            return self.policy.sampler.sample(self.policy.model, self.policy.version, prompts, max_new_tokens=n,
                                              stop_ids=self.policy.stop_ids, temperature=t, keys=keys, row_seeds=seeds)
        cache = self.cache  # KV computed under one adapter is not another's
        if cache is not None:
            return cache.sample(self.policy.model, keys, prompts, self.policy.version, max_new_tokens=n,
                                     stop_ids=self.policy.stop_ids, pad_id=self.policy.pad_id, temperature=t,
                                     generator=generator, row_seeds=seeds)
        prefills = self.prefills if len(adapter_names(self.policy.model)) < 2 else None  # shared by one adapter's actors
        if prefills is not None:
            prefills.check(self.policy.version)
        return sample(self.policy.model, prompts, max_new_tokens=n, stop_ids=self.policy.stop_ids,
                      pad_id=self.policy.pad_id, temperature=t, generator=generator, prefills=prefills,
                      row_seeds=seeds)


class ExpertActor:
    """The env's expert policy (``expert_action``), as text.

    With ``noise > 0`` it is an imperfect demonstrator: at each turn, with probability
    ``noise``, it plays a uniformly random action of ``action_names`` (or, for envs with open
    text actions, the env's ``random_action``) instead of the expert's (which may be the
    expert's by chance). The draw is a function of ``seed``, the episode's task and the turn
    index only, so two episodes of the same task get the same draws.
    """

    version = -1
    needs_tokens = False

    def __init__(self, noise: float = 0.0, seed: int = 0, action_names: Sequence[str] = ()) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1]; got {noise}")
        self.noise, self.seed, self.action_names = noise, int(seed), tuple(action_names)
        self.random_actions = 0  # turns where the random action replaced the expert's

    def _draw(self, task: Task, turn: int) -> random.Random:
        return random.Random(stable_hash(self.seed, "expert-noise", task.task_id, turn))

    def probe(self, task: Task, trajectory_id: str, turn: int) -> Probe:
        env_side_random = self.noise > 0 and not self.action_names
        return Probe(expert=True, random_seed=stable_hash(self.seed, "expert-random", task.task_id, turn) if env_side_random else None)

    def act(self, inputs: Sequence[ActorInput]) -> list[Generation | str]:
        out: list[Generation | str] = []
        for x in inputs:
            if x.summary:  # the expert's summary (no noise: summaries are not actions)
                if x.after.expert_summary is None:
                    raise RuntimeError(f"no expert summary for {x.trajectory_id}: the env host was not asked for one")
                out.append(x.after.expert_summary)
                continue
            text = x.after.expert_action
            if text is None:
                raise RuntimeError(f"no expert action for {x.trajectory_id}: the env host was not asked for one")
            if self.noise > 0:
                draw = self._draw(x.task, x.turn)
                if draw.random() < self.noise:
                    text = draw.choice(self.action_names) if self.action_names else x.after.random_action
                    self.random_actions += 1
            out.append(text)
        return out


class RandomActor:
    """A uniformly random policy: the action name a hash of (seed, episode, turn) picks, or,
    for envs with open text actions, the env's ``random_action(rng)`` with an rng seeded from
    the same hash."""

    version = -1
    needs_tokens = False

    def __init__(self, seed: int, action_names: Sequence[str] = ()) -> None:
        self.seed, self.action_names = int(seed), tuple(action_names)

    def _seed(self, trajectory_id: str, turn: int) -> int:
        return stable_hash(self.seed, "random-actor", trajectory_id, turn)

    def probe(self, task: Task, trajectory_id: str, turn: int) -> Probe:
        return NO_PROBE if self.action_names else Probe(random_seed=self._seed(trajectory_id, turn))

    def act(self, inputs: Sequence[ActorInput]) -> list[Generation | str]:
        if any(x.summary for x in inputs):  # a random policy keeps nothing in mind
            return ["" if x.summary else self.act([x])[0] for x in inputs]
        if not self.action_names:
            return [x.after.random_action for x in inputs]  # type: ignore[misc]
        n = len(self.action_names)
        return [self.action_names[self._seed(x.trajectory_id, x.turn) % n] for x in inputs]
