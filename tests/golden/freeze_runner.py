"""Freeze the outputs of the lock-step runner (``turnforge.rollout.runner.rollout``, removed in
the one-engine refactor) as golden files: ``python tests/golden/freeze_runner.py``.

Each scenario plays episodes with the tiny test model (``conftest.TINY_TEST_SHAPE``) and
records every trajectory token for token; ``train.json.gz`` records a short training run
(BC -> GRPO) end to end. ``tests/golden/test_golden.py`` replays the same scenarios on the
rollout engine and asserts identical outputs. This script ran once, at the commit that
added the golden files, against the old runner.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import conftest  # noqa: E402  (registers test-echo, sets threads)

from turnforge.config import RolloutConfig, load_config  # noqa: E402
from turnforge.envs import make_batch  # noqa: E402
from turnforge.envs.base import stable_hash  # noqa: E402
from turnforge.policy.model import load_policy  # noqa: E402
from turnforge.policy.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from turnforge.rollout.runner import EpisodeRequest, ExpertActor, PolicyActor, rollout  # noqa: E402
from turnforge.train.evaluate import evaluate  # noqa: E402

from golden_format import SCENARIOS, record_run, record_trajectories  # noqa: E402


def play_old(policy, name: str):
    sc = SCENARIOS[name]
    cfg = RolloutConfig(**sc["rollout"])
    envs = make_batch(sc["env"], sc["num_envs"], **sc.get("env_kwargs", {}))
    kind = sc["kind"]
    if kind == "evaluate":
        _, trajs = evaluate(policy, envs, cfg, episodes=sc["episodes"], split=sc["split"],
                            temperature=sc["temperature"], seed=sc["seed"])
        return trajs
    if kind == "demos":
        actor = ExpertActor(policy, sc["noise"], seed=sc["seed"])
        out = []
        for start in range(0, sc["episodes"], len(envs)):
            reqs = [EpisodeRequest(envs[0].task("train", i), stable_hash(sc["seed"], "demo", i), f"demo-{i}", f"demo-{i}")
                    for i in range(start, min(sc["episodes"], start + len(envs)))]
            out.extend(rollout(actor, envs, reqs, cfg, policy)[0])
        return out
    if kind == "snapshots":
        gen = torch.Generator().manual_seed(sc["seed"])
        actor = PolicyActor(policy, cfg.max_new_tokens, 1.0, gen)
        reqs = [EpisodeRequest(envs[0].task("train", i), i, f"g{i // 2}", f"t{i}") for i in range(sc["episodes"])]
        first, _ = rollout(actor, envs, reqs, cfg, policy, keep_snapshots=True)
        starts = [(t, t.snapshots[1]) for t in first if len(t.snapshots) > 1]
        reqs2 = [EpisodeRequest(t.task, -1, f"s{t.group_id}", f"from-{t.trajectory_id}", start=snap, max_turns=3)
                 for t, snap in starts]
        second, _ = rollout(actor, envs, reqs2, cfg, policy, keep_snapshots=True)
        return first + second
    raise ValueError(kind)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        build_tiny_model(model_dir, TinyModelConfig(**conftest.TINY_TEST_SHAPE))
        policy = load_policy(model_dir)
        for name in SCENARIOS:
            data = record_trajectories(play_old(policy, name))
            with gzip.open(HERE / f"{name}.json.gz", "wt") as f:
                json.dump(data, f)
            print(name, len(data), "trajectories")
        run = Path(tmp) / "run"
        from turnforge.train.run import train

        from golden_format import TRAIN_OVERRIDES
        train(load_config("sokoban-tiny", TRAIN_OVERRIDES), run, live=False)
        with gzip.open(HERE / "train.json.gz", "wt") as f:
            json.dump(record_run(run), f)
        print("train run recorded")


if __name__ == "__main__":
    main()
