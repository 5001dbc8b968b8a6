"""Generative rewards: score parsing, the judged trajectory, prompts, and the judge's batching
on a scripted model (the real-model runs are in tests/train/test_judge_runs.py)."""

from __future__ import annotations

import pytest
import torch

from turnforge.app.config import load_config
from turnforge.config import JudgeConfig
from turnforge.errors import UserError
from turnforge.rewards.judge import DEFAULT_RUBRIC, Judge, build_prompt, judged, parse_score, render_transcript
from turnforge.types import JudgeRecord, Task, Trajectory, Turn


def traj(answer: str = "17", reference: str = "17", rewards=(-0.1, 1.0)) -> Trajectory:
    turns = (Turn("How many pears?", '<tool_call>{"name": "count"}</tool_call>', rewards[0], False, ""),
             Turn("17", f"<answer>{answer}</answer>", rewards[1], False, ""))
    return Trajectory("t0", Task("mcp-tools", "train", 0, {"answer": reference}), "g0", 0, turns, (), sum(rewards),
                      answer == reference, True, False, None, 3)


@pytest.mark.parametrize("text, score", [
    (" 7", 7.0), ("Score: 8", 8.0), ("I count 3 errors. Score: 9/10", 9.0), ("score=2.5", 2.5),
    (" 10 out of 10", 10.0), ("no digits here", None), ("Score: 11", None), (" -1", None),
])
def test_parse_score_takes_the_score_line_or_the_first_number_in_range(text, score):
    assert parse_score(text, 0, 10) == score


def test_judged_replaces_the_last_reward_and_keeps_the_earlier_ones():
    t = traj(rewards=(-0.1, 1.0))
    record = JudgeRecord("p", " 7", 7.0, t.episode_return)
    out = judged(t, record, 0, 10)
    assert [x.reward for x in out.turns] == [-0.1, pytest.approx(0.7)]
    assert out.episode_return == pytest.approx(0.6) and out.judge is record and out.infra_failure is None
    assert out.success is True  # success stays the verifier's (evaluation measures it)
    assert judged(t, JudgeRecord("p", " 5", 5.0, 0.9), 2, 6).turns[-1].reward == pytest.approx(0.75)


def test_no_score_is_an_infrastructure_failure_not_reward_0():
    out = judged(traj(), JudgeRecord("p", "The agent did well.", None, 0.9), 0, 10)
    assert out.infra_failure == "the judge gave no score in 0..10: 'The agent did well.'"
    assert out.turns == traj().turns


def test_transcript_and_prompt():
    t = traj(answer="71")
    assert render_transcript(t) == ('Agent: <tool_call>{"name": "count"}</tool_call>\nEnvironment: 17\n'
                                    'Agent: <answer>71</answer>')
    assert render_transcript(t, max_chars=20) == "[...]" + render_transcript(t)[-20:]
    prompt = build_prompt("{task}|{reference}|{final}", t)
    assert prompt == "How many pears?|17|<answer>71</answer>"
    # best-of-N selection withholds the reference (it would be the oracle)
    assert build_prompt("{task}|{reference}|{final}", t, with_reference=False) == "How many pears?|none given|<answer>71</answer>"
    no_ref = Trajectory("t1", Task("x", "train", 0, {}), "g", 0, t.turns, (), 0.0, False, True, False, None, 0)
    assert "Reference answer: none given" in build_prompt(DEFAULT_RUBRIC, no_ref)


class ScriptedLM(torch.nn.Module):
    """Generates fixed ids after any prompt; its next-token logits favour ``yes_id`` on even
    rows of a batch and ``no_id`` on odd ones."""

    def __init__(self, reply: list[int], yes_id: int, no_id: int, vocab: int) -> None:
        super().__init__()
        self.reply, self.yes_id, self.no_id, self.vocab = reply, yes_id, no_id, vocab
        self.calls: list[tuple[int, int]] = []
        self.w = torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, attention_mask, **kw):
        self.calls.append(tuple(input_ids.shape))
        assert attention_mask[:, -1].all()  # left padding: every prompt ends at the last column
        return torch.cat([input_ids, torch.tensor([self.reply] * len(input_ids))], dim=1)

    def forward(self, input_ids, attention_mask, position_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        even = torch.arange(len(input_ids)) % 2 == 0
        logits[even, -1, self.yes_id] = 2.0
        logits[~even, -1, self.no_id] = 2.0
        return type("Out", (), {"logits": logits})()


def test_the_judge_batches_left_padded_prompts_and_records_every_verdict(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = tok(" 6", add_special_tokens=False)["input_ids"]
    model = ScriptedLM(reply, -1, -1, len(tok))
    trajs = [traj(answer=str(a)) for a in (17, 7, 170)]
    judge = Judge(model, tok, DEFAULT_RUBRIC, 0, 10, 4, batch_size=2)
    records = judge.judge(trajs)
    assert model.calls[0][0] == 2 and model.calls[1][0] == 1  # batches of 2, then 1
    assert [r.output for r in records] == [" 6"] * 3 and [r.score for r in records] == [6.0] * 3
    assert records[0].prompt.endswith("Score:") and "<answer>7</answer>" in records[1].prompt
    assert [r.verifier_return for r in records] == [t.episode_return for t in trajs]
    yes_no = Judge(model, tok, "{final}", 0, 1, 4, batch_size=8, mode="yes_no", response_prefix="Answer:")
    common, model.yes_id, model.no_id = yes_no._answer_tokens()
    assert model.yes_id != model.no_id  # the tiny tokenizer splits off the space: ([" "], "Yes"..., "No"...)
    out = yes_no.apply(trajs + [Trajectory("f", trajs[0].task, "g", 0, (), (), 0.0, False, False, False, None, 0,
                                           infra_failure="env crashed")])
    p = torch.tensor([2.0, 0.0]).softmax(0)[0].item()
    assert [t.judge.score for t in out[:3]] == pytest.approx([p, 1 - p, p])
    assert [t.judge.output for t in out[:3]] == ["Yes (p=0.881)", "No (p=0.119)", "Yes (p=0.881)"]
    assert [t.episode_return for t in out[:3]] == pytest.approx([-0.1 + p, -0.1 + 1 - p, -0.1 + p], abs=1e-6)
    assert out[3].judge is None and out[3].infra_failure == "env crashed"  # failures pass through unjudged


@pytest.mark.parametrize("args, message", [
    (["reward.judge.rubric=Grade {answer}"], "rubric has a placeholder other than {task}, {transcript}, {final}, {reference}"),
    (["reward.judge.min_score=5", "reward.judge.max_score=5"], "max_score=5 must be above min_score=5"),
    (["reward.judge.enabled=true", "flywheel.rounds=1"], "a judge reward scores the RL stage"),
    (["reward.judge.enabled=true", "rl.advantage=mc_grpo", "rollout.context=window"], "a judge scores whole episodes"),
    (["reward.judge.mode=vote"], "reward.judge.mode"),
])
def test_bad_judge_config_is_one_line(args, message):
    with pytest.raises(UserError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_config("calculator-tiny", args)


def test_judge_config_defaults():
    cfg = JudgeConfig()
    assert (cfg.model, cfg.mode, cfg.rubric, cfg.response_prefix) == ("policy", "score", None, None)
