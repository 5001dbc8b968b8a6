"""rollout.context=fold: branch(goal) opens a sub-context, return(message) folds it; one sample per
context, each token-exact, every action run knowing its env turn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rescores, inline_engine

from turnforge.config import RolloutConfig, TrainConfig
from turnforge.policy.generate import Generation, token_logprobs
from turnforge.rollout.context import FOLD_INSTRUCTIONS, fold_meta
from turnforge.rollout.engine import EpisodeRequest
from turnforge.train.credit import action_turns, sample_advantage

SCRIPT = ["up", "branch(look around)", "down", "left", "return(found it)", "right", "up"]


class ScriptedActor:
    """Answers with the next line of ``script`` per episode, as ids the policy could have
    sampled, each with the model's own logprob given the prompt (teacher forcing); records the
    prompts it saw."""

    version = 0
    needs_tokens = True

    def __init__(self, policy, script):
        self.policy, self.script, self.seen = policy, script, {}

    def probe(self, task, trajectory_id, turn):
        from turnforge.envpool.host import NO_PROBE

        return NO_PROBE

    def act(self, inputs):
        out = []
        for x in inputs:
            calls = self.seen.setdefault(x.trajectory_id, [])
            text = self.script[len(calls)]
            ids = self.policy.chat.encode(text) + (self.policy.stop_ids[0],)
            calls.append((tuple(x.prompt), ids))
            full = torch.tensor([list(x.prompt) + list(ids)])
            with torch.no_grad():
                lp, _ = token_logprobs(self.policy.model, full, torch.ones_like(full))
            out.append(Generation(ids, tuple(float(v) for v in lp[0, len(x.prompt):]), True))
        return out


def _play(policy, script=SCRIPT, n=2, **cfg):
    cfg = RolloutConfig(context="fold", max_turns=8, max_new_tokens=8, max_context_tokens=1024, **cfg)
    engine = inline_engine(policy, "test-echo", cfg, n, episode_len=5, max_obs_words=6)
    actor = ScriptedActor(policy, script)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(n)]
    trajs, _ = engine.play(reqs, actor)
    return engine, actor, trajs


def test_meta_actions_parse():
    assert fold_meta("branch(look around)\nmore") == ("branch", "look around")
    assert fold_meta("  return( found it )") == ("return", "found it")
    assert fold_meta("up") is None and fold_meta("branchy(x)") is None and fold_meta("") is None


def test_a_branch_is_its_own_sample_and_the_main_context_folds_it(tiny_policy):
    engine, actor, trajs = _play(tiny_policy)
    assert FOLD_INSTRUCTIONS in engine.prompt.system
    for t in trajs:
        assert [turn.action_text for turn in t.turns] == ["up", "down", "left", "right", "up"]  # meta-actions never reach the env
        main, branch = t.samples
        assert (main.segment_index, main.parent_segment, branch.segment_index, branch.parent_segment) == (0, -1, 1, 0)
        assert main.run_turns == (0, 1, 3, 4) and branch.run_turns == (1, 2, 3) and branch.first_turn == 1
        text = tiny_policy.tokenizer.decode(main.token_ids.tolist())
        assert "Sub-task returned: found it" in text and "left" not in text.split("branch(look around)")[1].split("Sub-task returned")[0]
        assert "Sub-task: look around" in tiny_policy.tokenizer.decode(branch.token_ids.tolist())
        # each action's prompt is exactly what precedes it in its sample
        calls = actor.seen[t.trajectory_id]
        where = {0: main, 1: main, 2: branch, 3: branch, 4: branch, 5: main, 6: main}  # branch() is called in main
        for k, (prompt, ids) in enumerate(calls):
            ids_of = where[k].token_ids.tolist()
            at = next(i for i in range(len(ids_of)) if ids_of[:i] == list(prompt) and ids_of[i:i + len(ids)] == list(ids))
            assert at == len(prompt)
    assert_rescores(tiny_policy, [s for t in trajs for s in t.samples], atol=1e-4)


def test_advantages_land_on_each_runs_turn(tiny_policy):
    _, _, trajs = _play(tiny_policy, n=1)
    main, branch = trajs[0].samples
    per_turn = np.array([10.0, 11.0, 12.0, 13.0, 14.0], np.float32)
    for s in (main, branch):
        turns = action_turns(s)
        adv = sample_advantage(s, per_turn)
        runs = [int(v) for v in turns[s.loss_mask == 1]]
        assert set(runs) == set(s.run_turns)
        np.testing.assert_array_equal(adv[s.loss_mask == 1], per_turn[np.asarray(runs)])


def test_branches_beyond_the_limit_and_nested_ones_go_to_the_env(tiny_policy):
    script = ["branch(a)", "branch(b)", "return(x)", "return(y)", "branch(c)", "up", "up", "up", "up", "up"]
    _, _, trajs = _play(tiny_policy, script=script, n=1, max_branches=1)
    t = trajs[0]
    assert [turn.action_text for turn in t.turns][:3] == ["branch(b)", "return(y)", "branch(c)"]
    assert [s.segment_index for s in t.samples] == [0, 1]


@pytest.mark.parametrize("override,says", [
    ({"rollout": {"context": "fold", "include_instructions": False}}, "rollout.context=fold explains branch(goal)"),
    ({"rollout": {"context": "fold"}, "critic": {"enabled": True}, "rl": {"advantage": "gae"}}, "critic.enabled=true"),
])
def test_fold_options_it_refuses(override, says):
    from turnforge.app.config import config_from_dict
    from turnforge.errors import UserError

    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(override)


def test_fold_on_a_tool_env_is_refused():
    from turnforge.envs import make
    from turnforge.errors import UserError
    from turnforge.train.checks import check_options

    cfg = TrainConfig.model_validate({"env": {"id": "calculator"}, "rollout": {"context": "fold"}})
    with pytest.raises(UserError, match="takes tool calls"):
        check_options(cfg, make("calculator"))


@pytest.mark.parametrize("advantage", ["grpo", "gigpo"])
def test_credit_and_an_update_train_every_context(tiny_policy, advantage):
    from turnforge.optim import GuardedStep
    from turnforge.train.credit import assign_credit
    from turnforge.train.update import ppo_update

    script = ["up", "branch(look around)", "down", "left", "return(found it)", "right", "up"]
    _, _, trajs = _play(tiny_policy, script=script, n=2)
    from dataclasses import replace

    trajs[1] = replace(trajs[1], turns=tuple(replace(t, reward=0.0) for t in trajs[1].turns), episode_return=0.0,
                       success=False, group_id=trajs[0].group_id)  # one group, two outcomes
    cfg = TrainConfig.model_validate({"rollout": {"context": "fold"}, "rl": {"advantage": advantage}})
    credit = assign_credit(trajs, cfg, 0, pad_id=tiny_policy.pad_id)
    assert len(credit.samples) == 4 and {x.segment_index for x, _ in credit.samples} == {0, 1}
    before = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters()}
    opt = torch.optim.AdamW(tiny_policy.model.parameters(), lr=1e-3)
    ppo_update(tiny_policy, credit.samples, GuardedStep(tiny_policy.model, opt, 1.0, 3), cfg.rl, temperature=1.0,
               shuffle=np.random.default_rng(0))
    assert any(not torch.equal(before[n], p) for n, p in tiny_policy.model.named_parameters())
