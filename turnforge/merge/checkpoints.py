"""``turnforge merge``: read checkpoints' safetensors, check they can be merged, write the merge.

A parent is an HF model directory (a run's checkpoint, ``RUN/base_model``, any ``save_pretrained``
directory; sealed ones are verified against their manifest first) or a LoRA adapter directory
(``adapter_config.json``, e.g. ``RUN/checkpoints/final/adapter``), which is read as the base with
the adapter merged in (peft's ``merge_and_unload``; it needs ``--base``). Parents must share the
architecture (every parameter's name and shape) and the tokenizer and chat template (as loaded). The output is an HF directory like a checkpoint: ``model.safetensors``, the first full
parent's config, tokenizer and template, ``merge.json`` (method, weights, parents, each parent's
task-vector sparsity) and a manifest, written beside ``--out`` and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from turnforge.errors import UserError
from turnforge.merge.methods import SPARSITY_EPS, MergeSpec, Sparsity, check_spec, merge_tensor
from turnforge.paths import MANIFEST, seal, verify
from turnforge.policy.lora import several_policies
from turnforge.runs import RunDir

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
#: Files of a parent that are not copied to the merge (weights, training state, provenance).
NOT_COPIED = (WEIGHTS, INDEX, MANIFEST, "merge.json", "trainer_state.json", "adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class MergeResult:
    """What ``merge_checkpoints`` wrote."""

    out: Path
    spec: MergeSpec
    parents: list[str]
    base: str | None
    params: int  # elements merged
    seconds: float
    sparsity: list[Sparsity]  # one per parent (empty without a base)


def soup_members(run: Path, last: int) -> list[Path]:
    """The last ``last`` (0: all) weights run ``run`` kept (``keep_checkpoints``), oldest first, or
    one ``UserError`` line saying what is missing."""
    from turnforge.train.run_dir.checkpoint import kept_checkpoints

    if not RunDir(run).config.is_file():
        raise UserError(f"--soup {str(run)!r} is not a run directory (no config.yaml); give RUN, the --out of `turnforge train`")
    kept = kept_checkpoints(run)
    if len(kept) < max(2, last):
        raise UserError(f"--soup {str(run)!r}: the run kept {len(kept)} weights, a soup of {max(2, last)} needs more; "
                        "train with keep_checkpoints=K (K >= 2) to keep the last K saves")
    return kept[-last:] if last else kept


def is_adapter(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def check_parent(path: Path, label: str, *, base: Path | None) -> None:
    """One ``UserError`` line when ``path`` is not a model or adapter directory turnforge can merge."""
    if not path.is_dir():
        raise UserError(f"{label} {'is not a directory' if path.exists() else 'does not exist'}; "
                        "give an HF model directory (e.g. RUN/checkpoints/final) or a LoRA adapter directory")
    if (path / MANIFEST).exists() and (problem := verify(path)) is not None:
        raise UserError(f"{label}: {problem}")
    if is_adapter(path):
        if base is None:
            raise UserError(f"{label} is a LoRA adapter: give --base, the model it was trained on")
        return
    several_policies(path, label, "merge one's adapter, e.g. {adapter} with --base {path}")
    if not (path / "config.json").is_file():
        raise UserError(f"{label} has no config.json; give a directory saved with save_pretrained")
    if not (path / WEIGHTS).is_file() and not (path / INDEX).is_file():
        raise UserError(f"{label} has no {WEIGHTS} (safetensors); save it with safe_serialization=True")


def read_weights(path: Path, base: Path | None, label: str) -> dict[str, torch.Tensor]:
    """Every parameter of the model at ``path`` (an adapter: merged into ``base``'s weights);
    ``UserError`` naming ``label`` and the file when a weights file cannot be read."""
    if is_adapter(path):
        return _adapter_weights(path, base, label)  # type: ignore[arg-type]
    if (path / WEIGHTS).is_file():
        return _load(path / WEIGHTS, label)
    try:
        shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{label}: {path / INDEX} is not a safetensors index (no weight_map)") from None
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        out.update(_load(path / shard, label))
    return out


def _load(file: Path, label: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as err:  # safetensors raises its own error type (and OSError, ValueError) for a bad file
        raise UserError(f"{label}: {file} cannot be read as safetensors ({str(err).splitlines()[0][:120]}); "
                        "is the save complete?") from None


def _adapter_weights(path: Path, base: Path, label: str) -> dict[str, torch.Tensor]:
    try:
        from peft import PeftModel
    except ImportError:
        raise UserError(f"{str(path)!r} is a LoRA adapter: merging it needs peft (pip install 'turnforge[lora]')") from None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    try:
        merged = PeftModel.from_pretrained(model, path).merge_and_unload()
    except (ValueError, RuntimeError, KeyError, OSError) as err:  # an adapter for another model, a bad file
        raise UserError(f"{label}: the LoRA adapter does not load onto --base ({str(err).splitlines()[0][:160]})") from None
    names = set(read_weights(base, None, "--base"))  # the names the base's file has (tied weights saved once)
    return {k: v.detach().clone() for k, v in merged.state_dict().items() if k in names}


def check_compatible(dirs: Sequence[Path], labels: Sequence[str], weights: Sequence[dict[str, torch.Tensor]]) -> None:
    """One ``UserError`` line naming the first two models that differ in architecture (a
    parameter's name or shape) or tokenizer / chat template, and the difference."""
    first, label0 = weights[0], labels[0]
    for w, label in zip(weights[1:], labels[1:]):
        missing, extra = sorted(set(first) - set(w)), sorted(set(w) - set(first))
        if missing or extra:
            what = f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which {label0} lacks"
            raise UserError(f"{label} and {label0} have different architectures: {label} {what} "
                            f"({len(missing)} missing, {len(extra)} extra parameters); merge models of one architecture")
        for name, t in first.items():
            if w[name].shape != t.shape:
                raise UserError(f"{label} and {label0} have different architectures: {name!r} is "
                                f"{tuple(w[name].shape)} in one and {tuple(t.shape)} in the other; merge models of one architecture")
    full = [(d, lab) for d, lab in zip(dirs, labels) if not is_adapter(d)]
    d0, lab0 = full[0]
    key0 = tokenizer_key(d0)
    for d, lab in full[1:]:
        if tokenizer_key(d) != key0:
            raise UserError(f"{lab} and {lab0} have different tokenizers or chat templates: merged weights would not "
                            "match one of them; merge models that share them")


def tokenizer_key(path: Path) -> str:
    """What tokenizes and renders a prompt for the model at ``path``: the loaded tokenizer's
    serialisation and its chat template, hashed (the files' bytes differ after a re-save that
    changes nothing)."""
    from turnforge.policy.model import load_chat_format

    tok = load_chat_format(path).tokenizer
    return hashlib.sha256((tok.backend_tokenizer.to_str() + "\0" + str(tok.chat_template)).encode()).hexdigest()


def merge_checkpoints(parents: Sequence[Path], out: Path, spec: MergeSpec, base: Path | None = None,
                      labels: Sequence[str] | None = None) -> MergeResult:
    """Merge ``parents`` into ``out`` (see the module docstring); every check before any write.
    ``labels`` name the parents in errors (default ``checkpoint i ('PATH')``)."""
    t0 = time.perf_counter()
    if (problem := check_spec(spec, len(parents), base is not None)) is not None:
        raise UserError(problem)
    labels = list(labels) if labels is not None else [f"checkpoint {i + 1} ({str(p)!r})" for i, p in enumerate(parents)]
    for p, label in zip(parents, labels):
        check_parent(p, label, base=base)
    base_label = f"--base ({str(base)!r})"
    if base is not None:
        check_parent(base, base_label, base=None)
        if is_adapter(base):
            raise UserError(f"{base_label} is a LoRA adapter; give the full model it was trained on")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {str(out)!r} is not empty; give a new directory")
    xs = [read_weights(p, base, label) for p, label in zip(parents, labels)]
    b = read_weights(base, None, base_label) if base is not None else None
    if b is None:
        check_compatible(parents, labels, xs)
    else:
        check_compatible([*parents, base], [*labels, base_label], [*xs, b])

    merged: dict[str, torch.Tensor] = {}
    counts = {p: {str(e): 0 for e in SPARSITY_EPS} for p in range(len(parents))}
    shared, sq = [0] * len(parents), [0.0] * len(parents)
    total = 0
    for name, ref in xs[0].items():
        tensors = [x[name] for x in xs]
        merged[name] = merge_tensor(spec, name, tensors, None if b is None else b[name]).to(ref.dtype).contiguous()
        total += ref.numel()
        if b is not None:  # task-vector sparsity, and overlap with the other parents
            changed = torch.stack([(t.float() - b[name].float()) != 0 for t in tensors])
            others = changed.sum(0)
            for i, t in enumerate(tensors):
                d = (t.float() - b[name].float()).abs()
                for e in SPARSITY_EPS:
                    counts[i][str(e)] += int((d > e).sum())
                shared[i] += int((changed[i] & (others > 1)).sum())
                sq[i] += float((d.double() ** 2).sum())
    sparsity = [] if b is None else [
        Sparsity(parent=str(p), params=total, changed={e: c / total for e, c in counts[i].items()},
                 shared=shared[i] / max(1, counts[i]["0.0"]), norm=sq[i] ** 0.5)
        for i, p in enumerate(parents)]

    result = MergeResult(out=out, spec=spec, parents=[str(p.resolve()) for p in parents], base=None if base is None else str(base.resolve()),
                         params=total, seconds=0.0, sparsity=sparsity)
    _write(out, merged, _files_from(parents, base), result)
    return replace(result, seconds=round(time.perf_counter() - t0, 2))


def _files_from(parents: Sequence[Path], base: Path | None) -> Path:
    """The directory whose config, tokenizer and template the merge gets: the first full parent
    (the base when every parent is an adapter)."""
    for p in parents:
        if not is_adapter(p):
            return p
    assert base is not None
    return base


def _write(out: Path, merged: dict[str, torch.Tensor], source: Path, result: MergeResult) -> None:
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith((".pt", ".bin")) and not f.name.startswith("model-"):
                shutil.copy2(f, tmp / f.name)
        save_file(merged, str(tmp / WEIGHTS), metadata={"format": "pt"})
        record = asdict(result)
        record.pop("out"), record.pop("seconds")
        (tmp / "merge.json").write_text(json.dumps(record, indent=2) + "\n")
        seal(tmp)
        if out.exists():
            out.rmdir()  # empty (checked)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
