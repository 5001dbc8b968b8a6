"""A vision-language run end to end: gui-click-tiny's BC and GRPO on screenshots, images in the
Parquet, the checkpoint a VLM with its processor, and an interrupted run resumed exactly."""

from __future__ import annotations

import hashlib

import pyarrow.parquet as pq
import pytest
import torch
from helpers import NO_FLYWHEEL, TINY_TEST_SHAPE, assert_rescores

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.app.setup import load_run_config
from turnforge.train.metrics import read_summary

pytestmark = pytest.mark.slow

FAST = [
    *[f"model.tiny.{k}={v}" for k, v in TINY_TEST_SHAPE.items()], *NO_FLYWHEEL,
    "model.tiny.vision.image_size=56", "model.tiny.vision.hidden_size=32", "model.tiny.vision.intermediate_size=64",
    "model.tiny.corpus_episodes=20", "env.kwargs.size=64",
    "bc.num_demos=8", "bc.epochs=1", "bc.batch_size=8",
    "rl.iterations=3", "rl.tasks_per_iteration=2", "rl.group_size=2", "rl.minibatch_size=16",
    "eval.episodes=4", "eval.every=0", "checkpoint_every=1",
]


def sha(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def assert_final_rescores(cfg, final) -> None:
    """Three held-out episodes the final policy plays re-score token-exactly under it (images included)."""
    from turnforge.rollout.actors import PolicyActor
    from turnforge.rollout.engine import EpisodeRequest, make_engine

    engine = make_engine(cfg, final)
    try:
        reqs = [EpisodeRequest(engine.env.task("heldout", i), i, f"g{i}", f"t{i}") for i in range(3)]
        trajs, _ = engine.play(reqs, PolicyActor(final, cfg.rollout.max_new_tokens, 1.0, torch.Generator().manual_seed(0)))
    finally:
        engine.close()
    assert_rescores(final, [s for t in trajs for s in t.samples], atol=1e-4)


def test_gui_click_tiny_trains_on_images_and_resumes_exactly(tmp_path):
    from turnforge.data.store import read_image
    from turnforge.policy.model import load_policy

    ref = tmp_path / "ref"
    summary = train(load_config("gui-click-tiny", FAST), ref, live=False)
    assert summary.rl_iterations == 3 and summary.env_steps > 0
    (click,) = read_summary(ref).eval_after_rl.by_label  # success per task label, through summary.json
    assert click.label == "click" and click.episodes == 4
    rl = sorted((ref / "trajectories").glob("rl_*.parquet"))[0]
    rows = [r for r in pq.read_table(rl).to_pylist() if r["token_ids"] is not None]
    assert rows and all(len(r["image_sha256"]) == 1 for r in rows)  # window 0: the screenshot of its turn
    assert all(hashlib.sha256(read_image(rl, k)).hexdigest() == k for r in rows for k in r["image_sha256"])

    final = load_policy(ref / "checkpoints" / "final")
    assert final.vision is not None  # the processor was saved with the weights
    cfg = load_config("gui-click-tiny", FAST)
    assert_final_rescores(cfg, final)

    out = tmp_path / "run"
    train(load_config("gui-click-tiny", FAST), out, live=False, stop_after=2)
    train(load_run_config(out), out, resume=True, live=False)
    assert sha(out / "checkpoints" / "final") == sha(ref / "checkpoints" / "final")
    assert read_summary(out).eval_after_rl == read_summary(ref).eval_after_rl


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (model.device=cuda); this machine's torch sees none")
def test_gui_click_tiny_trains_on_a_gpu(tmp_path):
    """BC and GRPO with ``model.device=cuda``: the run ends, its checkpoint loads, and what the final
    policy samples on the GPU re-scores token-exactly there."""
    from turnforge.policy.model import load_policy

    cfg = load_config("gui-click-tiny", [*FAST, "model.device=cuda"])
    summary = train(cfg, tmp_path / "run", live=False)
    assert summary.rl_iterations == 3 and summary.env_steps > 0
    final = load_policy(tmp_path / "run" / "checkpoints" / "final", device="cuda")
    assert_final_rescores(cfg, final)
