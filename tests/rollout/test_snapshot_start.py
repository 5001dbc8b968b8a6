"""Rollout hooks: episodes started from env snapshots, per-turn snapshots, shaping potentials."""

from __future__ import annotations

import pyarrow.parquet as pq

from helpers import inline_engine
from turnforge.config import RolloutConfig
from turnforge.data.store import write_trajectories
from turnforge.envs import make_batch
from turnforge.envs.base import parse_choice
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest

CFG = RolloutConfig(max_turns=12, max_new_tokens=4, max_context_tokens=256, include_instructions=False)


class CounterEnv(LevelEnv[int]):
    """Count up from 0: 'up' adds 1, 'down' subtracts 1; reaching ``goal`` ends the episode
    with reward 1. The shaping potential is the count itself."""

    action_names = ("up", "down")
    instructions = "Count up."
    valid_actions_text = "up, down"

    def __init__(self, *, goal: int = 3, invalid_action_penalty: float = -0.1, max_steps: int = 100) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        self.goal = goal

    def generate_level(self, level_seed):
        return 0

    def level_key(self, level):
        return str(level)

    def initial_state(self, level, rng):
        return level

    def render(self):
        return f"count {self.state}"

    def parse_action(self, text):
        return parse_choice(text, self.action_names)

    def apply(self, action):
        self.state += 1 if action == 0 else -1
        done = self.state == self.goal
        return Outcome(1.0 if done else 0.0, terminated=done, success=done)

    def potential(self):
        return float(self.state)

    def expert_action(self):
        return "up"


def _play(policy, envs, requests, cfg=CFG, keep_snapshots=False):
    return inline_engine(policy, envs, cfg).play(requests, ExpertActor(), keep_snapshots=keep_snapshots)


def _requests(envs, n, **kwargs):
    return [EpisodeRequest(envs[0].task("train", i), i, f"g{i}", f"t{i}", **kwargs) for i in range(n)]


def test_expert_from_a_mid_episode_snapshot_finishes_like_the_original(tiny_policy):
    n = 4
    envs = make_batch("sokoban", n)
    originals, _ = _play(tiny_policy, envs, _requests(envs, n), keep_snapshots=True)
    assert all(t.success for t in originals) and max(t.num_turns for t in originals) >= 3
    finals = [(env.render(), env.steps) for env in envs]
    mids = [t.num_turns // 2 for t in originals]

    again = make_batch("sokoban", n)
    requests = [
        EpisodeRequest(t.task, t.env_seed, t.group_id, f"{t.trajectory_id}-resumed", start=t.snapshots[k])
        for t, k in zip(originals, mids)
    ]
    resumed, stats = _play(tiny_policy, again, requests)
    assert stats.infra_failures == 0
    for t, r, k, env, final in zip(originals, resumed, mids, again, finals):
        assert r.turns[0].observation == t.turns[k].observation  # the first observation is the restored state
        assert [x.action_text for x in r.turns] == [x.action_text for x in t.turns[k:]]
        assert r.episode_return == sum(x.reward for x in t.turns[k:])
        assert r.success and r.terminated
        assert (env.render(), env.steps) == final  # same final state, step counter restored too


def test_keep_snapshots_records_one_snapshot_per_turn_and_defaults_to_none(tiny_policy):
    envs = make_batch("sokoban", 3)
    trajs, _ = _play(tiny_policy, envs, _requests(envs, 3), keep_snapshots=True)
    probe = make_batch("sokoban", 1)[0]
    for t in trajs:
        assert len(t.snapshots) == t.num_turns > 0
        for turn, snap in zip(t.turns, t.snapshots):
            probe.restore(snap)
            assert probe.render() == turn.observation  # taken before the turn's action
    plain, _ = _play(tiny_policy, envs, _requests(envs, 3))
    assert all(t.snapshots == () for t in plain)


def test_trajectories_with_snapshots_still_write_to_the_store(tiny_policy, tmp_path):
    envs = make_batch("sokoban", 2)
    trajs, _ = _play(tiny_policy, envs, _requests(envs, 2), keep_snapshots=True)
    rows = write_trajectories(tmp_path / "t.parquet", trajs, stage="rl", iteration=0)
    table = pq.read_table(tmp_path / "t.parquet")
    assert rows == table.num_rows == sum(len(t.samples) for t in trajs)
    assert "snapshots" not in table.column_names


def test_potentials_are_recorded_and_zero_after_termination(tiny_policy):
    env = CounterEnv(goal=3)
    (traj,), _ = _play(tiny_policy, [env], _requests([env], 1))
    assert [t.potential for t in traj.turns] == [0.0, 1.0, 2.0]
    assert [t.next_potential for t in traj.turns] == [1.0, 2.0, 0.0]  # the terminal state has Phi = 0
    assert traj.terminated

    cut = RolloutConfig(max_turns=2, max_new_tokens=4, max_context_tokens=256, include_instructions=False)
    (traj,), _ = _play(tiny_policy, [CounterEnv(goal=3)], _requests([env], 1), cfg=cut)
    assert traj.truncation_reason == "max_turns"
    assert traj.turns[-1].next_potential == 2.0  # truncated, not terminal: Phi(s') is kept


def test_per_request_turn_budget(tiny_policy):
    envs = [CounterEnv(goal=5), CounterEnv(goal=5)]
    requests = [EpisodeRequest(envs[0].task("train", i), i, "g", f"t{i}", max_turns=b) for i, b in enumerate((2, None))]
    (short, full), _ = _play(tiny_policy, envs, requests)
    assert (short.num_turns, short.truncation_reason) == (2, "max_turns")
    assert (full.num_turns, full.success) == (5, True)


def test_a_bad_start_snapshot_is_an_infra_failure_of_that_episode_only(tiny_policy):
    counter = CounterEnv(goal=1)
    counter.reset(seed=0)
    counter.step("up")
    finished = counter.snapshot()  # of a finished episode, and of another env id than sokoban
    envs = make_batch("sokoban", 2)
    envs[0].reset(seed=0)
    start = envs[0].snapshot()
    requests = [
        EpisodeRequest(envs[0].task("train", 0), 0, "g", "foreign", start=finished),  # restore() raises
        EpisodeRequest(envs[0].task("train", 0), 0, "g", "ok", start=start),
    ]
    (bad, ok), stats = _play(tiny_policy, envs, requests)
    assert "restore()" in bad.infra_failure and bad.turns == ()
    assert ok.infra_failure is None and ok.success
    assert stats.infra_failures == 1

    request = EpisodeRequest(counter.task("train", 0), 0, "g", "d", start=finished)
    (done,), _ = _play(tiny_policy, [CounterEnv(goal=1)], [request])
    assert "finished episode" in done.infra_failure
