"""Typed records that cross module boundaries: tasks, env steps, turns, samples, trajectories.

Data flows one way per iteration: ``Task`` -> env steps (``StepResult``) -> ``Turn`` records
and token-exact ``Sample`` objects -> ``Trajectory`` -> trainer. Nothing here is a
``dict[str, Any]``; free-form extras live in ``info`` mappings of scalars only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np

Split = Literal["train", "heldout"]
SPLITS: tuple[str, ...] = ("train", "heldout")

Scalar = float | int | str | bool

#: The (open, close) markers of reasoning templates (``turnforge.policy.thinking``): a thought an
#: action carries before its answer sits between them.
THINKING_MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)


class TokenAlignmentError(ValueError):
    """Token ids, loss mask, logprobs and versions of a sample do not line up."""


@dataclass(frozen=True)
class Task:
    """One task of an env: ``(env_id, split, index)`` names it exactly.

    ``data`` holds the task's fields when the task comes from a dataset or a task generator
    (``turnforge.envs.tasks``); it is ``None`` for envs that build the task themselves from
    its split and index (the generated levels of ``LevelEnv``). Train and held-out tasks are
    disjoint by content, not only by index (each task source checks it).
    """

    env_id: str
    split: Split
    index: int
    data: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def task_id(self) -> str:
        return f"{self.env_id}:{self.split}:{self.index}"


@dataclass(frozen=True)
class StepResult:
    """What ``Env.step`` returns. ``terminated`` = the game ended (win or loss);
    ``truncated`` = stopped from outside the game (step limit)."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    invalid_action: bool = False
    success: bool = False
    info: Mapping[str, Scalar] = field(default_factory=dict)
    #: PNG bytes of the images shown with ``observation`` (before its text, in order). Env hosts
    #: fill it from the env's ``observation_images()`` after every reset, restore and step.
    images: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class EnvSnapshot:
    """Opaque full copy of an env's episode state; pass it to ``Env.restore``.

    ``observation`` is the observation the env showed in that state, when known (the env
    hosts fill it in), so an episode started from the snapshot can show it again."""

    env_id: str
    payload: Any
    observation: str = ""


@dataclass(frozen=True)
class Turn:
    """One agent turn of an episode, as text (the token view lives in ``Sample``)."""

    observation: str  # what the env showed before this turn's action (untruncated text)
    action_text: str  # the decoded text of the generated ids, what the env got (a reasoning template's: the answer part)
    reward: float
    invalid_action: bool
    anchor_key: str  # env state key before the action (for step-level credit)
    obs_truncated_tokens: int = 0  # observation tokens cut by the context budget (0 = none)
    generation_truncated: bool = False  # hit max_new_tokens before a stop token
    potential: float = 0.0  # env.potential() before the action (reward shaping)
    next_potential: float = 0.0  # env.potential() after the step; 0 when the step terminated the episode
    info: Mapping[str, Scalar] = field(default_factory=dict)  # the step's info (``n_*`` keys are event counters)


@dataclass(frozen=True, eq=False)
class Sample:
    """One training sequence, token-exact.

    All four arrays have length T; a mismatch raises ``TokenAlignmentError`` at once.
    ``loss_mask`` is 1 exactly on the action tokens (sampled by the policy, or written by
    an expert in a demonstration) and 0 on context (prompt, env, template) tokens.
    ``versions`` is the policy version that sampled each token, -1 where no policy
    sampled it; ``logprobs`` are the sampling logprobs where ``versions >= 0``, NaN
    elsewhere.

    Segments (``rollout.context=summarize``): each context the policy saw is one sample,
    ``segment_index`` 0, 1, ... in order, ``parent_segment`` the segment it continues (-1 for
    the first). ``first_turn`` is the episode turn of the sample's first action, and the last
    ``summary_tokens`` tokens of a segment that ends in a summary are that summary (as
    sampled; the next segment holds a copy of them as context).

    Episodic memory (``memory.enabled``): ``token_ids[memory_start : memory_start +
    memory_tokens]`` is the block of recalled past successes in the sample's prompt (context,
    loss mask 0; ``memory_tokens`` 0 when none was shown).

    Images (vision policies): ``images`` are the images whose processor blocks the ids hold, in
    the order of the blocks; every forward pass over the ids gets exactly these pixels.
    """

    token_ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T] int8, 1 = action token (trained on)
    logprobs: np.ndarray  # [T] float32, sampling logprobs where versions >= 0, NaN elsewhere
    versions: np.ndarray  # [T] int32, -1 where not sampled by a policy (context, demonstrations)
    trajectory_id: str
    turn_index: int  # -1: the sample spans several turns (full-history context, a segment)
    segment_index: int = 0
    parent_segment: int = -1
    first_turn: int = 0  # turn of the first action in a sample of several turns
    summary_tokens: int = 0  # trailing tokens that are the segment's summary (0: none)
    memory_start: int = 0  # where the episodic-memory block starts in token_ids
    memory_tokens: int = 0  # its length (0: no memory shown)
    #: PNG bytes of the images whose blocks ``token_ids`` hold, in order (``turnforge.policy.vision``)
    images: tuple[bytes, ...] = field(default=(), repr=False)
    #: ``rollout.context=fold``: the env turn of each run of action tokens, in order (a ``branch`` or
    #: ``return`` meta-action: the turn it precedes); () when runs are consecutive turns from ``first_turn``
    run_turns: tuple[int, ...] = ()
    #: the policy (LoRA adapter, ``agent.policies``) that sampled its actions; "" for the run's one policy
    policy: str = ""

    def __post_init__(self) -> None:
        check_alignment(self.token_ids, self.loss_mask, self.logprobs, self.versions, where=self.trajectory_id)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.loss_mask.sum())


