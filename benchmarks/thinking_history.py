"""Rollout time of the two history policies of reasoning templates on 16-turn episodes.

    python benchmarks/thinking_history.py                     # tiny model, 8 episodes of 16 turns, 3 repeats
    python benchmarks/thinking_history.py --episodes 16 --budget 32 --repeats 5

The tiny model gets ``<think>``/``</think>`` and a Qwen3-style template that drops earlier thinking
(``turnforge.policy.tiny.make_thinking``), then clones (BC) an expert that thinks a sentence before
each answer, so that it thinks when sampled. The same episodes are then played with
``rollout.history=as_sampled`` (one growing context) and ``as_rendered`` (each turn's prompt rendered
by the template, earlier thinking dropped), ``rollout.context=full_history``, ``rollout.prefix_cache``
on, a thinking budget, interleaved repeats. The issue's target: as_rendered at most 1.3x the rollout
time of as_sampled. Writes ``thinking_history.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from _runs import RESULTS

from turnforge.app.config import load_config
from turnforge.app.run import train
from turnforge.config import RolloutConfig, TinyModelConfig
from turnforge.envpool import InlineEnvs
from turnforge.envs import make
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.envs.registry import register
from turnforge.policy.model import load_policy
from turnforge.policy.tiny import build_tiny_model, make_thinking
from turnforge.rollout.actors import PolicyActor
from turnforge.rollout.engine import EpisodeRequest, RolloutEngine

WORDS = ["up", "down", "left", "right", "box", "wall", "goal", "floor"]
TARGET = 1.3


class ThinkEcho(LevelEnv):
    """Observations are random words; the answer is the last word; the expert thinks first. Every
    episode lasts ``turns`` turns."""

    instructions = "Answer with the last word you were shown."
    valid_actions_text = "any word"

    def __init__(self, *, turns: int = 16, invalid_action_penalty: float = 0.0, max_steps: int = 100) -> None:
        super().__init__(invalid_action_penalty=invalid_action_penalty, max_steps=max_steps)
        self.turns = turns

    def generate_level(self, level_seed):
        return level_seed

    def level_key(self, level):
        return str(level)

    def initial_state(self, level, rng):
        return {"t": 0, "text": self._text(random.Random(level))}

    def _text(self, r):
        return " ".join(r.choice(WORDS) for _ in range(r.randint(3, 8)))

    def render(self):
        return self.state["text"]

    def parse_action(self, text):
        return text.strip()

    def apply(self, action):
        right = action == self.state["text"].split()[-1]
        self.state["t"] += 1
        self.state["text"] = self._text(self.rng)
        done = self.state["t"] >= self.turns
        return Outcome(reward=float(right), terminated=done, success=done)

    def expert_action(self):
        last = self.state["text"].split()[-1]
        return f"<think>\nthe words were {self.state['text']} so the last one is {last}\n</think>\n\n{last}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--budget", type=int, default=24, help="rollout.thinking_budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "thinking_history")
    args = ap.parse_args()
    register("bench-think-echo", ThinkEcho, overwrite=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    thinking = out / "thinking"
    if not (thinking / "config.json").exists():
        make_thinking(build_tiny_model(out / "tiny", TinyModelConfig()), thinking)
    bc = out / "bc" / "checkpoints" / "final"
    if not (bc / "config.json").exists():
        train(load_config("sokoban-tiny", [
            f"model.path={thinking}", "env.id=bench-think-echo", f"env.kwargs={{turns: {args.turns}}}", "check_env=false",
            "rollout.context=full_history", f"rollout.max_turns={args.turns}", "rollout.max_new_tokens=48",
            "rollout.max_context_tokens=4096", "bc.num_demos=48", "bc.epochs=6", "bc.batch_size=8", "bc.lr=0.003",
            "bc.expert_noise=0", "rl.iterations=0", "flywheel.rounds=0", "eval.episodes=4", "eval.bc_temperatures=[]", "eval.pass_at_k_samples=0",
        ]), out / "bc", live=False)
    policy = load_policy(bc)
    policy.prefix_cache = True
    times: dict[str, list[float]] = {"as_sampled": [], "as_rendered": []}
    counts: dict[str, dict] = {}
    for rep in range(args.repeats):
        for history in times:
            cfg = RolloutConfig(context="full_history", history=history, max_turns=args.turns, max_new_tokens=4,
                                thinking_budget=args.budget, max_context_tokens=4096, prefix_cache=True)
            env_kwargs = {"turns": args.turns}
            engine = RolloutEngine(InlineEnvs("bench-think-echo", args.episodes, env_kwargs), cfg, policy,
                                   make("bench-think-echo", **env_kwargs))
            actor = PolicyActor(policy, cfg.max_new_tokens, 1.0, torch.Generator().manual_seed(rep))
            reqs = [EpisodeRequest(engine.env.task("train", i), i, f"g{i}", f"t{rep}-{i}") for i in range(args.episodes)]
            t0 = time.perf_counter()
            trajs, stats = engine.play(reqs, actor)
            times[history].append(time.perf_counter() - t0)
            counts[history] = {"turns": stats.turns, "thinking_tokens": stats.thinking_tokens,
                               "answer_tokens": stats.answer_tokens, "thinking_cuts": stats.thinking_cuts,
                               "samples": sum(len(t.samples) for t in trajs),
                               "trained_tokens": int(sum(len(s.token_ids) for t in trajs for s in t.samples))}
            engine.close()
    median = {h: statistics.median(v) for h, v in times.items()}
    ratio = median["as_rendered"] / median["as_sampled"]
    result = {"episodes": args.episodes, "turns": args.turns, "thinking_budget": args.budget, "seconds": times,
              "median_seconds": median, "ratio": ratio, "target": TARGET, "counts": counts,
              "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads()}
    (out / "thinking_history.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_seconds", "ratio", "counts")}, indent=2))
    print(f"as_rendered / as_sampled rollout time: {ratio:.2f}x (target <= {TARGET}x)")


if __name__ == "__main__":
    main()
