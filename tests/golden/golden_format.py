"""What the golden files hold and how a run or a list of trajectories is recorded.

The scenarios cover the runner's paths: evaluation in chunks of the env batch (window and
full-history contexts, a tool env, greedy decoding, observation truncation, context overflow,
infra failures), noisy expert demonstrations, and episodes started from env snapshots with
per-turn snapshots kept. ``TRAIN_OVERRIDES`` is a short BC -> GRPO run of the default recipe.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}

SCENARIOS: dict[str, dict] = {
    "eval_sokoban_window": dict(
        kind="evaluate", env="sokoban", num_envs=5, episodes=12, split="heldout", temperature=1.0, seed=3,
        rollout=dict(context="window", history_window=2, max_turns=5, max_new_tokens=6, max_context_tokens=256),
    ),
    "eval_calculator_full_history": dict(
        kind="evaluate", env="calculator", num_envs=4, episodes=6, split="train", temperature=1.0, seed=1,
        rollout=dict(context="full_history", max_turns=4, max_new_tokens=12, max_context_tokens=620),
    ),
    "eval_echo_greedy_crash": dict(
        kind="evaluate", env="test-echo", env_kwargs={"crash_on": 2}, num_envs=4, episodes=8, split="train",
        temperature=0.0, seed=0,
        rollout=dict(context="window", history_window=1, max_turns=4, max_new_tokens=3, max_context_tokens=64),
    ),
    "demos_sokoban_noise": dict(
        kind="demos", env="sokoban", num_envs=7, episodes=16, noise=0.3, seed=5,
        rollout=dict(context="window", history_window=0, max_turns=15, max_new_tokens=4, max_context_tokens=256,
                     include_instructions=False),
    ),
    "snapshots_frozenlake_slippery": dict(
        kind="snapshots", env="frozenlake-slippery", num_envs=8, episodes=8, seed=2,
        rollout=dict(context="window", history_window=1, max_turns=6, max_new_tokens=4, max_context_tokens=256),
    ),
}

TRAIN_OVERRIDES = [
    *[f"model.tiny.{k}={v}" for k, v in TINY.items()],
    "threads=1", "bc.num_demos=100", "bc.epochs=4", "bc.batch_size=8", "bc.lr=0.003",
    "rl.iterations=3", "rl.tasks_per_iteration=4", "rl.group_size=4", "rl.minibatch_size=16",
    "rollout.max_turns=8", "eval.episodes=16", "eval.every=1", "checkpoint_every=1",
    "flywheel.rounds=0", "eval.bc_temperatures=[]",  # the recipe's flywheel off: the golden run is BC -> GRPO
    # pass@k on (16 tasks x 8 samples, at the start and the end): it must change none of the recorded figures
    "eval.pass_at_k_samples=8",
]


def _floats(xs) -> list:
    return [None if (isinstance(x, float) and math.isnan(x)) else float(x) for x in xs]


def record_trajectories(trajs) -> list[dict]:
    """Every field of every trajectory, turn and sample (snapshots: how many)."""
    out = []
    for t in trajs:
        out.append({
            "trajectory_id": t.trajectory_id, "task_id": t.task.task_id, "group_id": t.group_id,
            "env_seed": int(t.env_seed), "episode_return": float(t.episode_return), "success": bool(t.success),
            "terminated": bool(t.terminated), "truncated": bool(t.truncated),
            "truncation_reason": t.truncation_reason, "policy_version": int(t.policy_version),
            "infra_failure": t.infra_failure is not None, "num_snapshots": len(t.snapshots),
            "turns": [{
                "observation": x.observation, "action_text": x.action_text, "reward": float(x.reward),
                "invalid_action": bool(x.invalid_action), "anchor_key": x.anchor_key,
                "obs_truncated_tokens": int(x.obs_truncated_tokens), "generation_truncated": bool(x.generation_truncated),
                "potential": float(x.potential), "next_potential": float(x.next_potential),
                "info": dict(x.info),
            } for x in t.turns],
            "samples": [{
                "token_ids": s.token_ids.tolist(), "loss_mask": s.loss_mask.tolist(),
                "logprobs": _floats(s.logprobs.tolist()), "versions": s.versions.tolist(), "turn_index": int(s.turn_index),
            } for s in t.samples],
        })
    return out


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def record_run(run: Path) -> dict:
    """A training run's outcome: evaluations, per-iteration RL figures, a digest of every
    trajectory file's token columns, and a digest of the final weights (read with the run's
    typed readers; the keys are those the old runner's flat metrics had)."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    from turnforge.train.metrics import read_metrics, read_summary

    summary, metrics = read_summary(run), read_metrics(run)
    rl = [{"reward": m.reward, "success": m.success, "loss": m.update.loss, "samples": m.samples,
           "clip_fraction": m.update.clip_fraction, "entropy": m.update.entropy,
           "invalid_action_rate": m.invalid_action_rate, "mean_turns": m.mean_turns} for m in metrics.iterations]
    evals = [{"tag": e.tag, "success_rate": e.result.success_rate, "mean_return": e.result.mean_return,
              "invalid_action_rate": e.result.invalid_action_rate, "mean_turns": e.result.mean_turns} for e in metrics.evals]
    files = {}
    for path in sorted((run / "trajectories").glob("*.parquet")):
        rows = pq.read_table(path).to_pylist()
        cols = ("trajectory_id", "task_id", "turn_index", "token_ids", "loss_mask", "logprobs", "versions",
                "action_text", "reward", "advantage", "success")
        files[path.name] = {"rows": len(rows), "digest": _digest([[r[c] for c in cols] for r in rows])}
    weights = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().numpy().tobytes())
    return {
        "eval_before_rl": summary.eval_before_rl.success_rate, "eval_after_rl": summary.eval_after_rl.success_rate,
        "env_steps": summary.env_steps, "train_tokens": summary.train_tokens,
        "rl": rl, "evals": evals, "files": files, "weights": h.hexdigest(),
    }
