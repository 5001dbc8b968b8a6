"""pass@k in a run (issue 31): the boundary reports in summary.json, metrics.jsonl and the plot;
the same run without them has every other figure bit for bit; `turnforge eval --pass-at-k`
repeats the run's final report; a summary.json written before them still loads."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from test_train_tiny import FAST

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.train.metrics import read_metrics, read_summary

pytestmark = pytest.mark.slow

ON = FAST + ["rl.iterations=2", "eval.pass_at_k_samples=4"]  # FAST turns it off; the later value wins
OFF = FAST + ["rl.iterations=2"]
STAMPS = ("wall_seconds", "rl_seconds", "peak_memory", "boundary_start", "boundary_after")


def test_a_run_measures_pass_at_k_and_nothing_else_moves(tmp_path):
    on = train(load_config("sokoban-tiny", ON), tmp_path / "on", live=False)
    off = train(load_config("sokoban-tiny", OFF), tmp_path / "off", live=False)

    # the reports: start and end, k = 1, 2, 4 (N = 4) on the 6 evaluated tasks, in summary and metrics
    for r in (on.boundary_start, on.boundary_after):
        assert r is not None and r.tasks == 6 and r.samples_per_task == 4 and r.episodes + r.infra_failures == 24
        assert [p.k for p in r.pass_at_k] == [1, 2, 4] and r.temperature == 1.0 and r.eval_temperature == 1.0
        values = [p.value for p in r.pass_at_k]
        assert values == sorted(values) and r.entropy > 0 and r.action_mi_max == pytest.approx(1.3862944, abs=1e-6)
    assert on.boundary_start.policy_version == 0 and on.boundary_after.policy_version == on.policy_version > 0
    assert on.boundary_after.eval_malformed_rate == on.eval_after_rl.invalid_action_rate
    assert [b.tag for b in read_metrics(tmp_path / "on").boundaries] == ["start", "after"]
    assert read_summary(tmp_path / "on") == on
    assert (tmp_path / "on" / "pass_at_k.png").stat().st_size > 10_000
    assert off.boundary_start is None and off.boundary_after is None and not (tmp_path / "off" / "pass_at_k.png").exists()

    # every other figure of the run is the same, bit for bit: summary, evaluations, RL records, weights, trajectories
    def figures(s):  # the summary without its clock readings (and the reports themselves)
        def unstamped(x):
            if isinstance(x, dict):
                return {k: unstamped(v) for k, v in x.items() if k != "time"}
            return x
        return {k: unstamped(v) for k, v in dataclasses.asdict(s).items() if k not in STAMPS}

    assert figures(on) == figures(off)
    m_on, m_off = read_metrics(tmp_path / "on"), read_metrics(tmp_path / "off")
    assert [dataclasses.replace(e, time=0.0) for e in m_on.evals] == [dataclasses.replace(e, time=0.0) for e in m_off.evals]
    strip = ("time", "rollout_seconds", "credit_seconds", "update_seconds", "gen_tokens_per_s", "train_tokens_per_s", "stream")
    assert [{k: v for k, v in dataclasses.asdict(i).items() if k not in strip} for i in m_on.iterations] == \
           [{k: v for k, v in dataclasses.asdict(i).items() if k not in strip} for i in m_off.iterations]
    w_on, w_off = (load_file(str(tmp_path / d / "checkpoints" / "final" / "model.safetensors")) for d in ("on", "off"))
    assert all(w_on[k].equal(w_off[k]) for k in w_on)
    files = sorted(p.name for p in (tmp_path / "on" / "trajectories").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "off" / "trajectories").iterdir())  # no pass@k file
    assert all((tmp_path / "on" / "trajectories" / f).read_bytes() == (tmp_path / "off" / "trajectories" / f).read_bytes()
               for f in files)

    # turnforge eval --pass-at-k 4 on the final checkpoint repeats the run's final report
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "turnforge.cli", "eval", str(tmp_path / "on" / "checkpoints" / "final"),
                           "--pass-at-k", "4", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got, want = json.loads(out.read_text())["boundary"], json.loads(json.dumps(dataclasses.asdict(on.boundary_after)))
    same = ("tag", "seconds", "policy_version", "env_steps", "time")
    assert {k: v for k, v in got.items() if k not in same} == {k: v for k, v in want.items() if k not in same}
    assert "pass@k eval (6 heldout tasks x 4 samples, T=1): pass@1=" in proc.stderr

    # a summary.json written before the boundary reports existed still loads
    data = json.loads((tmp_path / "on" / "summary.json").read_text())
    for key in ("boundary_start", "boundary_after"):
        del data[key]
    (tmp_path / "on" / "summary.json").write_text(json.dumps(data))
    assert read_summary(tmp_path / "on").boundary_after is None
