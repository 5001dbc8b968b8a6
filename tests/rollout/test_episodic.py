"""Episodic memory: BM25 recall (hand cases), what enters (the shortest success per task, by
source), the memory block at the start of every prompt under each context policy (context, loss
mask 0, token-exact), persistence, and ``memory.store``'s checks."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rescores, inline_engine

from turnforge.config import MemoryConfig, RolloutConfig
from turnforge.data.store import read_trajectories, write_trajectories
from turnforge.errors import UserError
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest
from turnforge.rollout.episodic import HEADER, EpisodicMemory, MemoryEntry, read_store, render, terms
from turnforge.runs import RunDir
from turnforge.types import Task, Trajectory, Turn

ALL_WORDS = "the box wall floor target up down left right # _ . $ @ 2 4 8 16 hole goal"  # test-echo's words


def _traj(index: int, obs: str, actions: list[str], *, success=True, infra=None, invalid=(), env="test-echo"):
    turns = tuple(Turn(obs if i == 0 else "later", a, 0.0, i in invalid, "") for i, a in enumerate(actions))
    return Trajectory(f"t{index}-{len(actions)}", Task(env, "train", index), "g", 0, turns, (), 1.0, success, True, False,
                      None, 0, infra_failure=infra)


def _entry(task: str, obs: str, actions=("up",)) -> MemoryEntry:
    return MemoryEntry(task, f"tr-{task}", "flywheel", 0, "plain", obs, tuple(actions))


def test_terms_are_words_alone_and_at_their_line_and_column():
    assert terms("#@ $\nab c") == ["#", "0:0:#", "@", "0:1:@", "$", "0:3:$", "ab", "1:0:ab", "c", "1:3:c"]


def test_recall_ranks_by_bm25_with_positions_and_keeps_ties_in_entry_order():
    mem = EpisodicMemory(MemoryConfig(enabled=True, k=2), "grid", [
        _entry("a", "#_#\n#@#"), _entry("b", "#_#\n#_@"), _entry("c", "wall floor"), _entry("d", "#_#\n#@#")])
    # the same map as a and d (a tie: entry order), then b, which shares all but one cell; c shares nothing
    assert [e.task_id for e in mem.recall("#_#\n#@#")] == ["a", "d"]
    mem.cfg.k = 4
    assert [e.task_id for e in mem.recall("#_#\n#@#")] == ["a", "d", "b"]  # c scores 0: never shown
    assert [e.task_id for e in mem.recall("floor")] == ["c"]
    assert mem.recall("nothing in common") == []
    mem.cfg.min_score = 1e6
    assert mem.recall("#_#\n#@#") == []


def test_add_keeps_the_shortest_success_per_task_of_the_named_sources():
    mem = EpisodicMemory(MemoryConfig(enabled=True, sources=["plain"]), "test-echo")
    added = mem.add([
        (_traj(0, "x y", ["a", "b", "c"]), "plain"),
        (_traj(0, "x y", ["a", "b"]), "plain"),  # shorter: replaces
        (_traj(0, "x y", ["a", "b"]), "plain"),  # as short: the first stays
        (_traj(1, "z", ["a"], success=False), "plain"),
        (_traj(2, "z", ["a"], infra="env step() raised"), "plain"),
        (_traj(3, "z", ["a"]), "retry"),  # not a named source
        (_traj(4, "w", ["bad", "up", "bad", "down"], invalid=(0, 2)), "plain"),  # invalid moves left out
    ], "flywheel", 1)
    assert added == 3 and len(mem) == 2
    assert [(e.task_id, e.actions) for e in mem.entries] == [(Task("test-echo", "train", 0).task_id, ("a", "b")),
                                                              (Task("test-echo", "train", 4).task_id, ("up", "down"))]
    frozen = EpisodicMemory(MemoryConfig(enabled=True), "test-echo", mem.entries, frozen=True)
    assert frozen.add([(_traj(9, "q", ["a"]), "plain")], "rl", 0) == 0 and len(frozen) == 2


def test_render_shows_each_success_then_the_task():
    text = render([_entry("a", "#@", ("Up", " Left")), _entry("b", "ab", ("Down",))])
    assert text == f"{HEADER}\n\n#@\nActions: Up, Left\n\nab\nActions: Down\n\nYour task:\n"
    assert render([]) == ""


@pytest.mark.parametrize("context", ["window", "full_history", "summarize"])
def test_the_block_opens_every_prompt_as_context_and_samples_rescore(any_policy, context, tmp_path):
    cfg = RolloutConfig(context=context, history_window=1, max_turns=6, max_new_tokens=3, max_context_tokens=400,
                        summary_threshold=120, summary_max_tokens=6, max_summaries=10)
    engine = inline_engine(any_policy, "test-echo", cfg, 3, episode_len=5, max_obs_words=12)
    engine.memory = EpisodicMemory(MemoryConfig(enabled=True, max_tokens=40), "test-echo",
                                   [_entry("m", ALL_WORDS, ("up", "down") * 20)])  # every observation shares a word
    block = engine._memory_ids("the box")
    chat = any_policy.chat
    assert 0 < len(block) <= 40 and block[-len(engine.marker):] == engine.marker  # cut to memory.max_tokens, marked
    reqs = [EpisodeRequest(engine.env.task("train", i), i, "g", f"t{i}") for i in range(3)]
    trajs, stats = engine.play(reqs, PolicyActor(any_policy, 3, 1.0, torch.Generator().manual_seed(0)))
    assert stats.memory_recalls == 3 and stats.memory_tokens == 3 * len(block)
    head, _ = chat.start(engine.prompt.system, engine.prompt.tools, engine.prompt.examples, engine.prompt.observation_role)
    samples = [x for t in trajs for x in t.samples]
    assert all(t.memory_tokens == len(block) for t in trajs) and len(samples) >= 3
    for x in samples:  # every window / segment / episode starts with the template's head and the block, all context
        start = tuple(x.token_ids[: len(head) + len(block)].tolist())
        assert start == tuple(head) + block
        assert not x.loss_mask[: len(head) + len(block)].any()
        assert (x.memory_start, x.memory_tokens) == (len(head), len(block))  # the span the store and the viewer show
    write_trajectories(tmp_path / "t.parquet", trajs, stage="rl", iteration=0)
    rows = read_trajectories(tmp_path / "t.parquet").to_pylist()
    assert [(r["memory_start"], r["memory_tokens"]) for r in rows] == [(len(head), len(block))] * len(samples)
    assert all(tuple(r["token_ids"][r["memory_start"]: r["memory_start"] + r["memory_tokens"]]) == block for r in rows)
    assert_rescores(any_policy, samples)


def test_an_empty_memory_changes_nothing(tiny_policy):
    cfg = RolloutConfig(context="window", history_window=1, max_turns=4, max_new_tokens=3, max_context_tokens=300)
    reqs = lambda engine: [EpisodeRequest(engine.env.task("train", i), i, "g", f"t{i}") for i in range(2)]  # noqa: E731
    plain = inline_engine(tiny_policy, "test-echo", cfg, 2, episode_len=3)
    with_memory = inline_engine(tiny_policy, "test-echo", cfg, 2, episode_len=3)
    with_memory.memory = EpisodicMemory(MemoryConfig(enabled=True), "test-echo")
    a, _ = plain.play(reqs(plain), PolicyActor(tiny_policy, 3, 1.0, torch.Generator().manual_seed(1)))
    b, stats = with_memory.play(reqs(with_memory), PolicyActor(tiny_policy, 3, 1.0, torch.Generator().manual_seed(1)))
    assert stats.memory_recalls == 0 and not any(x.memory_tokens for t in b for x in t.samples)
    assert [x.token_ids.tolist() for t in a for x in t.samples] == [x.token_ids.tolist() for t in b for x in t.samples]


def test_state_and_the_parquet_file_round_trip(tmp_path):
    cfg = MemoryConfig(enabled=True)
    mem = EpisodicMemory(cfg, "test-echo", [_entry("a", "x", ("up", "down")), _entry("b", "y")])
    assert EpisodicMemory.from_state(cfg, "test-echo", mem.state()).entries == mem.entries
    mem.write(RunDir(tmp_path).memory)
    stored = read_store(MemoryConfig(enabled=True, store=str(tmp_path)), "test-echo")
    assert stored.frozen and stored.entries == mem.entries


def test_store_checks_name_the_problem(tmp_path):
    cfg = MemoryConfig(enabled=True, store=str(tmp_path))
    with pytest.raises(UserError, match=r"memory.store=.*: no memory.parquet there"):
        read_store(cfg, "test-echo")
    EpisodicMemory(cfg, "test-echo").write(RunDir(tmp_path).memory)
    with pytest.raises(UserError, match="its memory is empty"):
        read_store(cfg, "test-echo")
    EpisodicMemory(cfg, "sokoban", [_entry("a", "x")]).write(RunDir(tmp_path).memory)
    with pytest.raises(UserError, match="remembers env sokoban, not 'test-echo'"):
        read_store(cfg, "test-echo")
    RunDir(tmp_path).memory.write_text("not parquet")
    with pytest.raises(UserError, match="is not a memory file"):
        read_store(cfg, "test-echo")
