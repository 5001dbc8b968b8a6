"""An expert that thinks (``env.kwargs.expert_thoughts``) and a tiny reasoning model
(``model.thinking``): the thought text (hand-checked), the env parses the move only, and BC
demonstrations hold the thought's tokens as trained tokens (loss mask 1)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.rules import check_run
from turnforge.config import RolloutConfig, TinyModelConfig
from turnforge.envpool import InlineEnvs
from turnforge.envs import make
from turnforge.envs.checker import check_env
from turnforge.envs.frozenlake import FrozenLakeLevel, FrozenLakeState
from turnforge.errors import UserError
from turnforge.policy.model import load_chat_format, load_policy
from turnforge.policy.tiny import build_tiny_model
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine

CORPUS = ["path Down Right Up Left goal P _ O G"]


@pytest.fixture(scope="module")
def thinking_tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("think") / "m", TinyModelConfig(**TINY_TEST_SHAPE), corpus=CORPUS,
                            thinking=True)


def on_map(env, text: str) -> None:
    level = FrozenLakeLevel.from_text(text)
    env.reset(seed=0)
    env.state = FrozenLakeState(level, level.start)


def test_the_expert_thinks_its_plan_then_moves():
    env = make("frozenlake", expert_thoughts=True)
    on_map(env, "P__O\nOO_O\n___O\n_O_G")  # one shortest safe path: along the top, down column 2
    assert env.expert_thought() == "path Right Right Down Down Down Right"
    assert env.expert_action() == "<think>\npath Right Right Down Down Down Right\n</think>\n\nRight"
    slippery = make("frozenlake", expert_thoughts=True, is_slippery=True)
    on_map(slippery, "____\n_P__\n____\n___G")
    assert slippery.expert_thought() == "goal 2 Down 2 Right"
    plain = make("frozenlake")
    on_map(plain, "P__O\nOO_O\n___O\n_O_G")
    assert plain.expert_action() == "Right"  # off by default: the move alone
    with pytest.raises(Exception):  # the env parses the move only: the whole text is no action
        env.parse_action(env.expert_action())
    check_env(make("frozenlake", expert_thoughts=True))  # the checker plays the answer part, as the engine does


def test_tiny_thinking_model_has_the_markers(thinking_tiny, tiny_model_dir):
    chat = load_chat_format(thinking_tiny)
    assert chat.thinking is not None and chat.thinking.drops
    assert len(chat.encode("<think>")) == len(chat.encode("</think>")) == 1
    assert load_chat_format(tiny_model_dir).thinking is None
    with pytest.raises(UserError, match="model.thinking=true"):
        check_run(load_config("frozenlake-think-tiny", ["model.thinking=false"]), make("frozenlake"))
    check_run(load_config("frozenlake-think-tiny"), make("frozenlake"))


def play_expert(model_dir, history: str, n: int = 2):
    kwargs = {"size": 4, "expert_thoughts": True}
    policy = load_policy(model_dir)
    cfg = RolloutConfig(context="full_history", history=history, max_turns=12, max_new_tokens=32, max_context_tokens=1024)
    engine = RolloutEngine(InlineEnvs("frozenlake", n, kwargs), cfg, policy, make("frozenlake", **kwargs))
    try:
        reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
        return policy, engine.play(reqs, ExpertActor())
    finally:
        engine.close()


@pytest.mark.parametrize("history", ["as_sampled", "as_rendered"])
def test_demonstrations_train_on_the_thoughts(thinking_tiny, history):
    policy, (trajs, stats) = play_expert(thinking_tiny, history)
    thinking = policy.chat.thinking
    assert all(t.success for t in trajs)  # the env got the moves
    turns = sum(t.num_turns for t in trajs)
    for t in trajs:
        for s in t.samples:
            ids, mask = np.asarray(s.token_ids), np.asarray(s.loss_mask)
            trained = ids[mask == 1].tolist()
            opens = trained.count(thinking.open_id)
            assert opens == trained.count(thinking.close_id) >= 1
            assert thinking.close_id not in ids[mask == 0].tolist()  # no thought is context only
            text = policy.tokenizer.decode(trained)
            assert "path " in text and "</think>" in text
    assert sum(len(t.samples) for t in trajs) == (len(trajs) if history == "as_sampled" else turns)
    assert stats.thinking_tokens > 0 and stats.answer_tokens > 0


def test_a_thought_without_markers_is_one_line(tiny_model_dir):
    with pytest.raises(UserError, match="no thinking markers.*expert_thoughts=false"):
        play_expert(tiny_model_dir, "as_sampled", n=1)
