"""Run directories made before the flywheel mechanisms kept their own records still read: an
old flat ``flywheel_round`` record (from a run of 2026-11-27's code) comes back in today's shape,
equal to what today's code wrote for the same round (timings and evaluations apart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from turnforge.train.metrics import read_metrics, to_json

RECORDS = json.loads((Path(__file__).parent / "flywheel_round_2026-11-27.json").read_text())


def _run(tmp_path: Path, record: dict, mechanisms: list[str] | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    if mechanisms is not None:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"flywheel": {"mechanisms": mechanisms}}))
    return tmp_path


def _comparable(record) -> dict:
    return {k: v for k, v in to_json(record).items() if k not in ("seconds", "time", "eval", "boundary", "env_steps")}


@pytest.mark.parametrize("with_config", [True, False])
def test_an_old_flat_record_reads_as_todays(tmp_path, with_config):
    (old,) = read_metrics(_run(tmp_path / "old", RECORDS["old"], RECORDS["mechanisms"] if with_config else None)).flywheel
    (new,) = read_metrics(_run(tmp_path / "new", RECORDS["new"], None)).flywheel
    if with_config:
        assert _comparable(old) == _comparable(new)
    else:  # without config.yaml: the mechanisms whose figures moved (curriculum and anchor did nothing in round 1)
        assert sorted(old.mechanisms) == ["evolve", "guidance", "replay", "retry"]
        assert {k: to_json(v) for k, v in old.mechanisms.items()} == \
            {k: to_json(v) for k, v in new.mechanisms.items() if k in old.mechanisms}


def test_the_upgrade_keeps_only_the_run_s_mechanisms(tmp_path):
    (old,) = read_metrics(_run(tmp_path, RECORDS["old"], ["retry", "replay"])).flywheel
    assert list(old.mechanisms) == ["retry", "replay"]
