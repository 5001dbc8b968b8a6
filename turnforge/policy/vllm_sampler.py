"""Rollouts through vLLM's offline engine (``rollout.backend=vllm``).

``VLLMSampler`` holds one ``vllm.LLM`` in this process (the CPU build here, the CUDA build
on GPUs) and is what a ``PolicyActor`` samples with when ``Policy.sampler`` is set. The
contract is the built-in sampler's (``turnforge.policy.generate.sample``): token-id prompts
in, per prompt the sampled ids and the log-probability of each under the distribution it was
drawn from (softmax of logits / temperature: vLLM's ``processed_logprobs``). Nothing is
decoded and re-encoded; vLLM runs without its tokenizer.

Weights: before each generation call the sampler compares the policy it is asked to sample
(its model object and version) with what it loaded last; on a change it loads the trainer's
weights into the running engine in place (vLLM's ``reload_weights``; LoRA adapters are
merged into a copy first) and drops vLLM's prefix cache. No restart, no file round-trip.

The trainer re-scores every sample with its own forward pass, so the gap between vLLM's
numerics and the trainer's is measured per iteration (``log_ratio_abs_*``, the
``|logp_vllm - logp_trainer|`` of ``OffPolicyStats`` in metrics.jsonl) and corrected by the decoupled loss's off-policy correction (engine.correction, truncated IS by default), the
same correction asynchronous rollouts use (``turnforge.train.update.ppo_update``).

Departures from the built-in sampler:
- Draws come from vLLM's generator, seeded once with ``LLM(seed=)`` (the CPU build ignores
  per-request seeds), not from turnforge's per-iteration generators: a resumed run does not
  replay the draws an uninterrupted run would have made (whether two whole runs repeat bit for
  bit was not checked). ``rollout.temperature`` is all there is (no top-p / top-k, as with the
  built-in sampler).
- vLLM keeps its own prefix cache (``enable_prefix_caching``), so ``rollout.prefix_cache``
  does not apply.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Sequence

import torch

from turnforge.errors import UserError
from turnforge.policy.generate import Generation

INSTALL_HINT = "see the README's `make test-vllm` (vLLM's CPU build needs a venv of its own: transformers < 5.20)"


def require_vllm() -> None:
    """One ``UserError`` line when vLLM is not importable here."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"rollout.backend=vllm needs vLLM, which is not installed in this environment; {INSTALL_HINT}")


def _hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under Hugging Face names (a LoRA model's adapters merged into a copy)."""
    from turnforge.policy.lora import is_lora, merged_copy

    plain = merged_copy(model) if is_lora(model) else model
    return {k: v.detach() for k, v in plain.state_dict().items()}


class VLLMSampler:
    """A ``vllm.LLM`` over the model directory ``model_dir``, synced to a policy's weights."""

    def __init__(self, model_dir: str | Path, *, seed: int, max_model_len: int, dtype: str = "float32",
                 kv_cache_gib: float = 1.0) -> None:
        require_vllm()
        # the engine core in this process: weights load into its model object directly
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        threads = torch.get_num_threads()
        from vllm import LLM

        self.llm = LLM(
            model=str(model_dir), dtype=dtype, seed=seed, enforce_eager=True, enable_prefix_caching=True,
            max_model_len=max_model_len, logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
            kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
        )
        torch.set_num_threads(threads)  # (the CPU build may patch this to a no-op after binding its threads)
        self._loaded: tuple[torch.nn.Module, int] | None = None  # (the model, its version) the engine holds
        #: Weight loads so far (one per policy version sampled).
        self.syncs = 0

    def __deepcopy__(self, memo: dict) -> "VLLMSampler":  # a policy copy shares the one engine
        return self

    def invalidate(self) -> None:
        """The policy's weights changed without a version bump (e.g. behaviour cloning): reload on next use."""
        self._loaded = None

    def sync(self, model: torch.nn.Module, version: int) -> bool:
        """Load ``model``'s weights into the engine unless it holds them already; True if it loaded."""
        if self._loaded is not None and self._loaded[0] is model and self._loaded[1] == version:
            return False
        weights = _hf_state_dict(model)
        # vLLM's in-place reload (it re-runs the post-load weight processing the CPU build needs)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self.llm.reset_prefix_cache()
        self._loaded, self.syncs = (model, version), self.syncs + 1
        return True

    def sample(self, model: torch.nn.Module, version: int, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               stop_ids: Sequence[int], temperature: float, keys: Sequence[str] = (),
               row_seeds: Sequence[int] | None = None) -> list[Generation]:
        """Sample continuations of ``prompts`` after syncing the weights of ``model`` at ``version``.
        ``temperature == 0`` is greedy (logprobs then of the temperature-1 distribution).
        ``row_seeds`` are refused: vLLM draws from its own generator (``keys`` are unused)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if row_seeds is not None:
            raise ValueError("per-row seeds (rollout.noise=episode) are not supported with vLLM: it draws its own noise")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.sync(model, version)
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                                stop_token_ids=list(stop_ids), detokenize=False, skip_special_tokens=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        stops = set(stop_ids)
        gens = []
        for o in outs:
            c = o.outputs[0]
            ids = tuple(int(t) for t in c.token_ids)
            logprobs = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, ids))
            gens.append(Generation(ids=ids, logprobs=logprobs, stopped=bool(ids) and ids[-1] in stops))
        return gens
