"""AReaL's admission rule: staleness never exceeds eta; eta = 0 is synchronous."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnforge.rollout.staleness import StalenessController


def _simulate(batch_size, group_size, eta, choices):
    """Random interleaving of 'start a group' and 'train a step'; a step needs its whole
    batch started (generation is instantaneous here; only the order matters)."""
    c = StalenessController(batch_size, eta, group_size)
    versions = {}  # trajectory number -> version that sampled it
    consumed = []  # (trajectory, version that sampled it, step that trained on it)
    for start in choices:
        ready = c.started >= (c.version + 1) * batch_size
        if start and c.can_admit():
            numbers, v = c.admit()
            versions.update({n: v for n in numbers})
        elif ready:
            step = c.version
            consumed += [(n, versions[n], step) for n in range(step * batch_size + 1, (step + 1) * batch_size + 1)]
            c.train_step()
        elif c.can_admit():
            numbers, v = c.admit()
            versions.update({n: v for n in numbers})
        else:  # pragma: no cover - admission and training cannot both be blocked
            raise AssertionError("deadlock")
    return c, consumed


@settings(max_examples=200, deadline=None)
@given(
    groups_per_batch=st.integers(1, 4),
    group_size=st.integers(1, 4),
    eta=st.integers(0, 4),
    choices=st.lists(st.booleans(), min_size=1, max_size=200),
)
def test_staleness_never_exceeds_eta(groups_per_batch, group_size, eta, choices):
    batch = groups_per_batch * group_size
    c, consumed = _simulate(batch, group_size, eta, choices)
    for n, sampled_with, trained_at in consumed:
        assert trained_at == StalenessController.step_of(n, batch)
        assert 0 <= trained_at - sampled_with <= eta
    # never more than (eta + 1) batches ahead of the trainer
    assert c.started <= (c.version + eta + 1) * batch


def test_eta_zero_is_synchronous():
    c = StalenessController(batch_size=4, eta=0, group_size=2)
    assert c.admit() == (range(1, 3), 0) and c.admit() == (range(3, 5), 0)
    assert not c.can_admit()  # the next group belongs to step 1: wait for step 0
    with pytest.raises(RuntimeError, match="would exceed staleness eta=0 at version 0"):
        c.admit()
    c.train_step()
    assert c.admit() == (range(5, 7), 1)


def test_eta_two_runs_two_batches_ahead():
    c = StalenessController(batch_size=2, eta=2)
    admitted = 0
    while c.can_admit():
        c.admit()
        admitted += 1
    assert admitted == 6  # batches 0, 1, 2 at version 0


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(batch_size=6, eta=-1), r"eta must be >= 0; got eta=-1"),
        (dict(batch_size=6, eta=1, group_size=4), r"batch_size=6 is not a multiple of group_size=4"),
        (dict(batch_size=0, eta=1), r"batch_size \(0\) and group_size \(1\) must be >= 1"),
    ],
)
def test_invalid_combinations_name_both(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        StalenessController(**kwargs)
