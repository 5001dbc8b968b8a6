"""The boundary measurement (``turnforge.train.boundary``): scripted episodes aggregated into a
``BoundaryReport`` by hand-computed values, p(a | o) against a direct forward pass, and the
measurement on the real engine: repeatable, and invisible to the evaluations around it."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import inline_engine

from turnforge.app.config import load_config
from turnforge.config import RolloutConfig
from turnforge.errors import RunStopped
from turnforge.train.boundary import PassAtKPlan, first_action_probs, measure_boundary, plan
from turnforge.train.evaluate import evaluate
from turnforge.types import EvalResult, Task, Trajectory, Turn

EVAL = EvalResult("x", "heldout", 10, 0.5, 0.0, 0.125, 3.0)


def _episode(req, actions: list[str], success: bool, invalid: int = 0, failure: str | None = None) -> Trajectory:
    turns = tuple(Turn("obs", a, 0.0, i < invalid, "") for i, a in enumerate(actions))
    return Trajectory(trajectory_id=req.trajectory_id, task=req.task, group_id=req.group_id, env_seed=req.env_seed,
                      turns=turns, samples=(), episode_return=float(success), success=success, terminated=True,
                      truncated=False, truncation_reason=None, policy_version=0, infra_failure=failure)


class ScriptedEngine:
    """An engine whose episodes are scripted per (task, sample): ``script[i][j]`` = (actions, success, invalid, failure)."""

    def __init__(self, script, action_names=()) -> None:
        self.script, self.requests = script, []
        self.env = SimpleNamespace(env_id="scripted", action_names=action_names, task=lambda split, i: Task("scripted", split, i))
        self.cfg = RolloutConfig(max_new_tokens=4)

    def play(self, requests, actor, on_progress=None, keep_snapshots=False):
        self.requests = list(requests)
        n = len(self.script[0])
        out = [_episode(r, *self.script[k // n][k % n]) for k, r in enumerate(requests)]
        return out, None


POLICY = SimpleNamespace(kv_cache_gib=None, prefix_cache=False, version=7, sampler=None)


def test_scripted_episodes_give_hand_computed_figures():
    ok, fail = (["up", "left"], True, 0, None), (["up", "up", "up"], False, 1, None)
    script = [
        # task 0: 2 successes of 8 with one distinct sequence (" up" strips to "up"); 1 invalid turn in each failure
        [ok, (["up ", " left"], True, 0, None)] + [fail] * 6,
        # task 1: never solved
        [fail] * 8,
        # task 2: 3 successes, 2 distinct sequences; one sample lost to the infrastructure (n = 7)
        [ok, ok, (["down"], True, 0, None), (["x"], False, 0, "env step() raised")] + [fail] * 4,
    ]
    engine = ScriptedEngine(script)
    p = PassAtKPlan("heldout", 3, 8, (1, 2, 8), 0.7, 5)
    r = measure_boundary(engine, POLICY, p, tag="start", evaluation=EVAL, eval_temperature=1.0)

    # requests: 8 per task, task-major, each with its own env seed
    assert [q.task.index for q in engine.requests] == [i for i in range(3) for _ in range(8)]
    assert len({q.env_seed for q in engine.requests}) == 24 and len({q.trajectory_id for q in engine.requests}) == 24
    # pass@1: mean(2/8, 0, 3/7); pass@2: 1 - C(n-c,2)/C(n,2) per task; pass@8: task 2 has 7 samples, left out
    p2 = [1 - math.comb(6, 2) / math.comb(8, 2), 0.0, 1 - math.comb(4, 2) / math.comb(7, 2)]
    assert [(x.k, x.tasks) for x in r.pass_at_k] == [(1, 3), (2, 3), (8, 2)]
    assert r.at(1) == pytest.approx((2 / 8 + 0 + 3 / 7) / 3)
    assert r.at(2) == pytest.approx(sum(p2) / 3)
    assert r.at(8) == pytest.approx((1.0 + 0.0) / 2) and r.never_solved_at_8 == pytest.approx(0.5)
    assert r.never_solved_at_64 is None and r.solved_tasks == 2
    assert r.distinct_successes == pytest.approx((1 + 2) / 2)
    # malformed: failures have 1 invalid of 3 turns; 6 + 8 + 4 failures, successes 2 turns (task 2's "down": 1)
    turns = 18 * 3 + 2 * 2 + 2 * 2 + 1
    assert r.malformed_rate == pytest.approx(18 / turns) and r.eval_malformed_rate == 0.125
    assert r.episodes == 23 and r.infra_failures == 1 and r.turns == turns + 1
    assert r.temperature == 0.7 and r.samples_per_task == 8 and r.tasks == 3 and r.policy_version == 7
    assert r.entropy is None and r.action_mi is None and r.action_mi_max is None  # no samples, open-text env


def test_too_many_infrastructure_failures_stop_the_measurement():
    bad = (["x"], False, 0, "env crashed")
    engine = ScriptedEngine([[bad, bad, (["up"], True, 0, None), bad]])
    with pytest.raises(RunStopped, match="pass@k after"):
        measure_boundary(engine, POLICY, PassAtKPlan("heldout", 1, 4, (1,), 1.0, 0), tag="after", evaluation=EVAL,
                         eval_temperature=1.0, max_failure_share=0.5)


def test_the_plan_comes_from_the_config():
    cfg = load_config("sokoban-tiny", ["eval.episodes=40"])
    p = plan(cfg)
    assert p is not None and (p.tasks, p.samples, p.ks, p.temperature) == (40, 16, (1, 2, 4, 8, 16), cfg.rollout.temperature)
    p = plan(load_config("sokoban-tiny", ["eval.pass_at_k_samples=12", "eval.pass_at_k_temperature=0.5"]))
    assert (p.tasks, p.ks, p.temperature) == (100, (1, 2, 4, 8, 12), 0.5)
    assert plan(load_config("sokoban-tiny", ["eval.pass_at_k_samples=0"])) is None


def test_first_action_probs_match_a_direct_forward_pass(tiny_policy):
    chat = tiny_policy.chat
    prompts = [tuple(chat.encode("the box wall floor")), tuple(chat.encode("target # _ . $ @ up down left"))]
    names = ("up", "down", "left", "right")
    got = first_action_probs(tiny_policy, prompts, names, batch_size=3)  # batches cut across prompts
    assert got.shape == (2, 4) and np.allclose(got.sum(axis=1), 1.0)
    for i, prompt in enumerate(prompts):
        scores = []
        for name in names:
            action = list(chat.encode(name)) + [tiny_policy.stop_ids[0]]
            ids = torch.tensor([list(prompt) + action])
            with torch.no_grad():
                logp = torch.log_softmax(tiny_policy.model(input_ids=ids).logits[0].double(), dim=-1)
            scores.append(sum(float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(action)))
        want = np.exp(np.array(scores) - max(scores))
        np.testing.assert_allclose(got[i], want / want.sum(), rtol=1e-4)


def test_the_measurement_repeats_and_leaves_the_evaluations_around_it_unchanged(tiny_policy):
    cfg = RolloutConfig(max_turns=4, max_new_tokens=4, include_instructions=False)
    engine = inline_engine(tiny_policy, "sokoban", cfg, 8, dim=6, num_boxes=1)
    p = PassAtKPlan("heldout", 3, 4, (1, 2, 4), 1.0, 0)

    def ev():
        result, trajs = evaluate(engine, tiny_policy, episodes=4, temperature=1.0, seed=0)
        return result, [[t.action_text for t in x.turns] for x in trajs]

    first = ev()
    a = measure_boundary(engine, tiny_policy, p, tag="start", evaluation=first[0], eval_temperature=1.0)
    assert ev() == first  # the measurement consumed nothing the evaluation draws from
    b = measure_boundary(engine, tiny_policy, p, tag="start", evaluation=first[0], eval_temperature=1.0)
    assert dataclasses.replace(a, seconds=0.0) == dataclasses.replace(b, seconds=0.0)
    assert a.episodes == 12 and a.entropy is not None and a.entropy > 0
    assert a.action_mi is not None and 0.0 <= a.action_mi <= a.action_mi_max == pytest.approx(math.log(4))
    # the plan's temperature is the one sampled at: other samples, so another entropy on their tokens
    c = measure_boundary(engine, tiny_policy, dataclasses.replace(p, temperature=3.0), tag="start", evaluation=first[0],
                         eval_temperature=1.0)
    assert c.temperature == 3.0 and c.entropy != a.entropy
    # eval.pass_at_k_entropy_samples: the entropy on fewer of the same samples, everything else unchanged
    d = measure_boundary(engine, tiny_policy, dataclasses.replace(p, entropy_samples=2), tag="start", evaluation=first[0],
                         eval_temperature=1.0)
    assert d.entropy is not None and d.entropy != a.entropy
    assert dataclasses.replace(d, seconds=0.0, entropy=a.entropy) == dataclasses.replace(a, seconds=0.0)


def test_open_text_envs_have_no_action_mi(tiny_policy):
    engine = inline_engine(tiny_policy, "test-echo", RolloutConfig(max_turns=3, max_new_tokens=4), 4)
    r = measure_boundary(engine, tiny_policy, PassAtKPlan("train", 2, 2, (1, 2), 1.0, 0), tag="eval", evaluation=EVAL,
                         eval_temperature=0.0)
    assert r.action_mi is None and r.action_mi_max is None and r.episodes == 4 and r.entropy is not None
