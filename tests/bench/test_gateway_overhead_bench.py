"""benchmarks/gateway_overhead.py: agents through the gateway play the same episodes as the
engine (greedy, the same actions), splice their histories, and the result is plain JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gateway_overhead import bench, to_markdown  # noqa: E402


def test_gateway_and_engine_play_the_same_episodes(tiny_policy):
    result = bench(tiny_policy, "sokoban", episodes=3, turns=3, max_new_tokens=4, repeats=1)
    assert json.loads(json.dumps(result)) == result
    assert result["same_actions"], {m: r["checksum"] for m, r in result["modes"].items()}
    assert result["modes"]["engine"]["generated_tokens"] == result["modes"]["gateway"]["generated_tokens"] > 0
    assert result["gateway_spliced_calls"] == result["gateway_calls"] - 3  # every later turn rides on sampled tokens
    assert "gateway / engine" in to_markdown(result)
