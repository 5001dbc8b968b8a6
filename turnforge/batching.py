"""Fixed-size chunks of a sequence: how everything that scores without gradients walks its
samples (the KL penalty, proximal logprobs, action entropy, pass@k's action scores, critic
values). One forward pass per chunk bounds the memory of a scoring pass, whatever its size."""

from __future__ import annotations

from typing import Iterator, Sequence, TypeVar

T = TypeVar("T")

#: Rows per forward pass when scoring without gradients.
SCORING_BATCH = 128


def batches(items: Sequence[T], size: int = SCORING_BATCH) -> Iterator[Sequence[T]]:
    """``items[0:size]``, ``items[size:2 * size]``, ... (the last one shorter)."""
    if size < 1:
        raise ValueError(f"batch size {size} must be at least 1")
    for start in range(0, len(items), size):
        yield items[start:start + size]
