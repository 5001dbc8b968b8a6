"""The rollout engine reproduces the removed lock-step runner token for token.

``golden_format.SCENARIOS`` were played by ``turnforge.rollout.runner.rollout`` (commit
d0f023c, ``tests/golden/freeze_runner.py`` there) and recorded; here the same scenarios are
played by ``RolloutEngine.play``. ``test_training_run`` does the same for a short BC -> GRPO run
of the default recipe: evaluations, per-iteration figures, every trajectory file's columns and
the final weights.

What must be equal and what may differ (``golden_format``): every discrete output (token ids,
loss masks, texts, actions, rewards, turn counts, versions, which tasks, evaluations) is
exact on any CPU; float outputs (sampling logprobs, losses, advantages, weights) are compared
within float32 tolerances measured across ATen's kernel paths and thread counts, because the
last bits of a float32 sum depend on the CPU's vector width and the order the kernel adds in
(one ulp of a logprob is the usual difference between an AMD and an Intel CPU). Bit-for-bit
determinism is still checked where it is promised, on one machine: the same run twice here,
and a resumed run against an uninterrupted one (tests/e2e/test_train_tiny.py).

The trajectory files are the runner's record, unchanged. ``train.json.gz`` was re-recorded on
2026-11-25, when the trainer began scoring only action positions (sampling logprobs moved by at
most 7.6e-6, the sampled tokens not at all), and on 2026-11-28 in today's format (float columns
as values instead of one digest with the token columns), from the same run on the same machine,
with the same discrete content.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from golden_format import (  # noqa: E402
    SCENARIOS,
    TRAIN_OVERRIDES,
    assert_run_matches,
    assert_trajectories_match,
    largest_float_difference,
    record_run,
    record_trajectories,
)

from turnforge.app.config import load_config
from turnforge.config import RolloutConfig
from turnforge.envpool import InlineEnvs, make_backend  # noqa: E402
from turnforge.envs import make  # noqa: E402
from turnforge.rollout.actors import ExpertActor, PolicyActor  # noqa: E402
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine  # noqa: E402
from turnforge.seeding import stable_hash  # noqa: E402
from turnforge.train.evaluate import evaluate  # noqa: E402

#: Threads of the sampling and training below: 1, as the files were recorded; the kernel-path
#: matrix (benchmarks/kernel_matrix.py) also runs them with 2.
THREADS = int(os.environ.get("TURNFORGE_GOLDEN_THREADS", "1"))


def _report(name: str, got, want) -> None:
    """With ``TURNFORGE_GOLDEN_REPORT=FILE`` (the kernel-path matrix), append whether ``got``
    equals the stored record bit for bit and its largest float difference (weights apart: for a
    run, the largest weight-fingerprint difference as a share of its tensor's norm)."""
    path = os.environ.get("TURNFORGE_GOLDEN_REPORT")
    if not path:
        return
    line = {"name": name, "bitwise": got == want}
    if isinstance(want, dict) and "weights" in want:
        line["weights_share_of_norm"] = max(abs(g - w) / ws[1] for n, ws in want["weights"].items()
                                            for g, w in zip(got["weights"][n], ws))
        got, want = {k: v for k, v in got.items() if k != "weights"}, {k: v for k, v in want.items() if k != "weights"}
    line["largest_float_difference"] = largest_float_difference(got, want)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _golden(name: str):
    with gzip.open(HERE / f"{name}.json.gz", "rt") as f:
        return json.load(f)


def play_new(policy, name: str, backend=None):
    sc = SCENARIOS[name]
    cfg = RolloutConfig(**sc["rollout"])
    kwargs = sc.get("env_kwargs", {})
    engine = RolloutEngine(backend or InlineEnvs(sc["env"], sc["num_envs"], kwargs), cfg, policy, make(sc["env"], **kwargs))
    env = engine.env
    if sc["kind"] == "evaluate":
        return evaluate(engine, policy, episodes=sc["episodes"], split=sc["split"], temperature=sc["temperature"],
                        seed=sc["seed"])[1]
    if sc["kind"] == "demos":
        reqs = [EpisodeRequest(env.task("train", i), stable_hash(sc["seed"], "demo", i), f"demo-{i}", f"demo-{i}")
                for i in range(sc["episodes"])]
        return engine.play(reqs, ExpertActor(sc["noise"], sc["seed"], env.action_names))[0]
    gen = torch.Generator().manual_seed(sc["seed"])
    actor = PolicyActor(policy, cfg.max_new_tokens, 1.0, gen)
    reqs = [EpisodeRequest(env.task("train", i), i, f"g{i // 2}", f"t{i}") for i in range(sc["episodes"])]
    first, _ = engine.play(reqs, actor, keep_snapshots=True)
    reqs2 = [EpisodeRequest(t.task, -1, f"s{t.group_id}", f"from-{t.trajectory_id}", start=t.snapshots[1], max_turns=3)
             for t in first if len(t.snapshots) > 1]
    second, _ = engine.play(reqs2, actor, keep_snapshots=True)
    return first + second


@pytest.fixture(scope="module")
def golden_policy(tiny_model_dir):
    from turnforge.policy.model import load_policy

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield load_policy(tiny_model_dir)
    torch.set_num_threads(threads)


#: Scenarios whose env gained ``potential()`` after the files were frozen (the runner recorded
#: 0.0 for an env without one): FrozenLake, 2026-11-25. Their potential fields are checked
#: against the env's own values, everything else against the file.
GAINED_POTENTIAL = {"snapshots_frozenlake_slippery"}


def _without_potentials(trajs: list[dict]) -> list[dict]:
    return [{**t, "turns": [{k: v for k, v in x.items() if k not in ("potential", "next_potential")} for x in t["turns"]]}
            for t in trajs]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_engine_reproduces_runner(golden_policy, name):
    got, want = record_trajectories(play_new(golden_policy, name)), _golden(name)
    if name in GAINED_POTENTIAL:
        assert all(x["potential"] == x["next_potential"] == 0.0 for t in want for x in t["turns"])
        assert all(0 < x["potential"] <= 1 for t in got for x in t["turns"])  # 1 - (safe moves to the goal) / 16
        got, want = _without_potentials(got), _without_potentials(want)
    _report(name, got, want)
    assert_trajectories_match(got, want)


def test_engine_on_worker_processes_reproduces_runner(golden_policy):
    """The same tokens when the envs run in EnvPool worker processes (lock-step rounds do not
    depend on which env answers first)."""
    name = "eval_sokoban_window"
    from turnforge.config import EngineConfig

    sc = SCENARIOS[name]
    backend = make_backend(sc["env"], {}, sc["num_envs"], EngineConfig(env_workers=2))
    try:
        got, want = record_trajectories(play_new(golden_policy, name, backend)), _golden(name)
        _report(f"{name} on worker processes", got, want)
        assert_trajectories_match(got, want)
    finally:
        backend.close()


def _train(path: Path) -> dict:
    threads = torch.get_num_threads()
    try:
        from turnforge.app.run import train

        train(load_config("sokoban-tiny", [*TRAIN_OVERRIDES, f"threads={THREADS}"]), path, live=False)
    finally:
        torch.set_num_threads(threads)
    return record_run(path)


@pytest.mark.slow
def test_training_run(tmp_path):
    got, want = _train(tmp_path / "run"), _golden("train")
    _report("train", got, want)
    assert_run_matches(got, want)
    # on one machine the same run repeats bit for bit: every float, every weight
    assert _train(tmp_path / "again") == got
    # pass@k ran at the start and the end (TRAIN_OVERRIDES) and moved none of the figures above
    from turnforge.train.metrics import read_summary

    summary = read_summary(tmp_path / "run")
    assert summary.boundary_start is not None and summary.boundary_after is not None
    assert summary.boundary_after.episodes == 16 * 8 and [p.k for p in summary.boundary_after.pass_at_k] == [1, 2, 4, 8]
