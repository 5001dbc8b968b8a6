"""``model.device``: the name resolved (``resolve_device``); and on a CUDA GPU (skipped elsewhere,
with the reason) the policy's sampled logprobs re-score token-exactly there, with the prefix
cache on and off, and the trainer's scoring (inputs on the CPU, the forward on the GPU) gives
the same logprobs and a gradient on the GPU's weights. Bad names and a GPU asked for where
there is none: tests/test_bad_input.py."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rescores, play
from turnforge.config import RolloutConfig
from turnforge.errors import UserError
from turnforge.policy.model import load_policy, resolve_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (model.device=cuda); this machine's torch sees none")


def test_device_names_resolve():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="sees no CUDA GPU; valid here: 'cpu', 'auto'"):
            resolve_device("cuda")
    else:
        with pytest.raises(UserError, match="CUDA GPU"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def _episodes(policy, prefix_cache: bool):
    policy.prefix_cache = prefix_cache
    return play(policy, "frozenlake", RolloutConfig(context="full_history", max_turns=4, max_new_tokens=6, max_context_tokens=1024))


@needs_cuda
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_sampling_on_a_gpu_rescores_token_exactly(tiny_model_dir, prefix_cache):
    policy = load_policy(tiny_model_dir, device="cuda")
    assert policy.device.type == "cuda"
    samples = _episodes(policy, prefix_cache)
    assert samples and any(s.loss_mask.sum() > 0 for s in samples)
    assert_rescores(policy, samples, atol=1e-4)


@needs_cuda
def test_the_trainers_scoring_runs_on_the_gpu_and_matches_the_cpu(tiny_model_dir):
    from turnforge.train.common import collate
    from turnforge.policy.generate import token_logprobs

    gpu, cpu = load_policy(tiny_model_dir, device="cuda"), load_policy(tiny_model_dir)
    samples = _episodes(cpu, prefix_cache=False)
    batch = collate(samples, cpu.pad_id)  # CPU tensors, as the trainers build them
    on_cpu, _ = token_logprobs(cpu.model, batch.ids, batch.attention, positions=batch.mask)
    on_gpu, ent = token_logprobs(gpu.model, batch.ids, batch.attention, with_entropy=True, positions=batch.mask)
    assert on_gpu.device.type == "cpu" and ent.device.type == "cpu"  # back on the inputs' device
    torch.testing.assert_close(on_gpu, on_cpu, atol=1e-4, rtol=0)
    (-(on_gpu * batch.mask).sum()).backward()
    grads = [p.grad for p in gpu.model.parameters() if p.grad is not None]
    assert grads and all(g.device.type == "cuda" and torch.isfinite(g).all() for g in grads)
