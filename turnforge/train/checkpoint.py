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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from turnforge.policy.model import Policy


@dataclass
class TrainerState:
    """Counters of a run; with the weights and optimizer state, all a resume needs
    (every random stream is derived from the seed and the iteration number)."""

    stage: str = "bc"  # last completed stage: "bc" or "rl"
    iteration: int = 0  # completed RL iterations
    env_steps: int = 0  # turns the policy played (rollouts, demonstrations)
    mc_env_steps: int = 0  # env steps of Monte-Carlo critic rollouts (counted apart)
    train_tokens: int = 0
    wall_seconds: float = 0.0
    skipped_steps: int = 0
    eval_before_rl: dict[str, Any] | None = None
    bc: dict[str, Any] = field(default_factory=dict)
    value_pretrain: dict[str, Any] = field(default_factory=dict)


def save_model(policy: Policy, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(path, safe_serialization=True)
    policy.tokenizer.save_pretrained(path)
    return path


def save_resumable(
    run_dir: Path, policy: Policy, optimizer: torch.optim.Optimizer | None, state: TrainerState, extra: dict | None = None
) -> Path:
    """Write ``checkpoints/last`` atomically; ``extra`` (e.g. the critic's state dicts) goes
    into ``trainer_state.pt`` beside the optimizer state."""
    final = run_dir / "checkpoints" / "last"
    tmp = run_dir / "checkpoints" / "last.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(policy, tmp)
    blob = {"optimizer": optimizer.state_dict() if optimizer else None, "version": policy.version, **(extra or {})}
    torch.save(blob, tmp / "trainer_state.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load_trainer_state(run_dir: Path) -> tuple[Path, TrainerState, dict[str, Any]] | None:
    """The last resumable checkpoint of ``run_dir``: (path, counters, torch state), or None."""
    path = run_dir / "checkpoints" / "last"
    if not (path / "trainer_state.json").exists():
        return None
    state = TrainerState(**json.loads((path / "trainer_state.json").read_text()))
    blob = torch.load(path / "trainer_state.pt", weights_only=False)
    return path, state, blob
