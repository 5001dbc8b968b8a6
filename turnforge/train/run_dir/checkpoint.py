"""Checkpoints: HF-format model directories plus the trainer state needed to resume exactly.

``checkpoints/<name>/`` holds ``model.safetensors``, ``config.json`` and the tokenizer
files (loadable with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``); under LoRA
that is the merged model, and ``adapter/`` holds the adapter alone (``turnforge.policy.lora``; with several
policies the base they share, and ``adapter/<name>/`` each policy's adapter). A resumable
checkpoint adds ``trainer_state.pt`` (optimizer state) and ``trainer_state.json``
(counters); on several trainer ranks the optimizer states are sharded saves instead, one
directory each (``optimizer/``, ``critic_optimizer/``: a file per rank and the metadata of
``torch.distributed.checkpoint``, readable at any world size), which every rank writes into the
checkpoint before rank 0 seals it (several machines: the run directory on a shared filesystem).

Every checkpoint is written whole beside the old one and then swapped in (``turnforge.runs.RunDir.write_sealed``):
``<name>.tmp/`` is written, each file fsynced, ``manifest.json`` (size and sha256 of
every file) written last, then renamed into place. For the resumable checkpoint the
previous one stays as ``prev/`` until the next save, so a crash at any point (or a
file truncated later) leaves at least one complete checkpoint; ``find_resumable`` picks
the newest complete one and says why it skipped any other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from turnforge.dist import SHARDED, ShardedOptimizer
from turnforge.errors import UserError
from turnforge.paths import verify
from turnforge.policy.lora import ADAPTER_DIR, adapter_names, base_copy, is_lora, merged_copy
from turnforge.policy.model import Policy
from turnforge.runs import RunDir, staging
from turnforge.train.metrics import BCStats, BestTemperature, BoundaryReport, ValuePretrainStats, from_json
from turnforge.types import EvalResult

STAGES = ("bc", "rl")  # order of the stages a resumable checkpoint can close


@dataclass
class TrainerState:
    """Counters of a run; with the weights and optimizer state, all a resume needs
    (every random stream is derived from the seed and the iteration number).
    Written as ``trainer_state.json``."""

    stage: str = "bc"  # last completed stage: "bc", "flywheel" or "rl"
    flywheel_rounds_done: int = 0  # completed flywheel rounds (a resume at stage "bc" goes on with the next)
    iteration: int = 0  # completed RL iterations
    env_steps: int = 0  # turns the policy played (rollouts, demonstrations)
    mc_env_steps: int = 0  # env steps of Monte-Carlo critic rollouts (counted apart)
    train_tokens: int = 0
    wall_seconds: float = 0.0
    skipped_steps: int = 0
    eval_before_rl: EvalResult | None = None
    bc: BCStats | None = None
    value_pretrain: ValuePretrainStats | None = None
    bc_temperatures: BestTemperature | None = None  # the BC policy at eval.bc_temperatures
    hints: int = 0  # solver-backed hints of the flywheel stage
    anchor_moves: int = 0  # expert moves of the flywheel's anchor states
    boundary_start: BoundaryReport | None = None  # pass@k and friends of the start (eval.pass_at_k_samples > 0)


@dataclass
class TrainingState:
    """The torch state a resume needs besides the weights (``trainer_state.pt``)."""

    version: int  # the policy version (optimizer steps so far)
    # the policy optimizer's state dict (None before RL); on several ranks a ShardedOptimizer when
    # saved, {SHARDED: its directory} when read back (turnforge.dist.load_optimizer_state takes either)
    optimizer: dict[str, Any] | ShardedOptimizer | None = None
    critic: dict[str, Any] | None = None  # the learned critic's weights
    critic_optimizer: dict[str, Any] | ShardedOptimizer | None = None
    memory: list[dict[str, Any]] | None = None  # the episodic memory's entries (EpisodicMemory.state)
    flywheel: Any | None = None  # what carries over between flywheel rounds (FlywheelState), after a round


@dataclass(frozen=True)
class Resumable:
    """A complete resumable checkpoint found by ``find_resumable``."""

    path: Path
    state: TrainerState
    training: TrainingState
    skipped: tuple[str, ...] = ()  # one line per newer checkpoint that was incomplete or corrupt


# ------------------------------------------------------------------ writing
def save_model(run: RunDir, policy: Policy, path: Path, extra: dict[str, Any] | None = None, previous: Path | None = None,
               sharded: dict[str, ShardedOptimizer] | None = None) -> Path:
    """Write the HF model directory ``path`` of ``run`` whole (``RunDir.write_sealed``: beside it,
    sealed, then renamed). ``extra`` maps file names to objects saved with ``torch.save``
    (``*.pt``) or as JSON; ``previous``: where the replaced checkpoint is kept (None: deleted once
    replaced). On several trainer ranks (``turnforge.dist``) every rank calls it; rank 0 writes the
    model (the policy's plain model holds the synced weights) after every rank wrote its shards of
    ``sharded`` (directory name -> optimizer state) into it."""

    def fill(tmp: Path) -> None:
        if is_lora(policy.model):  # the merged model (loads with from_pretrained) and the adapter alone; with
            #   several policies the base they share, and each adapter in adapter/<name>/
            several = len(adapter_names(policy.model)) > 1
            (base_copy if several else merged_copy)(policy.model).save_pretrained(tmp, safe_serialization=True)
            policy.model.save_pretrained(tmp / ADAPTER_DIR, safe_serialization=True)
        else:
            policy.model.save_pretrained(tmp, safe_serialization=True)
        (policy.tokenizer if policy.vision is None else policy.vision.processor).save_pretrained(tmp)  # a processor saves its tokenizer
        for name, obj in (extra or {}).items():
            if name.endswith(".pt"):
                torch.save(obj, tmp / name)
            else:
                (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")

    shards = {name: state.write for name, state in (sharded or {}).items()}
    return run.write_sealed(path, fill, previous=previous, shards=shards)


def save_resumable(run: RunDir, policy: Policy, state: TrainerState, training: TrainingState) -> Path:
    """Write ``checkpoints/last`` (model, ``trainer_state.pt``, ``trainer_state.json``)
    atomically; the checkpoint it replaces stays as ``checkpoints/prev``."""
    torch_state = {f.name: getattr(training, f.name) for f in fields(training)}  # shallow: FlywheelState stays one
    sharded = {name: v for name, v in torch_state.items() if isinstance(v, ShardedOptimizer)}
    torch_state.update({name: {SHARDED: name} for name in sharded})  # (find_resumable makes the name a path)
    extra = {"trainer_state.pt": torch_state, "trainer_state.json": asdict(state)}
    return save_model(run, policy, run.checkpoint("last"), extra, previous=run.checkpoint("prev"), sharded=sharded)


def keep_weights(run: RunDir, policy: Policy, label: str, keep: int) -> Path | None:
    """With ``keep`` > 0 (``keep_checkpoints``): the policy's weights as a sealed model directory
    ``checkpoints/kept-<NNN>-<label>`` (NNN counts up over the run, a resumed one included), the
    oldest beyond ``keep`` removed; the members of a checkpoint soup (``turnforge merge --soup``)."""
    if keep <= 0:
        return None
    kept = run.kept_checkpoints()
    index = int(kept[-1].name.split("-")[1]) + 1 if kept else 1
    path = save_model(run, policy, run.kept(index, label))
    for old in (kept + [path])[:-keep]:
        run.remove(old)
    return path


def kept_checkpoints(run_dir: str | Path | RunDir) -> list[Path]:
    """The weights ``keep_weights`` kept in ``run_dir``, oldest first."""
    return RunDir(run_dir).kept_checkpoints()


# ------------------------------------------------------------------ reading
def _progress(state: TrainerState) -> tuple[int, int]:
    return STAGES.index(state.stage) if state.stage in STAGES else -1, state.iteration


def find_resumable(run_dir: str | Path | RunDir) -> Resumable | None:
    """The newest complete resumable checkpoint of ``run_dir`` among ``last``, ``prev``
    and a ``last.tmp`` that was sealed but not yet renamed (a crash between the two renames);
    None when the run has none (it stopped before its first checkpoint). Raises
    ``UserError`` when checkpoints exist but none is complete."""
    run = RunDir(run_dir)
    last, prev = run.checkpoint("last"), run.checkpoint("prev")
    found: list[Resumable] = []
    problems: dict[Path, str] = {}  # checkpoint -> what is wrong with it
    for path in (staging(last), last, prev):  # newest first
        if not path.exists():
            continue
        problem = verify(path)
        if problem is None:
            try:
                state = from_json(TrainerState, json.loads((path / "trainer_state.json").read_text()))
                saved = torch.load(path / "trainer_state.pt", weights_only=False)
                saved.update({k: {SHARDED: str(path / v[SHARDED])} for k, v in saved.items() if isinstance(v, dict) and SHARDED in v})
                training = TrainingState(**saved)
            except Exception as err:  # sealed files that do not parse: not a turnforge checkpoint
                problem = f"{path} cannot be read ({type(err).__name__}: {err})"
            else:
                found.append(Resumable(path, state, training))
        if problem is not None and path != staging(last):  # an unsealed last.tmp is an interrupted save, not news
            problems[path] = problem
    if not found:
        if problems:
            raise UserError(f"no complete checkpoint to resume from: {'; '.join(problems.values())}; "
                            "start a new run with another --out")
        return None
    best = max(found, key=lambda r: _progress(r.state))
    skipped = (problems[last],) if best.path == prev and last in problems else ()
    return Resumable(best.path, best.state, best.training, skipped)