def check_alignment(
    token_ids: np.ndarray, loss_mask: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, where: str = ""
) -> None:
    """Raise ``TokenAlignmentError`` unless the four per-token arrays line up."""
    lengths = {
        "token_ids": token_ids.shape,
        "loss_mask": loss_mask.shape,
        "logprobs": logprobs.shape,
        "versions": versions.shape,
    }
    if len({s for s in lengths.values()}) != 1 or token_ids.ndim != 1:
        raise TokenAlignmentError(f"sample {where!r}: per-token arrays differ in shape: {lengths}")
    context = loss_mask == 0
    sampled = versions >= 0
    if (versions[context] >= 0).any():
        raise TokenAlignmentError(f"sample {where!r}: a context token (loss_mask 0) carries a policy version")
    if not np.isnan(logprobs[context]).all():
        raise TokenAlignmentError(f"sample {where!r}: a context token (loss_mask 0) carries a sampling logprob")
    if not np.isfinite(logprobs[sampled]).all():
        raise TokenAlignmentError(f"sample {where!r}: a sampled token (version >= 0) has no finite sampling logprob")


@dataclass(frozen=True)
class JudgeRecord:
    """A judge model's verdict on one trajectory (``turnforge.rewards.judge``)."""

    prompt: str  # the whole prompt the judge saw (chat template applied)
    output: str  # what it generated
    score: float | None  # the score parsed from ``output`` (None: no score in range)
    verifier_return: float  # the episode's return before the judge's reward replaced it


@dataclass(frozen=True)
class Trajectory:
    """One episode: its turns as text, its samples as tokens, its outcome.

    ``infra_failure`` is set when the machinery (env code, not the policy) failed; such
    a trajectory is excluded from advantages and never scored as reward 0.

    ``snapshots`` (only with ``RolloutEngine.play(..., keep_snapshots=True)`` or a group stream
    that keeps them) holds the env snapshot
    taken before each turn's action, one per turn; they live in memory only and are
    never written by the trajectory store.
    """

    trajectory_id: str
    task: Task
    group_id: str  # trajectories of one group share a task (GRPO's G rollouts)
    env_seed: int
    turns: tuple[Turn, ...]
    samples: tuple[Sample, ...]
    episode_return: float
    success: bool
    terminated: bool
    truncated: bool
    truncation_reason: str | None  # "max_turns" | "context_budget" | "env" | None
    policy_version: int
    infra_failure: str | None = None
    resumed_steps: int = 0  # env steps replayed from a snapshot after a worker crash or hang (EnvPool)
    snapshots: tuple[EnvSnapshot, ...] = field(default=(), repr=False, compare=False)  # [num_turns] or ()
    judge: JudgeRecord | None = None  # the judge's verdict when a judge gave the reward
    memory_tokens: int = 0  # tokens of the episodic memory block its prompts opened with (0: none)
    #: several policies (``agent.policies``): each one's reward for the episode (the agent's ``rewards``)
    policy_rewards: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_invalid(self) -> int:
        return sum(t.invalid_action for t in self.turns)


@dataclass(frozen=True)
class LabelSuccess:
    """Success on the tasks of one label of an evaluation (the env's ``task_label``: a MiniWoB
    task, a mix member, a gui-click kind)."""

    label: str
    episodes: int  # scored (infra failures excluded)
    successes: int

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0


@dataclass(frozen=True)
class EvalResult:
    """Held-out (or train-split) evaluation of a policy on one env."""

    env_id: str
    split: str
    episodes: int  # episodes scored (infra failures excluded)
    success_rate: float
    mean_return: float
    invalid_action_rate: float  # invalid actions / all actions
    mean_turns: float
    infra_failures: int = 0
    tool_call_rate: float | None = None  # episodes with at least one tool call / episodes; None for envs without tools
    memory_recall_rate: float | None = None  # episodes shown a past success / episodes; None without episodic memory
    by_label: tuple[LabelSuccess, ...] = ()  # per task label, sorted by label (envs with ``task_label``; () otherwise)

    def as_dict(self) -> dict[str, Scalar]:
        return {
            "env_id": self.env_id,
            "split": self.split,
            "episodes": self.episodes,
            "success_rate": self.success_rate,
            "mean_return": self.mean_return,
            "invalid_action_rate": self.invalid_action_rate,
            "mean_turns": self.mean_turns,
            "infra_failures": self.infra_failures,
            "tool_call_rate": self.tool_call_rate,
            "memory_recall_rate": self.memory_recall_rate,
        }
