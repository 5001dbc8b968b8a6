"""The golden comparison lets last-bit float differences through and catches real changes.

On the stored records themselves: every float moved by a few ulps (what another CPU or kernel
path gives) passes; a flipped loss-mask entry, a token id, a logprob moved by 1e-3 (another
sampling rule), advantages moved by 1% (another estimator moves them by far more) or a weight
tensor moved by one learning-rate step fail, naming the field.
"""

from __future__ import annotations

import copy
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from golden_format import (  # noqa: E402
    SAMPLED, Mismatch, Tolerance, assert_run_matches, assert_trajectories_match, largest_float_difference,
)


def _load(name: str):
    with gzip.open(HERE / f"{name}.json.gz", "rt") as f:
        return json.load(f)


def _ulps(x: float, n: int) -> float:
    """``x`` moved by ``n`` float32 ulps away from zero."""
    v = np.float32(x)
    for _ in range(n):
        v = np.nextafter(v, np.float32(np.inf) if v >= 0 else np.float32(-np.inf))
    return float(v)


def _map_floats(obj, fn, keys: tuple[str, ...]):
    """``obj`` with ``fn`` applied to every float under a key in ``keys``."""
    if isinstance(obj, dict):
        return {k: (_map_all(v, fn) if k in keys else _map_floats(v, fn, keys)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_floats(x, fn, keys) for x in obj]
    return obj


def _map_all(obj, fn):
    if isinstance(obj, float):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_all(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: _map_all(v, fn) for k, v in obj.items()}
    return obj


def test_tolerance_is_torch_testing_rule():
    assert Tolerance(rtol=0.1, atol=1.0).holds(12.0, 10.0)  # 2 <= 1 + 0.1 * 10
    assert not Tolerance(rtol=0.1, atol=1.0).holds(12.1, 10.0)
    assert SAMPLED.holds(_ulps(-5.62762451171875, 2), -5.62762451171875)  # the difference seen on an Intel Xeon (1 ulp)


def test_a_few_ulps_in_every_sampling_logprob_pass():
    want = _load("eval_sokoban_window")
    got = _map_floats(want, lambda x: _ulps(x, 3), ("logprobs",))
    assert largest_float_difference(got, want) > 0
    assert_trajectories_match(got, want)


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t[1]["samples"][0]["loss_mask"].__setitem__(-1, 1 - t[1]["samples"][0]["loss_mask"][-1]), "loss_mask"),
    (lambda t: t[0]["samples"][0]["token_ids"].__setitem__(-1, t[0]["samples"][0]["token_ids"][-1] + 1), "token_ids"),
    (lambda t: t[2]["turns"][0].__setitem__("reward", t[2]["turns"][0]["reward"] + 1e-9), "reward"),
    (lambda t: t[0]["samples"][0]["logprobs"].__setitem__(
        i := next(k for k, x in enumerate(t[0]["samples"][0]["logprobs"]) if x is not None),
        t[0]["samples"][0]["logprobs"][i] - 1e-3), "logprobs"),
])
def test_a_real_change_fails_naming_the_field(mutate, field):
    want = _load("eval_sokoban_window")
    got = copy.deepcopy(want)
    mutate(got)
    with pytest.raises(Mismatch, match=field):
        assert_trajectories_match(got, want)


def _jitter_run(want: dict) -> dict:
    """The stored run as another kernel path gives it: logprobs, losses and entropies moved by
    8 float32 ulps, each weight fingerprint by 1e-4 of its tensor's norm (the worst measured)."""
    got = _map_floats(want, lambda x: _ulps(x, 8), ("logprobs", "loss", "entropy"))
    got["weights"] = {k: [x + 1e-4 * w[1] for x in w] for k, w in want["weights"].items()}
    return got


def test_a_run_from_another_kernel_path_passes():
    want = _load("train")
    assert_run_matches(_jitter_run(want), want)


def _bump_advantages(run: dict) -> None:
    rows = run["files"]["rl_00001.parquet"]["advantage"]
    run["files"]["rl_00001.parquet"]["advantage"] = [None if a is None else a * 1.01 for a in rows]


def _step_one_tensor(run: dict) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    run["weights"][name] = [x + 0.003 for x in run["weights"][name]]  # one element moved by rl.lr


@pytest.mark.parametrize("mutate, field", [
    (_bump_advantages, "advantage"),
    (_step_one_tensor, "up_proj"),
    (lambda r: r["rl"][2].__setitem__("loss", r["rl"][2]["loss"] * 1.01), "loss"),
    (lambda r: r["evals"][1].__setitem__("success_rate", 0.125), "success_rate"),
    (lambda r: r["files"]["rl_00000.parquet"].__setitem__("digest", "0" * 64), "digest"),
])
def test_a_real_change_to_the_run_fails_naming_the_field(mutate, field):
    want = _load("train")
    got = _jitter_run(want)
    mutate(got)
    with pytest.raises(Mismatch, match=field):
        assert_run_matches(got, want)

