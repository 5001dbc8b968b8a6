"""The viewer's data layer (``turnforge.view.data``) on stores written by the real writer:
samples in the order written, files picked by their footers, filters checked."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from turnforge.data.store import write_trajectories
from turnforge.errors import UserError
from turnforge.types import Sample, Task, Trajectory, Turn
from turnforge.view.data import RunView
from turnforge.view.records import BrowseQuery


def _agent_like(tid: str, lengths: list[int]) -> Trajectory:
    """One turn whose samples are several model calls (as the gateway compiles an agent's
    rollout): all on turn 0, told apart only by the order they were written in."""
    samples = []
    for n in lengths:
        ids = np.arange(3, 3 + n, dtype=np.int64)
        mask = np.r_[np.zeros(n - 2, np.int8), np.ones(2, np.int8)]
        logprobs = np.where(mask == 1, -0.5, np.nan).astype(np.float32)
        samples.append(Sample(ids, mask, logprobs, np.where(mask == 1, 0, -1).astype(np.int32), tid, 0))
    turn = Turn("task", "answer", 1.0, False, "")
    return Trajectory(tid, Task("agent", "train", 0), "g0", 0, (turn,), tuple(samples), 1.0, True, True, False, None, 0)


def test_samples_of_one_turn_keep_the_order_written(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(tiny_model_dir)}}))
    lengths = [40, 9, 25, 17]  # neither sorted nor reversed
    write_trajectories(run / "trajectories" / "rl_00000.parquet", [_agent_like("rl-0-0-0", lengths)], stage="rl", iteration=0)
    write_trajectories(run / "trajectories" / "rl_00001.parquet", [_agent_like("rl-1-0-0", lengths[::-1])], stage="rl", iteration=1)
    view = RunView(run)
    assert view._files_of("rl", 1) == [run / "trajectories" / "rl_00001.parquet"]  # the footers name each file's iteration
    for it, want in ((0, lengths), (1, lengths[::-1])):
        (t,) = view.trajectory("rl", it, f"rl-{it}-0-0").trajectories
        assert [len(s.ids) for s in t.samples] == want
    arrays = view.token_arrays()
    assert arrays.length.tolist() == lengths + lengths[::-1] and arrays.episode.tolist() == [0] * 4 + [1] * 4
    assert view.pieces is not None and view.overview().tokenizer == str(tiny_model_dir)
    view.close()


def test_browse_query_names_a_bad_filter():
    assert BrowseQuery.from_params({"stage": "rl", "iteration": "2", "reward_min": "-1.5", "run": "0", "task": ""}) == \
        BrowseQuery(stage="rl", iteration=2, reward_min=-1.5)
    for params, message in [({"stag": "rl"}, "unknown filter 'stag'"), ({"iteration": "x"}, "filter iteration='x' is not a number"),
                            ({"outcome": "won"}, "unknown outcome 'won'"), ({"sort": "up"}, "unknown sort 'up'"),
                            ({"limit": "0"}, "limit from 1 to 1000")]:
        with pytest.raises(UserError, match=message.replace("(", r"\(")):
            BrowseQuery.from_params(params)
