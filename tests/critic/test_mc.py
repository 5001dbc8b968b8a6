"""The Monte-Carlo critic against the exact values of a gambler's-ruin random walk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnforge.algos.advantages import blend
from turnforge.config import EngineConfig, RolloutConfig
from turnforge.critic.mc import mc_q_values, mc_values
from turnforge.envpool import InlineEnvs, make_backend
from turnforge.envs import make, register
from turnforge.envs.base import parse_choice
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.errors import UserError
from turnforge.rollout.actors import ExpertActor, PolicyActor, RandomActor
from turnforge.rollout.engine import RolloutEngine

N = 6  # positions 0..N; 0 and N end the episode
STATES = list(range(1, N))


class WalkEnv(LevelEnv[int]):
    """1-D random walk on 0..N: 'left'/'right' move one cell; reaching N pays 1 and ends the
    episode (success), reaching 0 ends it with 0. The level (start cell) is the task index.
    With ``crash_at`` set, step() raises on entering that cell (an infrastructure failure)."""

    action_names = ("left", "right")
    instructions = "Walk right."
    valid_actions_text = "left, right"

    def __init__(self, *, n: int = N, crash_at: int | None = None, invalid_action_penalty: float = -0.1,
                 max_steps: int = 10_000) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        self.n, self.crash_at = n, crash_at

    def level_for(self, task):
        return task.index

    def generate_level(self, level_seed):  # unused: level_for is overridden
        return 1

    def level_key(self, level):
        return str(level)

    def initial_state(self, level, rng):
        return level

    def render(self):
        return "".join("P" if i == self.state else "_" for i in range(self.n + 1))

    def parse_action(self, text):
        return parse_choice(text, self.action_names)

    def apply(self, action):
        self.state += 1 if action == 1 else -1
        if self.state == self.crash_at:
            raise RuntimeError("simulated crash")
        if self.state == self.n:
            return Outcome(1.0, terminated=True, success=True)
        return Outcome(0.0, terminated=self.state == 0)

    def expert_action(self):
        return "right"


class OpenTextWalk(WalkEnv):
    action_names = ()


register("test-walk", WalkEnv, overwrite=True)
register("test-walk-open", OpenTextWalk, overwrite=True)


CFG = RolloutConfig(max_turns=20, max_new_tokens=4, max_context_tokens=128, include_instructions=False)
RANDOM = RandomActor(0, WalkEnv.action_names)


def snapshots_at(positions, env_id="test-walk"):
    env = make(env_id)
    out = []
    for s in positions:
        env.reset(seed=0, task=env.task("train", s))
        out.append(env.snapshot())
    return out


def tasks_at(positions):
    env = make("test-walk")
    return [env.task("train", s) for s in positions]


def engine(n=64, policy=None, cfg=CFG, env_id="test-walk", backend=None, **kwargs):
    return RolloutEngine(backend or InlineEnvs(env_id, n, kwargs), cfg, policy, make(env_id, **kwargs))


def values(positions, actor=RANDOM, eng=None, **kw):
    return mc_values(eng or engine(), snapshots_at(positions), tasks_at(positions), actor, **kw)


def true_values(gamma: float) -> np.ndarray:
    """V(s), s = 1..N-1, of the uniform random policy: V = 0.5 (r_right + g V(s+1)) + 0.5 g V(s-1),
    V(0) = V(N) = 0, solved as a linear system."""
    a, b = np.eye(N - 1), np.zeros(N - 1)
    for i, s in enumerate(STATES):
        for nxt in (s - 1, s + 1):
            if 0 < nxt < N:
                a[i, nxt - 1] -= 0.5 * gamma
        b[i] = 0.5 * (s + 1 == N)
    return np.linalg.solve(a, b)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_random_policy_values_match_the_exact_ones(gamma):
    est = values(STATES, eng=engine(256), rollouts=2000, gamma=gamma, max_turns=500, seed=0)
    exact = true_values(gamma)
    if gamma == 1.0:
        np.testing.assert_allclose(exact, np.array(STATES) / N)
    assert est.values.shape == est.stderr.shape == (N - 1,)
    assert (np.abs(est.values - exact) < 4 * est.stderr).all(), (est.values, exact, est.stderr)
    assert est.env_steps > 2000 * (N - 1)


def test_backends_and_seeds():
    """The same estimates on in-process envs and on worker processes; the seeds decide them."""
    positions = STATES * 3
    kw = dict(rollouts=20, gamma=0.95, max_turns=[15, 10, 5] * (N - 1), seed=7)
    one = values(positions, **kw)
    pool = make_backend("test-walk", {}, 64, EngineConfig(env_workers=2))
    try:
        two = values(positions, eng=engine(backend=pool), **kw)
    finally:
        pool.close()
    np.testing.assert_array_equal(one.values, two.values)
    np.testing.assert_array_equal(one.stderr, two.stderr)
    assert one.env_steps == two.env_steps
    again = values(positions, **kw)
    np.testing.assert_array_equal(one.values, again.values)
    other = values(positions, RandomActor(8, WalkEnv.action_names), **kw)  # the walk's randomness is the actor's
    assert not np.array_equal(one.values, other.values)


def test_turn_budget_bounds_each_rollout():
    est = values([1, N - 1, N - 1], rollouts=50, gamma=1.0, max_turns=[N - 2, 0, 1], seed=0)
    assert est.values[0] == 0.0  # N - 1 steps are needed to reach N from 1
    assert est.values[1] == 0.0  # no turns left
    assert 0.0 < est.values[2] < 1.0  # one step: right wins (p = 1/2)
    assert est.env_steps <= 50 * (N - 2) + 50


def test_stderr_shrinks_with_more_rollouts():
    few = values(STATES, rollouts=50, gamma=1.0, max_turns=500, seed=1)
    many = values(STATES, eng=engine(256), rollouts=800, gamma=1.0, max_turns=500, seed=1)
    assert (many.stderr < few.stderr / 2).all()  # ~ 1/sqrt(M): 4x smaller expected


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_q_values_of_the_two_moves(gamma):
    v = np.concatenate([[0.0], true_values(gamma), [0.0]])  # V(0..N)
    for s in (1, 3, N - 1):
        (snap,) = snapshots_at([s])
        est = mc_q_values(engine(256), snap, tasks_at([s])[0], ["left", "right"], RANDOM, rollouts=2000, gamma=gamma,
                          max_turns=500, seed=s)
        exact = np.array([gamma * v[s - 1], float(s + 1 == N) + gamma * v[s + 1]])
        assert (np.abs(est.values - exact) <= 4 * est.stderr + 1e-12).all(), (s, est.values, exact)
        diff_se = np.sqrt((est.stderr**2).sum())
        assert abs((est.values[1] - est.values[0]) - (exact[1] - exact[0])) <= 4 * diff_se + 1e-12
    if gamma == 1.0:
        assert exact[1] - exact[0] == pytest.approx(2 / N)
    assert est.values[1] == 1.0 and est.stderr[1] == 0.0  # right from N-1 always wins at once


def test_q_values_with_a_one_turn_budget_are_the_immediate_rewards():
    (snap,) = snapshots_at([N - 1])
    est = mc_q_values(engine(), snap, tasks_at([N - 1])[0], ["left", "right", "jump"], RANDOM, rollouts=3, gamma=0.9,
                      max_turns=1, seed=0)
    np.testing.assert_allclose(est.values, [0.0, 1.0, -0.1])
    assert est.env_steps == 9


def test_an_env_without_random_actions_is_refused():
    eng = engine(env_id="test-walk-open")
    with pytest.raises(UserError, match="'test-walk-open' to implement action_names or random_action"):
        mc_values(eng, snapshots_at([2], "test-walk-open"), tasks_at([2]), RandomActor(0), rollouts=2, gamma=1.0,
                  max_turns=5, seed=0)
    with pytest.raises(ValueError, match="max_turns has 2 budgets for 1 snapshots"):
        values([2], rollouts=2, gamma=1.0, max_turns=[3, 3], seed=0)


def test_blend():
    np.testing.assert_allclose(blend(np.array([1.0, 2.0]), np.array([3.0, 6.0]), 0.25), [1.5, 3.0])
    out = blend(torch.tensor([0.0, 4.0]), torch.tensor([1.0, 0.0]), 1.0)
    assert isinstance(out, torch.Tensor) and out.tolist() == [1.0, 0.0]
    assert blend(torch.tensor([2.0]), torch.tensor([5.0]), 0.0).item() == 2.0
    for w in (-0.1, 1.5):
        with pytest.raises(ValueError, match="w must be in"):
            blend(np.zeros(1), np.zeros(1), w)


def test_policy_values_of_an_expert_that_always_goes_right(tiny_policy):
    gamma = 0.9
    positions = [1, 3, N - 1, 2]
    budgets = [20, 20, 20, N - 2 - 1]  # the last one runs out one turn short of the goal
    eng = engine(3, tiny_policy)  # fewer than N * M episodes: played in waves
    est = values(positions, ExpertActor(), eng, rollouts=2, gamma=gamma, max_turns=budgets, seed=0)
    np.testing.assert_allclose(est.values, [gamma ** (N - s - 1) for s in positions[:3]] + [0.0])
    np.testing.assert_array_equal(est.stderr, np.zeros(4))
    assert est.env_steps == 2 * ((N - 1) + (N - 3) + 1 + (N - 3))
    assert est.failed == 0


def test_policy_values_exclude_infra_failures(tiny_policy):
    eng = engine(4, tiny_policy, crash_at=4)
    est = values([1, 4], ExpertActor(), eng, rollouts=2, gamma=1.0, max_turns=20, seed=0)
    assert np.isnan(est.values[0]) and est.failed == 2  # every episode from 1 crashes on entering 4
    assert est.values[1] == 1.0


def test_policy_values_under_the_sampling_policy_are_finite(tiny_policy):
    actor = PolicyActor(tiny_policy, max_new_tokens=4, temperature=1.0, generator=torch.Generator().manual_seed(0))
    cfg = RolloutConfig(max_turns=3, max_new_tokens=4, max_context_tokens=128, include_instructions=False)
    est = values([2, 3], actor, engine(4, tiny_policy, cfg), rollouts=2, gamma=0.9, max_turns=3, seed=0)
    assert est.values.shape == (2,) and np.isfinite(est.values).all()
    assert 2 * 2 <= est.env_steps <= 2 * 2 * 3


def test_starts_sharing_a_noise_key_see_the_same_env_draws():
    """Slippery ice: Q(s, the expert's move) equals V(s) under the expert restart by restart when
    the two starts share a noise key (common random numbers), and not when each has its own."""
    from turnforge.critic.mc import MCStart, estimate

    kwargs = {"size": 4, "is_slippery": True}
    env = make("frozenlake", **kwargs)
    starts, pairs = [], []
    for i in range(6):
        task = env.task("train", i)
        env.reset(seed=i, task=task)
        snap, move = env.snapshot(), env.expert_action()
        pairs.append(len(starts))
        starts += [MCStart(task, snap, 15, noise_key=i), MCStart(task, snap, 15, (move,), noise_key=i),
                   MCStart(task, snap, 15, (move,))]
    eng = RolloutEngine(InlineEnvs("frozenlake", 64, kwargs), CFG, None, make("frozenlake", **kwargs))
    est = estimate(eng, starts, ExpertActor(), rollouts=16, gamma=1.0, seed=3, prefix="crn")
    v, q_shared, q_own = (est.values[[j + d for j in pairs]] for d in range(3))
    np.testing.assert_array_equal(v, q_shared)
    assert (q_own != v).any()  # its own draws: another 16 futures
    assert np.mean(v) > 0  # the expert reaches the goal on some of them
