"""What would advantage-weighted regression reach with a perfect critic? A diagnostic run of the
flywheel's group_awr path on slippery FrozenLake whose advantages are exact instead of estimated.

    python benchmarks/awr_oracle.py SEED OUT_DIR [key=value ...]

Each turn of the round's own episodes is weighted by ``exp(A*(s, a) / beta)`` with
``A*(s, a) = Q*_h(s, a) - V*_h(s)``, the finite-horizon optimum's advantage on the turn's lake
with h = the turns the episode had left (dynamic programming on the known map; an invalid
action: its penalty plus ``V*_{h-1}(s) - V*_h(s)``). Everything else is the flywheel's
(``turnforge.train.awr``): the same collection, budget, weighted fine-tuning and evaluations.
It tells apart the two ways mc_awr can fall short: the estimates' noise (a perfect critic does
better) and what weighted regression on the policy's own samples can reach at this budget (it
does not either). The defaults are those of the group_awr runs in docs/results.md, with 2
rollouts per task; ``flywheel.awr_beta`` is a key=value (A* is about 0.03 on average).
"""

from __future__ import annotations

import sys

import numpy as np

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.envs.base import InvalidAction, parse_choice
from turnforge.envs.frozenlake import ACTIONS, PERPENDICULAR, FrozenLakeLevel
from turnforge.train import awr

_TABLES: dict[tuple, tuple] = {}


def optimal_values(level: FrozenLakeLevel, turns: int) -> tuple[dict, list, list]:
    """``(cell index, q, v)``: ``q[h]`` [S, 4] the optimum's success within h turns after taking a
    move (h >= 1), ``v[h]`` [S] its value; terminal cells keep their value (goal 1, hole 0)."""
    key = (level.size, level.holes, turns)
    if key not in _TABLES:
        cells = [(r, c) for r in range(level.size) for c in range(level.size)]
        index = {p: i for i, p in enumerate(cells)}
        nxt = np.array([[[index[level.move(p, b)] for b in (a, *PERPENDICULAR[a])] for a in range(4)] for p in cells])
        live = np.array([p not in level.holes and p != level.goal for p in cells])
        v = [(np.arange(len(cells)) == index[level.goal]).astype(float)]
        q: list = [None]
        for h in range(1, turns + 1):
            q.append(v[h - 1][nxt].mean(axis=2))
            v.append(np.where(live, q[h].max(axis=1), v[0]))
        _TABLES[key] = (index, q, v)
    return _TABLES[key]


def exact_advantages(self: awr.AWRRound) -> None:
    """Replaces ``AWRRound._group_advantages``: every turn, with its exact A*."""
    turns, penalty = self.s.cfg.rollout.max_turns, float(self.s.rollout_engine.env.invalid_action_penalty)
    for t in self.episodes:
        by_turn = {x.turn_index: x for x in t.samples}
        for k, turn in enumerate(t.turns):
            if k not in by_turn:
                continue
            rows = [x for x in turn.observation.strip().split("\n") if x and set(x) <= set("P_OG")]
            level = FrozenLakeLevel.from_text("\n".join(rows[-len(rows[-1]):]))  # the map: the last size rows
            index, q, v = optimal_values(level, turns)
            h, i = turns - k, index[level.start]
            try:
                a = q[h][i, parse_choice(turn.action_text, ACTIONS)] - v[h][i]
            except InvalidAction:
                a = penalty + v[h - 1][i] - v[h][i]
            self.samples.append(by_turn[k])
            self.advantages.append(float(a))
    self.states = len(self.samples)


def main() -> None:
    seed, out, *overrides = sys.argv[1:]
    awr.AWRRound._group_advantages = exact_advantages
    cfg = load_config("frozenlake-tiny", [
        "env.kwargs.is_slippery=true", "eval.episodes=500", f"seed={seed}", "rl.iterations=0", "flywheel.rounds=4",
        "flywheel.env_steps_per_round=10000", "flywheel.allocation=uniform", "flywheel.group_size=2",
        "flywheel.temperature=1.0", "flywheel.mechanisms=[]", "flywheel.weighting=group_awr", "flywheel.tasks_per_wave=16",
        "flywheel.rft_epochs=3", "flywheel.eval_episodes=200", *overrides])
    train(cfg, out, live=False)


if __name__ == "__main__":
    main()
