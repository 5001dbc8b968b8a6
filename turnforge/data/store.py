"""Trajectory store: Parquet files with one row per training sample.

One row per *sample* (the trainer's unit): with the ``window`` context a trajectory
has one sample per turn, with ``full_history`` exactly one. Episode-level columns
(``reward``, ``success``, ``num_turns``, ...) repeat on each row of a trajectory;
``turn_index`` is -1 for whole-episode samples. ``logprobs`` is null where no policy
sampled the token (context tokens, expert demonstrations).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from turnforge.types import Trajectory

SCHEMA = pa.schema(
    [
        ("stage", pa.string()),
        ("iteration", pa.int32()),
        ("trajectory_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("env_seed", pa.int64()),
        ("turn_index", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("versions", pa.list_(pa.int32())),
        ("action_text", pa.string()),
        ("turn_reward", pa.float32()),
        ("reward", pa.float32()),
        ("advantage", pa.float32()),
        ("turn_advantages", pa.list_(pa.float32())),
        ("success", pa.bool_()),
        ("num_turns", pa.int32()),
        ("policy_version", pa.int32()),
        ("truncation_reason", pa.string()),
        ("infra_failure", pa.string()),
    ]
)


def write_trajectories(
    path: str | Path,
    trajectories: Sequence[Trajectory],
    *,
    stage: str,
    iteration: int,
    advantages: dict[str, Sequence[float]] | None = None,
) -> int:
    """Write the samples of ``trajectories`` to ``path`` (Parquet); returns the row count.

    ``advantages`` maps a trajectory id to the advantage of each of its turns: the row's
    ``advantage`` is its turn's value (null for a whole-episode sample whose turns differ),
    ``turn_advantages`` the whole list."""
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    for traj in trajectories:
        for s in traj.samples:
            turn = traj.turns[s.turn_index] if 0 <= s.turn_index < len(traj.turns) else None
            lp = s.logprobs.astype(np.float64)
            rows["stage"].append(stage)
            rows["iteration"].append(iteration)
            rows["trajectory_id"].append(traj.trajectory_id)
            rows["task_id"].append(traj.task.task_id)
            rows["group_id"].append(traj.group_id)
            rows["env_seed"].append(traj.env_seed)
            rows["turn_index"].append(s.turn_index)
            rows["token_ids"].append(s.token_ids.tolist())
            rows["logprobs"].append([None if np.isnan(x) else float(x) for x in lp])
            rows["loss_mask"].append(s.loss_mask.tolist())
            rows["versions"].append(s.versions.tolist())
            rows["action_text"].append(turn.action_text if turn else None)
            rows["turn_reward"].append(turn.reward if turn else None)
            rows["reward"].append(traj.episode_return)
            per_turn = None if advantages is None else advantages.get(traj.trajectory_id)
            rows["advantage"].append(_sample_advantage(per_turn, s.turn_index))
            rows["turn_advantages"].append(None if per_turn is None else [float(a) for a in per_turn])
            rows["success"].append(traj.success)
            rows["num_turns"].append(traj.num_turns)
            rows["policy_version"].append(traj.policy_version)
            rows["truncation_reason"].append(traj.truncation_reason)
            rows["infra_failure"].append(traj.infra_failure)
    table = pa.table(rows, schema=SCHEMA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return table.num_rows


def _sample_advantage(per_turn: Sequence[float] | None, turn_index: int) -> float | None:
    if per_turn is None or len(per_turn) == 0:
        return None
    if turn_index >= 0:
        return float(per_turn[turn_index])
    return float(per_turn[0]) if len(set(np.asarray(per_turn).tolist())) == 1 else None


def read_trajectories(path: str | Path) -> pa.Table:
    """Read a trajectory file (or a directory of them) as one Arrow table."""
    return pq.read_table(path, schema=SCHEMA)
