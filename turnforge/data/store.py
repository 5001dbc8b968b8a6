"""Trajectory store: Parquet files with one row per training sample, and every episode in them.

One row per *sample* (the trainer's unit): with the ``window`` context a trajectory
has one sample per turn, with ``full_history`` exactly one, with ``summarize`` one per
segment (``segment_index`` 0, 1, ..., ``parent_segment`` the one it continues, -1 for the
first; ``first_turn`` the turn of its first action; its last ``summary_tokens`` tokens are the
summary that ended it, 0 for the last segment; ``token_ids[memory_start : memory_start +
memory_tokens]`` is the episodic-memory block in its prompt, 0 tokens without memory;
``image_sha256`` names the images of a vision policy's sample, in the order of their blocks, each
stored once as ``images/<sha256>.png`` beside the file). Episode-level columns
(``reward``, ``success``, ``num_turns``, ...) repeat on each row of a trajectory;
``turn_index`` is -1 for samples of several turns. ``logprobs`` is null where no policy
sampled the token (context tokens, expert demonstrations).

Every episode played has at least one row, so a file lists all of a stage's episodes: an
episode with no sample (a failed ``reset``, a failure or context overflow before its first
action) has one *episode row* whose ``turn_index`` and token columns (``token_ids``,
``logprobs``, ``loss_mask``, ``versions``) are null. Infrastructure failures (env code
raised, a worker crashed or hung) are in the file with their error text in ``infra_failure``
(null for every other episode), with the samples they had before failing; they are never
scored: their ``reward`` and ``success`` are null (``turn_reward`` still holds what the env
paid per turn). In DuckDB::

    SELECT count(DISTINCT trajectory_id) FROM 'RUN/trajectories/rl_*.parquet'
        WHERE infra_failure IS NOT NULL;                            -- failed episodes
    SELECT DISTINCT trajectory_id, infra_failure FROM 'RUN/trajectories/bc_demos.parquet'
        WHERE infra_failure IS NOT NULL;                            -- failed demonstrations, why
    SELECT avg(reward) FROM (SELECT DISTINCT trajectory_id, reward FROM 'RUN/trajectories/rl_00000.parquet');
        -- mean return of the scored episodes (avg skips the failures' null)

``source`` says where an episode came from (a name; the training stages write those of
``turnforge.train.mechanisms.SOURCES``): ``demo`` (expert demonstrations), ``plain`` (the policy
on a task's real start), ``retry`` (more plain attempts, possibly at another temperature, on a
task none of the first ones solved), ``guided`` (the policy with env guidance or hints in its
prompt), ``curriculum`` (started from a snapshot state along an earlier trajectory), ``anchor``
(started from a state along the expert's solution of a task the policy never solved),
``evolved`` (a task derived from a failed one). Files written
before the column existed lack it: ``read_trajectories`` gives them a null ``source``;
``turnforge.data.query.TrajectoryStore``, which reads all of a run's files as one dataset with
views per trajectory and success rates by task, round and source (``turnforge data RUN SQL`` on
the command line), reads it as ``default_source(stage)`` (``demo`` for stage ``bc``, else ``plain``).

When a judge model gave the reward (``turnforge.rewards.judge``), ``judge_prompt``,
``judge_output`` and ``judge_score`` hold its verdict and ``verifier_reward`` the return the
env (or agent) paid before the judge replaced it; they are null otherwise.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from turnforge.types import Trajectory

SCHEMA = pa.schema(
    [
        ("stage", pa.string()),
        ("source", pa.string()),
        ("iteration", pa.int32()),
        ("trajectory_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("env_seed", pa.int64()),
        ("turn_index", pa.int32()),
        ("policy", pa.string()),  # the policy that sampled the sample (agent.policies); "" for the run's one policy
        ("segment_index", pa.int32()),
        ("parent_segment", pa.int32()),
        ("first_turn", pa.int32()),
        ("summary_tokens", pa.int32()),
        ("memory_start", pa.int32()),
        ("memory_tokens", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("versions", pa.list_(pa.int32())),
        # vision policies: sha256 of each image whose processor block token_ids hold, in order (the PNG
        # is IMAGES_DIR/<sha256>.png beside the file); an empty list for a text sample
        ("image_sha256", pa.list_(pa.string())),
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
        # generative rewards (turnforge.rewards.judge); null when no judge scored the episode
        ("judge_prompt", pa.string()),
        ("judge_output", pa.string()),
        ("judge_score", pa.float32()),
        ("verifier_reward", pa.float32()),
    ]
)

#: Per-sample integer columns copied from ``Sample`` attributes of the same name.
SAMPLE_SPANS: tuple[str, ...] = ("segment_index", "parent_segment", "first_turn", "summary_tokens", "memory_start", "memory_tokens")

#: Folder beside the Parquet files that holds the images of their samples, one PNG per content hash.
IMAGES_DIR = "images"



def advantage_key(trajectory_id: str, policy: str) -> str:
    """The key of a policy's advantages of a trajectory (``agent.policies``): ``<id>@<policy>``."""
    return f"{trajectory_id}@{policy}" if policy else trajectory_id


def default_source(stage: str) -> str:
    """The source of an episode written without one: ``demo`` for stage ``bc``, else ``plain``."""
    return "demo" if stage == "bc" else "plain"


