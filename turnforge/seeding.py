"""Every random stream of a run, derived from its parts: ``stable_hash(seed, stage, iteration, ...)``.

A stage that draws (a task order, an env seed, a minibatch order, a sampling generator) asks
for a stream named by what it is for, so a resumed run draws exactly what an uninterrupted one
would and two stages never share a stream by accident. ``stable_hash`` is stable across
processes (unlike ``hash``), so env workers and Ray actors derive the same numbers.

This module imports no torch at load time (envs and the config use ``stable_hash``); ``generator``
imports it when called.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def stable_hash(*parts: object) -> int:
    """A 63-bit hash of ``parts`` that is stable across processes (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts: object) -> "torch.Generator":
    """A torch generator seeded from ``parts``: every stage/iteration gets its own stream,
    so a resumed run draws exactly what an uninterrupted one would."""
    import torch

    return torch.Generator().manual_seed(stable_hash(*parts))


def rng(*parts: object) -> np.random.Generator:
    """A numpy generator seeded from ``parts`` (task draws, minibatch orders)."""
    return np.random.default_rng(stable_hash(*parts))
