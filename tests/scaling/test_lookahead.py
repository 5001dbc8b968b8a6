"""Lookahead at evaluation on a real tiny FrozenLake run: the pick is the candidate with the
highest Monte-Carlo Q (checked with the Q-values replaced, inside this unit test), the played
tokens re-score to their sampling logprobs, an evaluation repeats exactly, and an env without
snapshots is refused before any episode."""

from __future__ import annotations

import json
from contextlib import closing

import numpy as np
from helpers import assert_rescores, run_main

import turnforge.scaling.lookahead as la
from turnforge.app.config import load_config
from turnforge.critic.mc import MCEstimate
from turnforge.rollout.engine import EpisodeRequest, make_engine
from turnforge.train.evaluate import load_for_eval


def _setup(run):
    cfg = load_config(str(run / "config.yaml"), ["eval.episodes=4"])
    policy = load_for_eval(cfg, run / "checkpoints" / "final")
    return cfg, policy


def test_lookahead_repeats_and_its_tokens_rescore(critic_run):
    cfg, policy = _setup(critic_run)
    results = []
    for _ in range(2):
        with closing(make_engine(cfg, policy)) as engine, closing(make_engine(cfg, policy)) as mc:
            results.append(la.evaluate_lookahead(engine, mc, policy, k=3, rollouts=2, horizon=4, episodes=4, split="heldout",
                                                 temperature=1.0, seed=0))
    (r1, s1), (r2, s2) = results
    assert r1 == r2 and (s1.mc_env_steps, s1.changed, s1.turns) == (s2.mc_env_steps, s2.changed, s2.turns)
    assert s1.turns > 0 and s1.mc_env_steps > 0 and 1.0 <= s1.distinct_candidates <= 3.0
    # the tokens of the played (picked) generations are the sampled ones: they re-score to their logprobs
    with closing(make_engine(cfg, policy)) as engine, closing(make_engine(cfg, policy)) as mc:
        actor = la.LookaheadActor(policy, mc, max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, k=3, rollouts=2,
                                  horizon=4, max_turns=cfg.rollout.max_turns, gamma=1.0, seed=0)
        trajs, _ = engine.play([EpisodeRequest(engine.env.task("heldout", i), i, "g", f"t{i}") for i in range(2)], actor,
                               keep_snapshots=True)
    assert_rescores(policy, [x for t in trajs for x in t.samples])


def test_the_pick_is_the_candidate_with_the_highest_q(critic_run):
    cfg, policy = _setup(critic_run)
    seen = []

    def fake_q(engine, starts, actor, **kw):  # one episode: Q = 1 for its last distinct candidate only
        texts = [st.first_actions[0] for st in starts]
        seen.append(texts)
        return MCEstimate(np.array([0.0] * (len(texts) - 1) + [1.0]), np.zeros(len(texts)), 0)

    with closing(make_engine(cfg, policy)) as engine:
        actor = la.LookaheadActor(policy, engine, max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, k=4, rollouts=1,
                                  horizon=2, max_turns=cfg.rollout.max_turns, gamma=1.0, seed=0)
        actor.estimate = fake_q
        trajs, _ = engine.play([EpisodeRequest(engine.env.task("heldout", 0), 0, "g", "t0")], actor, keep_snapshots=True)
    played = [turn.action_text for turn in trajs[0].turns]
    assert played == [texts[-1] for texts in seen[: len(played)]]
    assert any(len(texts) > 1 for texts in seen)  # the candidates differed somewhere: the pick mattered


def test_the_eval_command_reports_lookahead_and_refuses_an_env_without_snapshots(critic_run, tmp_path, monkeypatch, capsys):
    code, _, err = run_main(["eval", critic_run / "checkpoints" / "final", "--episodes", "3", "--lookahead", "2",
                             "--lookahead-rollouts", "1", "--lookahead-horizon", "2", "--out", tmp_path / "e.json"],
                            tmp_path, monkeypatch, capsys)
    assert code == 0, err
    data = json.loads((tmp_path / "e.json").read_text())["lookahead"]
    assert data["result"]["episodes"] == 3 and data["stats"]["candidates"] == 2 and "lookahead K=2 M=1 H=2" in err

    import turnforge.envs.base as base
    from turnforge.envs.base import capabilities

    real = capabilities
    monkeypatch.setattr(base, "capabilities", lambda env: __import__("dataclasses").replace(real(env), snapshot=False))
    code, _, err = run_main(["eval", critic_run / "checkpoints" / "final", "--episodes", "3", "--lookahead", "2",
                             "--out", tmp_path / "f.json"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "--lookahead (Monte-Carlo Q-values from env snapshots) needs env 'frozenlake' to implement snapshot()" in err
    assert not (tmp_path / "f.json").exists()
