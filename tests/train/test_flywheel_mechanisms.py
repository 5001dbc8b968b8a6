"""The flywheel's mechanisms (``turnforge.train.mechanisms``): what the registry derives, and two
rounds of collection and routing on a fake engine whose episodes are hand-built (who plays what,
in which order, what is left unsolved, what each mechanism keeps and records). A mechanism
registered in one test only shows that adding one is one class: the config, the start checks,
the round and ``metrics.jsonl`` take it without another edit."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from turnforge.app.config import load_config
from turnforge.errors import UserError
from turnforge.rollout.engine import RolloutStats
from turnforge.train.flywheel import Collection, collect, mechanism_records, route
from turnforge.train.mechanisms import MECHANISMS, MEMORY_SOURCES, SOURCES, Mechanism, MechanismRecord, enabled
from turnforge.train.metrics import FlywheelRound, from_json, to_json
from turnforge.types import EnvSnapshot, EvalResult, Task, Trajectory, Turn

FAST = ["flywheel.rounds=2", "flywheel.tasks_per_wave=4", "flywheel.group_size=2", "flywheel.allocation=uniform",
        "flywheel.retry_rollouts=2", "flywheel.env_steps_per_round=40", "flywheel.filters=[infra,success]",
        "flywheel.replay_max_success=0.5", "flywheel.evolve_per_task=2", "flywheel.curriculum_rollouts=2",
        "flywheel.anchor_rollouts=1", "flywheel.anchor_start=0.5"]


class FakeEnv:
    """Train task ``n`` is the ``n``-th asked for (1, 2, ...); a derived task of task ``i`` is ``100 + 10 i + k``."""

    env_id = "fake"

    def __init__(self) -> None:
        self.asked = 0

    def task(self, split: str, index: int) -> Task:
        self.asked += 1
        return Task("fake", split, self.asked)

    def derive_tasks(self, task: Task, n: int, seed: int) -> list[Task]:
        return [Task("fake", "train", 100 + 10 * task.index + k) for k in range(n)]


def wins(tag: str, index: int, g: int) -> bool:
    """Who succeeds. Plain ('p'): tasks 1, 5, ... always, tasks 2, 6, ... on their first rollout only;
    retry ('r'): tasks 3, 7, ...; tasks 4, 8, ... never (nor from an anchor state, 'a'); the expert
    ('ax'), curriculum starts ('c') and derived tasks (100 and up) always."""
    if tag in ("ax", "c") or index >= 100:
        return True
    return {"p": index % 4 == 1 or (index % 4 == 2 and g == 0), "r": index % 4 == 3}.get(tag, False)


class FakeEngine:
    """Plays each request as an episode of 2 turns (the expert's: 3), its outcome by ``wins``,
    with one snapshot per turn when asked; notes each call's (source tag, trajectory ids)."""

    def __init__(self) -> None:
        self.env, self.caps, self.calls = FakeEnv(), SimpleNamespace(reseed=False), []

    def play(self, requests, actor, keep_snapshots=False):
        trajs = [self._episode(req, keep_snapshots) for req in requests]
        self.calls.append([req.trajectory_id for req in requests])
        return trajs, RolloutStats(len(trajs), sum(t.num_turns for t in trajs), 0, 0, 0, 0, 0, 0)

    def _episode(self, req, keep_snapshots) -> Trajectory:
        tag, g = req.trajectory_id.split("-")[0], int(req.trajectory_id.rsplit("-", 1)[1]) if req.trajectory_id.count("-") > 2 else 0
        n = 3 if tag == "ax" else 2
        success = wins(tag, req.task.index, g)
        snaps = tuple(EnvSnapshot("fake", (req.task.index, k)) for k in range(n)) if keep_snapshots else ()
        turns = tuple(Turn("o", "a", 0.0, False, "") for _ in range(n))
        return Trajectory(req.trajectory_id, req.task, req.group_id, req.env_seed, turns, (), float(success), success, True,
                          False, None, 0, snapshots=snaps)


def play_round(cfg, engine, mechs, r):
    """Steps 1 to 3 of round ``r`` (collect, after collection, filter and route), as ``_round`` runs them."""
    col = Collection(cfg, r, engine, SimpleNamespace(kv_cache_gib=None, prefix_cache=False),
                     any(m.keeps_snapshots for m in mechs), lambda done: None)
    plain, unsolved = collect(col, mechs, None)
    for m in mechs:
        m.after_collection(col, plain, unsolved)
    rate = {k: sum(t.success for t in v) / len(v) for k, v in plain.items()}
    kept, counts, replayed = route(col.played, [c for m in mechs for c in m.candidates(col)], mechs, rate, cfg)
    return col, plain, unsolved, kept, counts, replayed


def sources_in_order(col) -> list[str]:
    """The sources of the round's episodes, runs of one source collapsed."""
    out = []
    for _, src in col.played:
        if not out or out[-1] != src:
            out.append(src)
    return out


def task_ids(tasks) -> list[int]:
    return [t.index for t in tasks]


def test_the_registry_is_the_one_list_of_mechanisms_and_sources():
    assert list(MECHANISMS) == ["retry", "guidance", "curriculum", "anchor", "evolve", "selfplay", "replay", "keep", "negatives"]
    assert SOURCES == ("demo", "plain", "retry", "guided", "curriculum", "anchor", "evolved", "injected", "kept")
    assert MEMORY_SOURCES == ("demo", "plain", "retry", "curriculum", "anchor", "evolved", "injected", "kept")  # hinted episodes are not recalled
    assert [cls.name for cls in enabled(["replay", "retry", "anchor"])] == ["retry", "anchor", "replay"]  # registry order
    with pytest.raises(UserError, match=r"unknown name 'bogus'; valid: retry, guidance, curriculum, anchor, evolve, selfplay, replay, keep, negatives"):
        load_config("sokoban-tiny", ["flywheel.mechanisms=[bogus]"])


def test_two_rounds_on_a_fake_engine_route_every_episode_to_its_mechanism():
    cfg = load_config("sokoban-tiny", [*FAST, "flywheel.mechanisms=[replay,evolve,curriculum,anchor,retry]"])
    engine = FakeEngine()
    mechs = [cls(cfg) for cls in enabled(cfg.flywheel.mechanisms)]
    by = {m.name: m for m in mechs}

    # round 1: nothing carried yet. Two waves (2 episodes x 4 tasks x 2 turns + 2 retries of tasks 3 and 4
    # = 24 steps, under the budget of 40 after one wave, over it after two)
    col, plain, unsolved, kept, counts, replayed = play_round(cfg, engine, mechs, 0)
    assert sources_in_order(col) == ["plain", "retry", "plain", "retry"] and col.steps == 48
    assert sorted(int(k.rsplit(":", 1)[1]) for k in plain) == list(range(1, 9))
    assert [c[0].split("-")[0] for c in engine.calls] == ["p", "r", "p", "r"]
    assert {t.split("-")[2] for t in engine.calls[1]} == {"fake:train:3", "fake:train:4"}  # retried: no plain success
    assert task_ids(unsolved) == [4, 8]  # retry solved 3 and 7
    assert [c.name for c in counts] == ["infra", "success"] and counts[0].episodes_in == 16 + 8
    assert replayed == []  # the buffer was empty before the round
    # successes on hard tasks (plain success <= 0.5): 2 and 6 (1 of 2 plain), 3 and 7 (retried; plain 0)
    assert [(c.trajectory.task.index, c.source) for c in by["replay"].state.buffer] == [
        (2, "plain"), (3, "retry"), (3, "retry"), (6, "plain"), (7, "retry"), (7, "retry")]
    assert [(t.index, len(s)) for t, s in by["curriculum"].state.starts] == [(2, 2), (6, 2)]  # plain ones only
    assert sorted(by["evolve"].state.tasks) == [f"fake:train:{i}" for i in (140, 141, 180, 181)]  # from 4 and 8
    assert task_ids(by["anchor"].state.waiting) == [4, 8]  # to the expert next round
    records = mechanism_records(col, mechs)
    assert records == {
        "retry": MechanismRecord((8, 4)),
        "curriculum": MECHANISMS["curriculum"].Record((0, 0), depth=1, success=None),
        "anchor": MECHANISMS["anchor"].Record((0, 0), live=0, graduated=0, dropped=0, expert_share=None),
        "evolve": MECHANISMS["evolve"].Record((0, 0), live=4, retired=0),
        "replay": MECHANISMS["replay"].Record(None, size=6),
    }

    # round 2: the curriculum's starts (4 episodes, 8 steps), the expert's solutions of tasks 4 and 8 (6 steps),
    # one anchored task (the most whose worst case fits half the budget: 40 // (2 x 1 x 15)), then the
    # derived tasks as the first wave (16 steps: 32 so far) and one wave of fresh tasks 9 to 12 (with retries: 56)
    col, plain, unsolved, kept, counts, replayed = play_round(cfg, engine, mechs, 1)
    assert sources_in_order(col) == ["curriculum", "demo", "anchor", "evolved", "plain", "retry"] and col.steps == 56
    assert [(c.trajectory.task.index, c.source) for c in replayed] == [
        (2, "plain"), (3, "retry"), (3, "retry"), (6, "plain"), (7, "retry"), (7, "retry")]  # round 1's, trained on again
    assert [c.source for c in kept] == ["curriculum"] * 4 + ["evolved"] * 8 + ["plain"] * 3 + ["retry"] * 2  # no 'demo'
    assert task_ids(unsolved) == [12]
    r = mechanism_records(col, mechs)
    assert r["curriculum"] == MECHANISMS["curriculum"].Record((4, 4), depth=2, success=1.0)  # reached curriculum_advance
    assert r["anchor"] == MECHANISMS["anchor"].Record((1, 0), live=2, graduated=0, dropped=0, expert_share=2 / 3)
    assert by["anchor"].expert_use().moves == 6 and by["anchor"].state.anchors[_id(4)].misses == 1  # stuck at the most help
    assert r["evolve"] == MECHANISMS["evolve"].Record((8, 8), live=2, retired=4)  # all solved: retired; 12's two derived
    # task 10 (plain 1 of 2) and 11 (retried) join the buffer; curriculum successes (from near the end of an earlier
    # success) and derived tasks (plain success 1) do not
    assert [(c.trajectory.task.index, c.source) for c in by["replay"].state.buffer[6:]] == [(10, "plain"), (11, "retry"), (11, "retry")]
    assert r["replay"] == MECHANISMS["replay"].Record(None, size=9)


def _id(i: int) -> str:
    return f"fake:train:{i}"


class NoOp(Mechanism):
    """Does nothing, and notes which hooks the round called, in order."""

    name, help = "noop", "does nothing (a test's)"
    calls: list[str] = []

    @classmethod
    def requirements(cls, cfg):
        return [cls.needs("expert_summary", "the no-op mechanism")]

    @classmethod
    def conflict(cls, cfg):
        return "noop needs flywheel.group_size >= 2" if cfg.flywheel.group_size < 2 else None

    def begin(self, col):
        self.calls.append("begin")

    def first_wave(self, col):
        self.calls.append("first_wave")
        return []

    def after_wave(self, col, failed):
        self.calls.append("after_wave")
        return failed

    def after_collection(self, col, plain, unsolved):
        self.calls.append("after_collection")

    def candidates(self, col):
        self.calls.append("candidates")
        return []

    def route(self, hard):
        self.calls.append("route")
        return []


def test_a_mechanism_is_one_class(monkeypatch):
    from turnforge.envs.registry import make
    from turnforge.train.checks import check_options

    monkeypatch.setitem(MECHANISMS, NoOp.name, NoOp)
    monkeypatch.setattr(NoOp, "calls", [])
    cfg = load_config("sokoban-tiny", [*FAST, "flywheel.mechanisms=[noop,replay]"])  # the config knows it
    with pytest.raises(UserError, match=r"^invalid config: noop needs flywheel.group_size >= 2$"):  # its own rule
        load_config("sokoban-tiny", [*FAST, "flywheel.mechanisms=[noop]", "flywheel.group_size=1"])
    with pytest.raises(UserError, match=r"^the no-op mechanism \(flywheel.mechanisms has noop\) needs env 'sokoban' to "
                                        r"implement expert_summary\(\), or drop noop from flywheel.mechanisms$"):  # its requirement, at start
        check_options(cfg, make("sokoban", **cfg.env.kwargs))

    mechs = [cls(cfg) for cls in enabled(cfg.flywheel.mechanisms)]
    assert [m.name for m in mechs] == ["replay", "noop"]
    col = play_round(cfg, FakeEngine(), mechs, 0)[0]
    assert NoOp.calls == ["begin", "first_wave", *["after_wave"] * 3, "after_collection", "candidates", "route"]  # 3 waves of 16 steps
    # its record goes through metrics.jsonl and back
    record = FlywheelRound(1, col.steps, 8, col.count("plain"), 2, [], 0, None, EvalResult("fake", "heldout", 1, 0.0, 0.0, 0.0, 1.0),
                           0.0, mechanisms=mechanism_records(col, mechs))
    assert record.mechanisms["noop"] == MechanismRecord(None)
    assert from_json(FlywheelRound, json.loads(json.dumps(to_json(record)))) == record


def test_a_record_of_an_unknown_mechanism_is_an_error():
    data = {"episodes": None}
    with pytest.raises(ValueError, match=r"no flywheel mechanism 'gone' \(mechanisms: retry, guidance, "):
        from_json(dict[str, MechanismRecord], {"gone": data})


def _inject_episode(tid: str, seed: str, module: str | None, success: bool) -> Trajectory:
    info = {"injected_module": module} if module else {}
    task = Task("terminal", "train", 7, {"source": "inject", "seed": seed, "variant": 0})
    return Trajectory(tid, task, "g", 0, (Turn("obs", "submit", float(success), False, "", info=info),), (),
                      float(success), success, True, False, None, 0)


def test_selfplay_turns_valid_injected_bugs_into_repair_tasks_and_retires_solved_ones():
    from turnforge.config import TrainConfig
    from turnforge.train.mechanisms.selfplay import SelfPlay

    cfg = TrainConfig.model_validate({"flywheel": {"tasks_per_wave": 8, "evolve_pool": 3}})
    mech = SelfPlay(cfg)
    plain = {"a": [_inject_episode("1", "clamp", "def clamp(x, lo, hi):\n    return lo\n", True),
                   _inject_episode("2", "clamp", None, False),  # no valid bug: nothing to harvest
                   _inject_episode("3", "clamp", "def clamp(x, lo, hi):\n    return lo\n", True)]}  # the same bug once
    mech.after_collection(None, plain, [])
    (task,) = [t for t, _ in mech.state.tasks.values()]
    assert task.data == {"source": "injected", "seed": "clamp", "module": "def clamp(x, lo, hi):\n    return lo\n"}
    assert mech.first_wave(SimpleNamespace(r=1)) == [task] and mech.record((0, 0)).harvested == 1
    won = Trajectory("r", task, "g", 0, (), (), 1.0, True, True, False, None, 0)
    mech.after_collection(None, {task.task_id: [won, won]}, [])  # solved by every rollout: retired
    assert not mech.state.tasks and mech.record((2, 2)).retired == 1


def test_selfplay_needs_the_terminal_envs_selfplay_source():
    with pytest.raises(UserError, match="selfplay, which repairs the bugs the policy injects; it needs env terminal"):
        from turnforge.app.rules import check_run
        from turnforge.envs import make

        cfg = load_config("sokoban-tiny", ["flywheel.mechanisms=[selfplay]"])
        check_run(cfg, make("sokoban"))
