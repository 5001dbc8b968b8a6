"""How much can any policy solve on slippery FrozenLake within the turn budget? Exact success
probabilities by dynamic programming on each held-out lake, and the env's expert played.

    python benchmarks/slippery_ceiling.py [--episodes 500] [--max-turns 15] [--size 4]

For the first ``episodes`` held-out lakes of ``frozenlake`` (``is_slippery=true``), the chance of
reaching the goal within ``max_turns`` turns from the start:

- ``finite-horizon optimum``: the best time-dependent policy (it knows how many turns are left);
- ``stationary VI, gamma=g``: the env's value-iteration policy for discount g (the env's expert
  uses g = 0.999), a map from (lake, cell) to a move: what a memoryless policy (the recipe's
  ``history_window=0``, no turn counter in the observation) can at best follow;
- ``expert, played``: the expert (noise 0) played by the rollout engine on the evaluation's own
  tasks and env seeds, as ``turnforge.train.evaluate`` plays a policy: one draw of the dice.

The first two are expectations over the dice; the held-out evaluation of a run is one draw
(500 episodes: about 2 points of standard error).
"""

from __future__ import annotations

import argparse

import numpy as np

from turnforge.app.config import load_config
from turnforge.envs.frozenlake import PERPENDICULAR, FrozenLakeEnv, FrozenLakeLevel
from turnforge.rollout.actors import ExpertActor
from turnforge.rollout.engine import EpisodeRequest, make_engine
from turnforge.train.evaluate import summarize


def _model(level: FrozenLakeLevel) -> tuple[dict, np.ndarray, np.ndarray, int]:
    cells = [(r, c) for r in range(level.size) for c in range(level.size)]
    index = {p: i for i, p in enumerate(cells)}
    nxt = np.array([[[index[level.move(p, b)] for b in (a, *PERPENDICULAR[a])] for a in range(4)] for p in cells])  # [S, A, 3]
    live = np.array([p not in level.holes and p != level.goal for p in cells])  # [S]
    return index, nxt, live, index[level.goal]


def finite_horizon_optimum(level: FrozenLakeLevel, turns: int) -> float:
    index, nxt, live, goal = _model(level)
    v = (np.arange(len(live)) == goal).astype(float)  # [S] success within 0 turns
    for _ in range(turns):
        v = np.where(live, v[nxt].mean(axis=2).max(axis=1), v)
    return float(v[index[level.start]])


def stationary_vi(level: FrozenLakeLevel, gamma: float, turns: int) -> float:
    """Success within ``turns`` of the value-iteration policy for discount ``gamma``."""
    index, nxt, live, goal = _model(level)
    value = (np.arange(len(live)) == goal).astype(float)
    for _ in range(100_000):
        new = np.where(live, gamma * value[nxt].mean(axis=2).max(axis=1), value)
        done = np.abs(new - value).max() < 1e-12
        value = new
        if done:
            break
    policy = value[nxt].mean(axis=2).argmax(axis=1)  # [S] first best move on ties, as the env's expert
    v = (np.arange(len(live)) == goal).astype(float)
    rows = np.arange(len(live))
    for _ in range(turns):
        v = np.where(live, v[nxt[rows, policy]].mean(axis=1), v)
    return float(v[index[level.start]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--max-turns", type=int, default=15)
    ap.add_argument("--size", type=int, default=4)
    args = ap.parse_args()
    env = FrozenLakeEnv(size=args.size, is_slippery=True)
    levels = [env.level_for(env.task("heldout", i)) for i in range(args.episodes)]
    print(f"{args.episodes} held-out lakes ({args.size}x{args.size}, slippery), success within {args.max_turns} turns:")
    print(f"  finite-horizon optimum      {np.mean([finite_horizon_optimum(x, args.max_turns) for x in levels]):.3f}")
    for gamma in (0.999, 0.95, 0.9, 0.8):
        print(f"  stationary VI, gamma={gamma:<5}  {np.mean([stationary_vi(x, gamma, args.max_turns) for x in levels]):.3f}")
    cfg = load_config("frozenlake-tiny", ["env.kwargs.is_slippery=true", f"env.kwargs.size={args.size}",
                                          f"rollout.max_turns={args.max_turns}"])
    eng = make_engine(cfg, None, num_envs=64)
    try:
        requests = [EpisodeRequest(eng.env.task("heldout", i), i, f"eval-{i}", f"eval-heldout-{i}") for i in range(args.episodes)]
        trajs, _ = eng.play(requests, ExpertActor(0.0, 0, eng.env.action_names), tokens=False)
    finally:
        eng.close()
    print(f"  expert, played (evaluation's tasks and env seeds)  {summarize(eng.env.env_id, 'heldout', trajs).success_rate:.3f}")


if __name__ == "__main__":
    main()
