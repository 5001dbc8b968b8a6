"""Checkpoints: HF-format model directories plus the trainer state needed to resume exactly.

``checkpoints/<name>/`` holds ``model.safetensors``, ``config.json`` and the tokenizer
files (loadable with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``). A resumable
checkpoint adds ``trainer_state.pt`` (optimizer state and counters). Resumable
checkpoints are written to a temporary directory and renamed, so an interruption never
leaves a half-written ``last/``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from turnforge.policy.model import Policy
from turnforge.train.metrics import BCStats, ValuePretrainStats, from_json
from turnforge.types import EvalResult


@dataclass
class TrainerState:
    """Counters of a run; with the weights and optimizer state, all a resume needs
    (every random stream is derived from the seed and the iteration number).
    Written as ``trainer_state.json``."""

    stage: str = "bc"  # last completed stage: "bc" or "rl"
    iteration: int = 0  # completed RL iterations
    env_steps: int = 0  # turns the policy played (rollouts, demonstrations)
    mc_env_steps: int = 0  # env steps of Monte-Carlo critic rollouts (counted apart)
    train_tokens: int = 0
    wall_seconds: float = 0.0
    skipped_steps: int = 0
    eval_before_rl: EvalResult | None = None
    bc: BCStats | None = None
    value_pretrain: ValuePretrainStats | None = None


@dataclass
class TrainingState:
    """The torch state a resume needs besides the weights (``trainer_state.pt``)."""

    version: int  # the policy version (optimizer steps so far)
    optimizer: dict[str, Any] | None = None  # the policy optimizer's state dict (None before RL)
    critic: dict[str, Any] | None = None  # the learned critic's weights
    critic_optimizer: dict[str, Any] | None = None


def save_model(policy: Policy, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(path, safe_serialization=True)
    policy.tokenizer.save_pretrained(path)
    return path


def save_resumable(run_dir: Path, policy: Policy, state: TrainerState, training: TrainingState) -> Path:
    """Write ``checkpoints/last`` atomically: the model, ``trainer_state.pt`` (``training``)
    and ``trainer_state.json`` (``state``)."""
    final = run_dir / "checkpoints" / "last"
    tmp = run_dir / "checkpoints" / "last.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(policy, tmp)
    torch.save(asdict(training), tmp / "trainer_state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_trainer_state(run_dir: Path) -> tuple[Path, TrainerState, TrainingState] | None:
    """The last resumable checkpoint of ``run_dir``: (path, counters, torch state), or None."""
    path = run_dir / "checkpoints" / "last"
    if not (path / "trainer_state.json").exists():
        return None
    state = from_json(TrainerState, json.loads((path / "trainer_state.json").read_text()))
    training = TrainingState(**torch.load(path / "trainer_state.pt", weights_only=False))
    return path, state, training
