"""Merge methods on hand-computed tensors, and the spec checks' lines."""

from __future__ import annotations

import math

import pytest
import torch

from turnforge.merge.methods import (MergeSpec, check_spec, dare, default_weights, drop_generator, merge_tensor, ram,
                                     slerp, ties, trim)

T = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


def test_linear_and_task_arithmetic():
    spec = MergeSpec("linear", (0.25, 0.75))
    assert torch.equal(merge_tensor(spec, "w", [T(1, 2), T(3, 6)], None), T(2.5, 5.0))
    spec = MergeSpec("task_arithmetic", (1.0, 1.0))  # base (1, 1); task vectors (1, 0) and (0, 2)
    assert torch.equal(merge_tensor(spec, "w", [T(2, 1), T(1, 3)], T(1, 1)), T(2, 3))
    spec = MergeSpec("task_arithmetic", (0.5, 2.0))
    assert torch.equal(merge_tensor(spec, "w", [T(2, 1), T(1, 3)], T(1, 1)), T(1.5, 5))


def test_slerp_follows_the_arc_and_falls_back_to_linear():
    out = slerp(T(1, 0), T(0, 1), 0.5)
    assert torch.allclose(out, T(math.sqrt(0.5), math.sqrt(0.5)))  # on the unit circle, not (0.5, 0.5)
    assert torch.allclose(slerp(T(1, 0), T(0, 1), 0.0), T(1, 0)) and torch.allclose(slerp(T(1, 0), T(0, 1), 1.0), T(0, 1))
    assert torch.allclose(slerp(T(1, 2), T(2, 4), 0.5), T(1.5, 3))  # parallel: linear
    assert torch.allclose(slerp(T(0, 0), T(2, 4), 0.25), T(0.5, 1))  # a zero vector: linear
    # angle 90 degrees, lengths 2 and 2: t = 1/3 gives angle 30 degrees from a
    assert torch.allclose(slerp(T(2, 0), T(0, 2), 1 / 3), T(2 * math.cos(math.pi / 6), 2 * math.sin(math.pi / 6)))


def test_trim_keeps_the_largest_magnitudes():
    assert torch.equal(trim(T(0.1, -3, 2, 0.5), 0.5), T(0, -3, 2, 0))
    assert torch.equal(trim(T(0.1, -3, 2, 0.5), 0.25), T(0, -3, 0, 0))
    assert torch.equal(trim(T(0.1, -3, 2, 0.5), 1.0), T(0.1, -3, 2, 0.5))


def test_ties_elects_signs_by_mass_and_averages_those_that_agree():
    # sums (-2, -1, 1): signs (-, -, +); element 0 keeps d2's -3, element 1 d1's -2, element 2 both 0.5s
    assert torch.equal(ties([T(1, -2, 0.5), T(-3, 1, 0.5)], (1.0, 1.0), 1.0), T(-3, -2, 0.5))
    # density 1/3 keeps one element of each: d1's -2 and d2's -3 (no conflict), means of one value each
    assert torch.equal(ties([T(1, -2, 0.5), T(-3, 1, 0.5)], (1.0, 1.0), 1 / 3), T(-3, -2, 0))
    # weights scale before election: (1, 0.1) flips element 0 to d1's sign
    assert torch.allclose(ties([T(1, -2, 0.5), T(-3, 1, 0.5)], (1.0, 0.1), 1.0), T(1, -2, 0.275))
    # masses that cancel (element 0: 1 and -1) take the tensor's majority sign (+: elements 1 and 2), as
    # the TIES reference code resolves zero signs, so d1's 1 is kept rather than nothing
    assert torch.equal(ties([T(1, 2, 0.5), T(-1, 1, 0.5)], (1.0, 1.0), 1.0), T(1, 1.5, 0.5))


def test_dare_drops_and_rescales_reproducibly():
    d = torch.full((10_000,), 0.5)
    kept = dare(d, 0.25, drop_generator(0, "w", 0))
    assert set(kept.unique().tolist()) == {0.0, 2.0}  # dropped, or 0.5 / 0.25
    assert abs(kept.mean().item() - 0.5) < 0.05  # unbiased
    assert torch.equal(kept, dare(d, 0.25, drop_generator(0, "w", 0)))  # same seed, name, parent: same mask
    assert not torch.equal(kept, dare(d, 0.25, drop_generator(0, "w", 1)))  # each parent its own mask
    assert not torch.equal(kept, dare(d, 0.25, drop_generator(1, "w", 0)))
    assert torch.equal(dare(d, 1.0, drop_generator(0, "w", 0)), d)


def test_ram_keeps_unique_deltas_and_averages_shared_ones():
    assert torch.equal(ram([T(1, 0, 2), T(3, 0, 0)], 0.0), T(2, 0, 2))  # shared averaged, unique kept whole
    assert torch.equal(ram([T(1, 0, 2), T(3, 0, 0)], 1.5), T(3, 0, 2))  # below eps is no change
    spec = MergeSpec("ram", (1.0, 1.0))
    assert torch.equal(merge_tensor(spec, "w", [T(2, 1, 3), T(4, 1, 1)], T(1, 1, 1)), T(3, 1, 3))
    # plain averaging of the same task vectors would halve what only one parent learned
    assert torch.equal(merge_tensor(MergeSpec("linear", (0.5, 0.5)), "w", [T(2, 1, 3), T(4, 1, 1)], None), T(3, 1, 2))


def test_merge_casts_inputs_to_float32():
    out = merge_tensor(MergeSpec("linear", (0.5, 0.5)), "w", [T(1, 2).half(), T(3, 4).bfloat16()], None)
    assert out.dtype == torch.float32 and torch.equal(out, T(2, 3))


@pytest.mark.parametrize("spec, n, base, expected", [
    (MergeSpec("soup", (0.5, 0.5)), 2, False, "unknown merge method 'soup'; valid methods: linear, slerp, task_arithmetic, ties, dare, ram"),
    (MergeSpec("linear", (1.0,)), 1, False, "--method linear needs at least 2 checkpoints, got 1"),
    (MergeSpec("slerp", (0.3, 0.3, 0.4)), 3, False, "--method slerp interpolates exactly 2 checkpoints, got 3"),
    (MergeSpec("ties", (1.0, 1.0)), 2, False, "--method ties merges task vectors (checkpoint - base): give --base INIT"),
    (MergeSpec("linear", (0.5, 0.3, 0.2)), 2, False, "--weights has 3 values for 2 checkpoints"),
    (MergeSpec("linear", (0.5, 0.6)), 2, False, "--method linear needs non-negative weights that sum to 1, got [0.5, 0.6] (sum 1.1)"),
    (MergeSpec("slerp", (1.5, -0.5)), 2, False, "--method slerp needs non-negative weights that sum to 1"),
    (MergeSpec("linear", (float("nan"), 0.5)), 2, False, "must be finite numbers"),
    (MergeSpec("dare", (1.0, 1.0), density=0.0), 2, True, "--density 0 is outside (0, 1]"),
    (MergeSpec("ram", (1.0, 1.0), eps=-1.0), 2, True, "--eps -1 must be >= 0"),
])
def test_check_spec_names_the_problem(spec, n, base, expected):
    assert expected in check_spec(spec, n, base)


def test_default_weights():
    assert default_weights("linear", 4) == (0.25,) * 4 and default_weights("slerp", 2) == (0.5, 0.5)
    assert default_weights("ram", 3) == (1.0,) * 3 and check_spec(MergeSpec("ties", default_weights("ties", 2)), 2, True) is None
