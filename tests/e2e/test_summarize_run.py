"""A whole run with ``rollout.context=summarize`` on the keydoor memory env: BC learns the
expert's summaries, RL trains on segments, the Parquet holds every segment, and every iteration's
metrics and log line count the summaries written and their lengths."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.train.metrics import read_metrics

pytestmark = pytest.mark.slow

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "env.kwargs.min_length=20", "env.kwargs.max_length=30", "env.kwargs.gate_every=10",
    "rollout.max_turns=40", "rollout.max_context_tokens=400", "rollout.summary_threshold=200",
    "bc.num_demos=6", "bc.epochs=1", "bc.batch_size=8",
    "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=2", "rl.minibatch_size=16",
    "eval.episodes=4", "eval.every=0", "checkpoint_every=5",
]


def test_summarize_run_stores_segments_and_trains_on_them(tmp_path, capsys):
    out = tmp_path / "run"
    summary = train(load_config("keydoor-tiny", FAST), out, live=False)
    assert summary.rl_iterations == 2 and summary.bc is not None
    demos = str(out / "trajectories" / "bc_demos.parquet")
    # every demonstration is several segments, each but the last ending in the expert's summary
    per_episode = duckdb.sql(f"""
        SELECT trajectory_id, count(*) AS n, max(segment_index) AS last, min(parent_segment) AS first_parent,
               sum(CASE WHEN summary_tokens > 0 THEN 1 ELSE 0 END) AS summarized
        FROM '{demos}' GROUP BY trajectory_id""").fetchall()
    assert per_episode and all(n >= 2 and last == n - 1 and first == -1 and summarized == n - 1
                               for _, n, last, first, summarized in per_episode)
    rl = duckdb.sql(f"""SELECT trajectory_id, segment_index, first_turn, summary_tokens, loss_mask, logprobs, versions,
                               turn_advantages, truncation_reason
                        FROM '{out}/trajectories/rl_*.parquet' ORDER BY trajectory_id, segment_index""").fetchall()
    assert any(r[3] > 0 for r in rl)  # the policy wrote summaries during RL
    for _, _, _, summary_tokens, mask, logprobs, versions, _, _ in rl:
        mask = np.asarray(mask)
        tail = slice(len(mask) - summary_tokens, len(mask))
        assert mask[tail].all()  # sampled summaries are trained (summary_loss=train)
        assert all((lp is None) == (m == 0) for lp, m in zip(logprobs, mask))
        assert all(v >= 0 for v, m in zip(versions, mask) if m)
    metrics = (out / "metrics.jsonl").read_text()
    assert '"summaries"' in metrics and '"overlong_episodes"' in metrics
    # each iteration's record counts the summaries its episodes wrote, as the Parquet holds them
    iters = read_metrics(out).iterations
    assert len(iters) == 2
    for it in iters:
        lengths = [n for (n,) in duckdb.sql(f"""SELECT summary_tokens FROM '{out}/trajectories/rl_{it.iteration - 1:05d}.parquet'
                                               WHERE summary_tokens > 0""").fetchall()]
        assert it.summaries.count == len(lengths) == it.rollout.summaries > 0
        assert it.summaries.max_tokens == max(lengths) <= 8  # rollout.summary_max_tokens
        assert abs(it.summaries.mean_tokens - sum(lengths) / len(lengths)) < 1e-9
    # and the log's last RL line says so
    last = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[rl] 2/2")]
    s = iters[-1].summaries
    assert last and f"summaries={s.count} (mean {s.mean_tokens:.1f}, max {s.max_tokens} tokens)" in last[0]
