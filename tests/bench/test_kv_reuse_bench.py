"""bench_kv_reuse (benchmarks/kv_reuse.py): the three generation backends play the same
episodes, and the result is plain JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from kv_reuse import MODES, bench_kv_reuse, to_markdown  # noqa: E402


def test_bench_kv_reuse_modes_do_the_same_work(tiny_policy):
    result = bench_kv_reuse(tiny_policy, "frozenlake", {}, episodes=3, turns=3, max_new_tokens=4, repeats=1)
    assert json.loads(json.dumps(result)) == result
    assert result["same_actions"], {m: r["checksum"] for m, r in result["modes"].items()}
    assert list(result["modes"]) == list(MODES)
    cached = result["modes"]["prefix_cache"]
    assert cached["reused_tokens"] > 0 and cached["prefilled_tokens"] + cached["reused_tokens"] > cached["context_tokens"]
    assert len({m["generated_tokens"] for m in result["modes"].values()}) == 1
    assert "prefix_cache/hf_generate" in to_markdown(result)
