"""Shared command line and output of the benchmarks that score checkpoints of run directories."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """RUN_DIR ... [--checkpoints bc final] [--threads 2] [--out benchmarks/results/NAME.json]."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--checkpoints", nargs="+", default=["bc", "final"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(f"benchmarks/results/{name}.json"))
    return ap


def score(args: argparse.Namespace, row_of: Callable[[Path, str], dict]) -> list[dict]:
    """``row_of(run, checkpoint)`` for every run and checkpoint on the command line, each row
    printed as JSON as it comes (torch limited to ``--threads``)."""
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
