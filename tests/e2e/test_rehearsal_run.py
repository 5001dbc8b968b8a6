"""A run with rehearsal toward its starting policy (rl.rehearsal_coef): the cache, its env steps, exact resume."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from test_train_tiny import FAST

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.runs import RunDir
from turnforge.train.metrics import read_metrics

#: a BC start with some valid moves (FAST's is all invalid: nothing to rehearse)
REHEARSE = FAST + ["bc.num_demos=48", "bc.epochs=6",
                   "rl.rehearsal_coef=1.0", "rl.rehearsal_episodes=6", "rl.rehearsal_temperature=0.5"]


@pytest.mark.slow
def test_a_run_rehearses_its_start_and_resumes_to_the_same_weights(tmp_path):
    summary = train(load_config("sokoban-tiny", REHEARSE), tmp_path / "a", live=False)
    cache = pq.read_table(RunDir(tmp_path / "a").rehearsal)
    meta = {k.decode(): int(v) for k, v in cache.schema.metadata.items()}
    assert 0 < meta["episodes"] <= meta["played"] == 6 and cache.num_rows > 0
    for versions, mask in zip(cache.column("versions").to_pylist(), cache.column("loss_mask").to_pylist()):
        assert all(v >= 0 for v, m in zip(versions, mask) if m)  # the starting policy's own tokens
    its = read_metrics(tmp_path / "a").iterations
    assert all(m.update.rehearsal_nll is not None and m.update.rehearsal_nll > 0 for m in its if m.samples)
    plain = train(load_config("sokoban-tiny", [o for o in REHEARSE if not o.startswith("rl.rehearsal")]), tmp_path / "plain",
                  live=False)
    assert summary.env_steps == plain.env_steps + meta["env_steps"]  # the cache's episodes are counted once
    # interrupted after one iteration and resumed: the same cache, the same weights
    train(load_config("sokoban-tiny", REHEARSE), tmp_path / "b", live=False, stop_after=1)
    resumed = train(load_run_config(tmp_path / "b"), tmp_path / "b", resume=True, live=False)
    a = load_file(str(tmp_path / "a" / "checkpoints" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoints" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.env_steps == summary.env_steps
