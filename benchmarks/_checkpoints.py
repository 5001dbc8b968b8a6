"""Shared command line and output of the benchmarks that score checkpoints of run directories
(``expert_agreement.py``, ``level_spread.py``, ``temperature_gap.py``; ``merge_duplicates.py``
uses ``save``). Results go to ``--out`` (default ``runs/benchmarks/NAME.json``), a Markdown
table next to it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
from _runs import RESULTS

from turnforge.app.config import load_config
from turnforge.config import TrainConfig
from turnforge.policy.model import Policy, load_policy, quiet_hf
from turnforge.rollout.engine import RolloutEngine, make_engine


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """RUN_DIR ... [--checkpoints bc final] [--threads 2] [--out runs/benchmarks/NAME.json]."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--checkpoints", nargs="+", default=["bc", "final"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json",
                    help="JSON result file, Markdown table next to it (default %(default)s)")
    return ap


def load(run: Path, checkpoint: str) -> tuple[TrainConfig, Policy]:
    """The run's config (``RUN/config.yaml``) and its checkpoint ``RUN/checkpoints/<checkpoint>``."""
    return load_config(str(run / "config.yaml")), load_policy(run / "checkpoints" / checkpoint)


def engine(cfg: TrainConfig, policy: Policy, num_envs: int) -> RolloutEngine:
    """A rollout engine with the run's env and rollout settings and ``num_envs`` envs in this
    process (whatever backend the run trained with); close it after use (``contextlib.closing``)."""
    return make_engine(cfg, policy, num_envs, workers=0)


def score(args: argparse.Namespace, row_of: Callable[[Path, str], dict]) -> list[dict]:
    """``row_of(run, checkpoint)`` for every run and checkpoint on the command line, each row
    printed as JSON as it comes (torch limited to ``--threads``; Hugging Face offline and quiet)."""
    quiet_hf()
    torch.set_num_threads(args.threads)
    rows = []
    for run in args.runs:
        for ck in args.checkpoints:
            rows.append({"run": str(run), "checkpoint": ck, **row_of(run, ck)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def save(out: Path, rows: list[dict], table: list[str]) -> None:
    """Write ``rows`` as JSON at ``out`` and the Markdown ``table`` next to it, and print the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
