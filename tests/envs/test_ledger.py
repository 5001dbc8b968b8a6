"""The ledger tool env: facts gathered over many calls, the expert, its summaries, and a
summarize rollout whose segments carry the running best."""

from __future__ import annotations

import pytest
from helpers import inline_engine

from turnforge.config import RolloutConfig
from turnforge.envs import check_env, make
from turnforge.errors import UserError
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest


def _call(account: str) -> str:
    return f'<tool_call>{{"name": "lookup", "arguments": {{"account": "{account}"}}}}</tool_call>'


def test_lookups_answer_and_the_running_summary():
    env = make("ledger", num_accounts=5)
    question = env.reset(env.task("train", 4), 0)
    level = env.state["level"]
    assert all(a in question for a in level.accounts) and len(set(level.balances)) == 5
    first = env.step(_call(level.accounts[0]))
    assert f"balance {level.balances[0]}" in first.observation and not first.invalid_action
    assert env.expert_summary() == f"Best: {level.accounts[0]} {level.balances[0]}. Done: {level.accounts[0]}."
    missing = env.step(_call("durian"))
    assert "no account 'durian'" in missing.observation and missing.info["n_tool_errors"] == 1
    wrong = next(a for a in level.accounts if a != level.answer)
    result = env.step(f"<answer>{wrong}</answer>")
    assert result.terminated and not result.success and result.reward == 0.0


def test_the_expert_wins_and_check_env_passes():
    env = make("ledger")
    env.reset(env.task("heldout", 1), 0)
    for _ in range(env.max_steps):
        result = env.step(env.expert_action())
        if result.terminated:
            break
    assert result.success and env.expert_summary().startswith(f"Best: {env.state['level'].answer} ")
    check_env(make("ledger", num_accounts=4))


def test_summarize_segments_carry_the_experts_summaries(tiny_policy):
    cfg = RolloutConfig(context="summarize", max_turns=20, max_new_tokens=64, max_context_tokens=1024,
                        summary_threshold=600, summary_max_tokens=96, summary_prompt="Summary?")
    engine = inline_engine(tiny_policy, "ledger", cfg, 1, num_accounts=12)
    (t,), stats = engine.play([EpisodeRequest(engine.env.task("train", 0), 0, "g", "t")], ExpertActor())
    assert t.success and stats.summaries >= 1 and len(t.samples) == stats.summaries + 1
    tok = tiny_policy.tokenizer
    for x in t.samples[:-1]:
        assert tok.decode(x.token_ids[len(x) - x.summary_tokens:], skip_special_tokens=True).startswith("Best: ")


@pytest.mark.parametrize("kwargs, message", [({"num_accounts": 1}, "num_accounts must be in 2..24"),
                                             ({"num_accounts": 10, "max_balance": 5}, "max_balance must be >= num_accounts")])
def test_bad_options(kwargs, message):
    with pytest.raises(UserError, match=message):
        make("ledger", **kwargs)