def write_trajectories(
    path: str | Path,
    trajectories: Sequence[Trajectory],
    *,
    stage: str,
    iteration: int,
    advantages: dict[str, Sequence[float]] | None = None,
    sources: Mapping[str, str] | str | None = None,
) -> int:
    """Write the samples of ``trajectories`` to ``path`` (Parquet, whole or not at all: through a
    temporary file and a rename), one episode row for each trajectory without samples; returns
    the row count.

    ``advantages`` maps a trajectory id (with several policies: ``advantage_key(id, policy)``,
    each policy's advantages of its samples) to the advantage of each of its turns: the row's
    ``advantage`` is its turn's value (null for a whole-episode sample whose turns differ),
    ``turn_advantages`` the whole list. ``sources`` is each episode's ``source``: one name for
    all of them, or a mapping from trajectory id that names every trajectory (default:
    ``default_source(stage)``); a value that is not a lower-case name, or a missing id, raises
    ``ValueError``."""
    source_of = _source_lookup(trajectories, sources, stage)
    rows: dict[str, list] = {name: [] for name in SCHEMA.names}
    for traj in trajectories:
        failed = traj.infra_failure is not None
        per_turn = None if advantages is None else advantages.get(traj.trajectory_id)
        for s in traj.samples or (None,):  # None: the episode row of an episode without samples
            turn_index = None if s is None else s.turn_index
            turn = traj.turns[turn_index] if turn_index is not None and 0 <= turn_index < len(traj.turns) else None
            rows["stage"].append(stage)
            rows["source"].append(source_of[traj.trajectory_id])
            rows["iteration"].append(iteration)
            rows["trajectory_id"].append(traj.trajectory_id)
            rows["task_id"].append(traj.task.task_id)
            rows["group_id"].append(traj.group_id)
            rows["env_seed"].append(traj.env_seed)
            rows["turn_index"].append(turn_index)
            rows["policy"].append(None if s is None else s.policy)
            for name in SAMPLE_SPANS:
                rows[name].append(None if s is None else getattr(s, name))
            rows["token_ids"].append(None if s is None else s.token_ids.tolist())
            lp = None if s is None else s.logprobs.astype(np.float64)
            rows["logprobs"].append(None if lp is None else [None if np.isnan(x) else float(x) for x in lp])
            rows["loss_mask"].append(None if s is None else s.loss_mask.tolist())
            rows["versions"].append(None if s is None else s.versions.tolist())
            rows["image_sha256"].append(None if s is None else [_keep_image(path, png) for png in s.images])
            rows["action_text"].append(turn.action_text if turn else None)
            rows["turn_reward"].append(turn.reward if turn else None)
            rows["reward"].append(None if failed else traj.episode_return)
            if s is not None and s.policy and advantages is not None:  # several policies: each has its own
                per_turn = advantages.get(advantage_key(traj.trajectory_id, s.policy))
            rows["advantage"].append(None if s is None else _sample_advantage(per_turn, s.turn_index))
            rows["turn_advantages"].append(None if per_turn is None else [float(a) for a in per_turn])
            rows["success"].append(None if failed else traj.success)
            rows["num_turns"].append(traj.num_turns)
            rows["policy_version"].append(traj.policy_version)
            rows["truncation_reason"].append(traj.truncation_reason)
            rows["infra_failure"].append(traj.infra_failure)
            judge = traj.judge
            rows["judge_prompt"].append(None if judge is None else judge.prompt)
            rows["judge_output"].append(None if judge is None else judge.output)
            rows["judge_score"].append(None if judge is None else judge.score)
            rows["verifier_reward"].append(None if judge is None else judge.verifier_return)
    table = pa.table(rows, schema=SCHEMA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # through a hidden temporary file and a rename: a reader of a live run (``turnforge view``,
    # ``turnforge data``) never sees half a file under the *.parquet name
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return table.num_rows


def _keep_image(parquet_path: str | Path, png: bytes) -> str:
    """Write ``png`` as ``IMAGES_DIR/<sha256>.png`` beside ``parquet_path`` (once: content-addressed,
    through a temporary file and a rename); returns the hash."""
    from turnforge.policy.vision import image_key

    key = image_key(png)
    folder = Path(parquet_path).parent / IMAGES_DIR
    target = folder / f"{key}.png"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(png)
        os.replace(tmp, target)
    return key


def read_image(parquet_path: str | Path, key: str) -> bytes:
    """The PNG bytes of image ``key`` (a value of ``image_sha256``) stored beside ``parquet_path``."""
    return (Path(parquet_path).parent / IMAGES_DIR / f"{key}.png").read_bytes()


def _source_lookup(trajectories: Sequence[Trajectory], sources: Mapping[str, str] | str | None,
                   stage: str) -> dict[str, str]:
    """Each trajectory id's source, checked to be a name before anything is written."""
    if sources is None or isinstance(sources, str):
        value = default_source(stage) if sources is None else sources
        found = {traj.trajectory_id: value for traj in trajectories}
    else:
        missing = [traj.trajectory_id for traj in trajectories if traj.trajectory_id not in sources]
        if missing:
            raise ValueError(f"sources has no entry for trajectory {missing[0]!r} ({len(missing)} missing); "
                             "give one per trajectory id, or one source for all")
        found = {traj.trajectory_id: sources[traj.trajectory_id] for traj in trajectories}
    for tid, value in found.items():
        if not (isinstance(value, str) and re.fullmatch(r"[a-z][a-z0-9_]*", value)):
            raise ValueError(f"source {value!r} of trajectory {tid!r} is not a name (lower-case letters, digits, _)")
    return found


def _sample_advantage(per_turn: Sequence[float] | None, turn_index: int) -> float | None:
    if per_turn is None or len(per_turn) == 0:
        return None
    if turn_index >= 0:
        return float(per_turn[turn_index])
    return float(per_turn[0]) if len(set(np.asarray(per_turn).tolist())) == 1 else None


def read_trajectories(path: str | Path) -> pa.Table:
    """Read a trajectory file (or a directory of them) as one Arrow table; a column that an
    older file lacks (``source``, the segment columns) reads as null."""
    return pq.read_table(path, schema=SCHEMA)
