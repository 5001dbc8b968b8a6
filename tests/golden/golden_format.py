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
from dataclasses import dataclass
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


#: Trajectory-file columns that must repeat exactly: token ids, masks, texts, rewards, which tasks.
DISCRETE_COLUMNS = ("trajectory_id", "task_id", "turn_index", "token_ids", "loss_mask", "versions",
                    "action_text", "reward", "success")
#: Trajectory-file columns that are float32 results of the model (compared within ``TOLERANCES``).
FLOAT_COLUMNS = ("logprobs", "advantage")


def _weight_fingerprint(name: str, t) -> list[float]:
    """Four numbers of a weight tensor that any real change moves: its sum, its L2 norm, and two
    dot products with fixed pseudo-random +-1 vectors seeded by the tensor's name (a change that
    keeps the sum and the norm, a permutation say, still moves these)."""
    import numpy as np

    x = t.detach().double().flatten().numpy()
    rng = np.random.default_rng(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    signs = rng.choice([-1.0, 1.0], size=(2, x.size))
    return [float(x.sum()), float(np.sqrt((x * x).sum())), *(float(v) for v in signs @ x)]


def record_run(run: Path) -> dict:
    """A training run's outcome: evaluations, per-iteration RL figures, every trajectory file's
    discrete columns (as a digest) and float columns (as values), and a fingerprint of each
    final weight tensor (read with the run's typed readers; the keys are those the old runner's
    flat metrics had)."""
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
        files[path.name] = {"rows": len(rows), "digest": _digest([[r[c] for c in DISCRETE_COLUMNS] for r in rows]),
                            **{c: [r[c] for r in rows] for c in FLOAT_COLUMNS}}
    weights = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    return {
        "eval_before_rl": summary.eval_before_rl.success_rate, "eval_after_rl": summary.eval_after_rl.success_rate,
        "env_steps": summary.env_steps, "train_tokens": summary.train_tokens,
        "rl": rl, "evals": evals, "files": files,
        "weights": {name: _weight_fingerprint(name, weights[name]) for name in sorted(weights)},
    }


@dataclass(frozen=True)
class Tolerance:
    """``|got - want| <= atol + rtol * |want|`` (``torch.testing.assert_close``'s rule)."""

    rtol: float
    atol: float

    def holds(self, got: float, want: float) -> bool:
        return abs(got - want) <= self.atol + self.rtol * abs(want)


#: Sampling logprobs of the untrained scenarios: torch.testing's float32 defaults. The worst
#: difference from the stored files over ATen's default, AVX2 and AVX-512 kernel paths and 1 or
#: 2 threads was 9.5e-7 (two float32 ulps of a logprob near -6); a real change to sampling (a
#: temperature applied twice, another logit processor) moves a logprob by 1e-3 or more.
SAMPLED = Tolerance(rtol=1.3e-6, atol=1e-5)
#: Floats after ~60 BC steps and 3 GRPO updates (logprobs, losses, entropies): rounding amplified
#: by the optimizer. Worst over the same kernel paths, MKL_CBWR=COMPATIBLE included: 1.2e-5
#: absolute in a logprob, 2.1e-7 in a loss of 1.2e-3 (relative 1.3e-4); the bounds (1e-5 plus 1e-3
#: of the value) are several times above both.
TRAINED = Tolerance(rtol=1e-3, atol=1e-5)
#: A weight fingerprint (sum, norm, two signed sums) may move by this share of the tensor's L2
#: norm. Worst over the same kernel paths: 2.2e-4 (1.2e-4 without MKL_CBWR), in a key bias whose
#: gradient is zero up to rounding (softmax ignores a constant added to every score) and which
#: Adam scales up to lr. A real change is caught first by the logprobs, losses and digests.
WEIGHTS_SHARE_OF_NORM = 1e-3


class Mismatch(AssertionError):
    pass


def _compare(got, want, tol: Tolerance | None, path: str) -> None:
    """Exact equality everywhere, but floats under a tolerance where ``tol`` is given."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            raise Mismatch(f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r} != {sorted(want)}")
        for k in want:
            _compare(got[k], want[k], tol, f"{path}.{k}")
    elif isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            raise Mismatch(f"{path}: length {len(got) if isinstance(got, list) else got!r} != {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, tol, f"{path}[{i}]")
    elif tol is not None and isinstance(want, float) and isinstance(got, float):
        if not tol.holds(got, want):
            raise Mismatch(f"{path}: {got!r} != {want!r} (beyond rtol={tol.rtol}, atol={tol.atol})")
    elif got != want or type(got) is not type(want):
        raise Mismatch(f"{path}: {got!r} != {want!r}")


def assert_trajectories_match(got: list[dict], want: list[dict]) -> None:
    """Every field exact (ids, masks, texts, rewards, versions, which tasks), but sampling
    logprobs within ``SAMPLED``."""
    if len(got) != len(want):
        raise Mismatch(f"{len(got)} trajectories != {len(want)}")
    for g, w in zip(got, want):
        where = f"trajectory {w['trajectory_id']}"
        _compare({**g, "samples": [{k: v for k, v in s.items() if k != "logprobs"} for s in g["samples"]]},
                 {**w, "samples": [{k: v for k, v in s.items() if k != "logprobs"} for s in w["samples"]]}, None, where)
        for i, (gs, ws) in enumerate(zip(g["samples"], w["samples"])):
            _compare(gs["logprobs"], ws["logprobs"], SAMPLED, f"{where}.samples[{i}].logprobs")


#: Float fields of a run's per-iteration records (the rest of the record is exact).
RL_FLOATS = ("loss", "clip_fraction", "entropy")


def assert_run_matches(got: dict, want: dict) -> None:
    """Evaluations, counts, rewards and the digest of every trajectory file's discrete columns
    exact; the RL records' losses and entropies, the files' logprobs and advantages within
    ``TRAINED``; each weight fingerprint within ``WEIGHTS_SHARE_OF_NORM`` of its tensor's norm."""
    exact = ("eval_before_rl", "eval_after_rl", "env_steps", "train_tokens", "evals")
    _compare({k: got[k] for k in exact}, {k: want[k] for k in exact}, None, "run")
    _compare([{k: v for k, v in r.items() if k not in RL_FLOATS} for r in got["rl"]],
             [{k: v for k, v in r.items() if k not in RL_FLOATS} for r in want["rl"]], None, "rl")
    _compare([{k: r[k] for k in RL_FLOATS} for r in got["rl"]], [{k: r[k] for k in RL_FLOATS} for r in want["rl"]],
             TRAINED, "rl")
    _compare({n: {"rows": f["rows"], "digest": f["digest"]} for n, f in got["files"].items()},
             {n: {"rows": f["rows"], "digest": f["digest"]} for n, f in want["files"].items()}, None, "files")
    for name, f in want["files"].items():
        for col in FLOAT_COLUMNS:
            _compare(got["files"][name][col], f[col], TRAINED, f"files.{name}.{col}")
    _compare(sorted(got["weights"]), sorted(want["weights"]), None, "weights")
    for name, w in want["weights"].items():
        _compare(got["weights"][name], w, Tolerance(rtol=0.0, atol=WEIGHTS_SHARE_OF_NORM * w[1]), f"weights.{name}")


def largest_float_difference(got, want) -> float:
    """The largest ``|got - want|`` over the floats of two records of the same shape (0.0 when
    they are bit for bit equal): what the kernel-path matrix reports."""
    if isinstance(want, dict):
        return max((largest_float_difference(got[k], want[k]) for k in want), default=0.0)
    if isinstance(want, list):
        return max((largest_float_difference(g, w) for g, w in zip(got, want)), default=0.0)
    if isinstance(want, float) and isinstance(got, float):
        return abs(got - want)
    return 0.0
