"""Shared command line and output of the benchmarks that score checkpoints of run directories."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """RUN_DIR ... [--checkpoints bc final] [--threads 2] [--out benchmarks/results/NAME.json]."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--checkpoints", nargs="+", default=["bc", "final"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(f"benchmarks/results/{name}.json"))
    return ap


def save(out: Path, rows: list[dict], table: list[str]) -> None:
    """Write ``rows`` as JSON at ``out`` and the Markdown ``table`` next to it, and print the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
