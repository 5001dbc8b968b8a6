"""turnforge.dist's collectives on two gloo ranks in worker processes: items dealt round-robin
and their results back in order, counters summed, per-figure shares."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.multiprocessing as mp

from turnforge import dist


@dataclass
class Counters:
    items: int
    turns: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_world("gloo", 60)
    try:
        played, heard = [], []

        def play(items, on_progress):
            played.extend(items)
            on_progress(len(items))
            return [f"r{x}" for x in items], Counters(len(items), 10 * len(items))

        results, counters = dist.ranked_play(play, list(range(7)), heard.append)
        shared = dist.share_weighted([[1.0, 2.0]], [[0.5 if rank == 0 else 1.5, 1.0]])
        out.put((rank, played, results, counters, heard, shared))
    finally:
        dist.shutdown()


def test_ranked_play_deals_items_and_returns_them_all_in_order():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, played, results, counters, heard, shared = out.get(timeout=120)
        got[rank] = (played, results, counters, heard, shared)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got[0][0] == [0, 2, 4, 6] and got[1][0] == [1, 3, 5]  # rank r plays r, r + 2, ...
    for rank in (0, 1):
        played, results, counters, heard, shared = got[rank]
        assert results == [f"r{x}" for x in range(7)]  # every rank gets all of them, in item order
        assert counters == Counters(7, 70)
        assert heard == [min(7, 2 * len(played))]  # progress: this rank's count times the ranks
        # per-figure shares: (1.0 * 0.5 + 1.0 * 1.5) / 2 and (2.0 * 1 + 2.0 * 1) / 2
        assert shared == [[1.0, 2.0]]


def test_ranked_play_in_a_world_of_one_is_the_play_itself():
    calls = []
    results, counters = dist.ranked_play(lambda items, p: (calls.append(items) or items, Counters(len(items), 0)), [3, 1])
    assert calls == [[3, 1]] and results == [3, 1] and counters == Counters(2, 0)
