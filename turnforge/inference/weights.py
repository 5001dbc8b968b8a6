"""Weight pushes from the trainer to inference replicas: the file transport (``rollout.server.transport=file``).

A push is a directory ``push-<n>`` (``n`` = 1, 2, ... in the order written) under the run's
``weights/``, written beside it as ``.push-<n>.tmp`` and renamed into place, so a replica never
sees half a push. ``push.json`` describes it (``WeightPush``); the tensors are safetensors:

- ``kind=full``: ``model.safetensors``, every weight of the plain model under Hugging Face
  names (a tensor tied to an earlier one, e.g. an output layer tied to the embeddings, is
  written once). A LoRA policy's full push holds its *base* weights plus ``adapter.safetensors``.
- ``kind=adapter``: ``adapter.safetensors`` alone: per adapted linear layer ``<name>.lora_A``,
  ``<name>.lora_B`` and its ``scale``; the replica sets each such weight to the base of the full
  push ``base`` plus ``scale * B @ A`` (transposed for GPT-2's ``Conv1D`` layers), so a LoRA
  update moves megabytes, not the model. The replica keeps a copy of the adapted layers' base
  weights (only those) from that full push.

``model_fingerprint`` names what both ends must share (architecture, parameter shapes, tokenizer,
stop ids); a replica of another model refuses a push, and the trainer refuses such a replica
before any work.

Where it departs from peers: prime-rl's filesystem fallback writes whole HF checkpoints per
step; a push here is one safetensors file plus a JSON marker, and LoRA pushes carry the adapter
only (as ART ships adapters). The NCCL transport of GPU peers is not implemented.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

PUSH_FILE = "push.json"
MODEL_FILE = "model.safetensors"
ADAPTER_FILE = "adapter.safetensors"


@dataclass(frozen=True)
class WeightPush:
    """One push: where it is and what it holds."""

    push: int  # 1, 2, ... in the order written (the replica's weights id)
    version: int  # the trainer's policy version these weights are
    kind: str  # 'full' or 'adapter'
    base: int  # the full push an adapter push applies to (a full push: itself)
    path: str
    bytes: int  # tensor bytes written
    seconds: float  # time to write it
    fingerprint: str  # model_fingerprint of the trainer's model


class WeightSync(Protocol):
    """Publishes the trainer's weights for replicas to load (see the module docstring)."""

    transport: str

    def publish(self, model: torch.nn.Module, version: int, fingerprint: str) -> WeightPush:
        """Write ``model``'s weights at ``version``; the replicas load the returned push."""
        ...

    def invalidate(self) -> None:
        """The base weights changed (behaviour cloning, a LoRA adapter merged): the next push is full."""
        ...


def model_fingerprint(model: torch.nn.Module, tokenizer: Any, stop_ids: tuple[int, ...]) -> str:
    """A short hash of what a replica must share with the trainer: the parameter names (as the
    plain model names them) and shapes, the tokenizer's vocabulary and chat template, the stop ids."""
    h = hashlib.sha256()
    for name, shape in sorted(_plain_shapes(model).items()):
        h.update(f"{name}:{shape};".encode())
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(repr(tuple(stop_ids)).encode())
    return h.hexdigest()[:16]


def _plain_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in plain_state_dict(model).items()}


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face names; for a LoRA (peft) model its base weights, without the adapters."""
    from turnforge.policy.lora import is_lora

    if not is_lora(model):
        return dict(model.state_dict())
    out = {}
    for key, value in model.get_base_model().state_dict().items():
        if "lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = value
    return out


def lora_layers(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]:
    """Per adapted linear layer of a peft model, under the Hugging Face name of its weight:
    (A, B, scale, fan_in_fan_out)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            out[f"{name}.weight"] = (module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach(),
                                     float(module.scaling["default"]), bool(getattr(module, "fan_in_fan_out", False)))
    return out


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without tensors sharing storage with an earlier one (safetensors refuses shared tensors)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for key, value in state.items():
        ident = (value.untyped_storage().data_ptr(), value.storage_offset())
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = value.detach().contiguous().cpu()
    return out


class FileWeightSync:
    """The file transport: pushes under ``root`` (see the module docstring); keeps the last
    ``keep`` pushes and the full push the newest adapter push applies to."""

    transport = "file"

    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root, self.keep = Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.pushes: list[WeightPush] = []
        self._base: int | None = None  # the full push adapter pushes apply to (None: the next push is full)

    def invalidate(self) -> None:
        self._base = None

    def publish(self, model: torch.nn.Module, version: int, fingerprint: str) -> WeightPush:
        from safetensors.torch import save_file

        from turnforge.policy.lora import is_lora

        t0 = time.perf_counter()
        n = (self.pushes[-1].push if self.pushes else 0) + 1
        lora = is_lora(model)
        kind = "adapter" if lora and self._base is not None else "full"
        final, tmp = self.root / f"push-{n}", self.root / f".push-{n}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        written = 0
        if kind == "full":
            tensors = _untied(plain_state_dict(model))
            save_file(tensors, str(tmp / MODEL_FILE))
            written += sum(t.numel() * t.element_size() for t in tensors.values())
        if lora:
            tensors, scales = {}, {}
            for name, (a, b, scale, transposed) in lora_layers(model).items():
                tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"] = a.contiguous().cpu(), b.contiguous().cpu()
                scales[name] = [scale, transposed]
            save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"scales": json.dumps(scales)})
            written += sum(t.numel() * t.element_size() for t in tensors.values())
        base = n if kind == "full" else self._base
        push = WeightPush(n, version, kind, base, str(final), written, 0.0, fingerprint)
        (tmp / PUSH_FILE).write_text(json.dumps(asdict(push)) + "\n")
        os.replace(tmp, final)
        push = WeightPush(**{**asdict(push), "seconds": time.perf_counter() - t0})
        self._base = base if lora else None  # a plain model's pushes are all full
        self.pushes.append(push)
        self._retire()
        return push

    def _retire(self) -> None:
        """Delete pushes older than the last ``keep``, except the full push the newest applies to."""
        kept = {p.push for p in self.pushes[-self.keep:]} | {self.pushes[-1].base}
        for p in self.pushes:
            if p.push not in kept:
                shutil.rmtree(p.path, ignore_errors=True)
        self.pushes = [p for p in self.pushes if p.push in kept]


class PushError(Exception):
    """A push a replica cannot load (the message says why)."""


@dataclass
class LoadedWeights:
    """What a replica holds: its weights' push and the trainer's version they are, plus the
    base weights of the adapted layers (from the full push ``base``) an adapter push adds to."""

    push: int = 0  # 0: the weights it started with
    version: int = -1  # -1: not from a push
    base: int = 0
    base_layers: dict[str, torch.Tensor] | None = None


def read_push(path: str | Path) -> WeightPush:
    """The ``push.json`` of a push directory; ``PushError`` when it is missing or unreadable."""
    p = Path(path) / PUSH_FILE
    try:
        return WeightPush(**json.loads(p.read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise PushError(f"no readable {PUSH_FILE} in {str(path)!r}: {err}") from None


def load_push(model: torch.nn.Module, path: str | Path, held: LoadedWeights, fingerprint: str) -> tuple[WeightPush, LoadedWeights]:
    """Load the push at ``path`` into the plain ``model`` (in place); returns it and what the
    model then holds. ``PushError`` (and ``model`` unchanged) for another model's push or an
    adapter push whose base is not the one held."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    push = read_push(path)
    if push.fingerprint != fingerprint:
        raise PushError(f"push {push.push} is of another model (fingerprint {push.fingerprint}, this replica's {fingerprint})")
    root = Path(path)
    if push.kind == "full":
        tensors = load_file(str(root / MODEL_FILE))
        own = model.state_dict()
        unexpected = sorted(set(tensors) - set(own))
        tied = {k for k in own if k not in tensors}
        if unexpected or any(not _is_tied(own, k) for k in tied):
            raise PushError(f"push {push.push} does not match the model: unexpected {unexpected[:3]}, "
                            f"missing {sorted(k for k in tied if not _is_tied(own, k))[:3]}")
        with torch.no_grad():
            for key, value in tensors.items():
                own[key].copy_(value)
        base_layers = None
        if (root / ADAPTER_FILE).exists():
            names = _adapter_names(root / ADAPTER_FILE)
            base_layers = {k: own[k].detach().clone() for k in names}
        held = LoadedWeights(push.push, push.version, push.push, base_layers)
    else:
        if push.base != held.base or held.base_layers is None:
            raise PushError(f"adapter push {push.push} applies to full push {push.base}; this replica holds {held.base}")
        held = LoadedWeights(push.push, push.version, held.base, held.base_layers)
    if (root / ADAPTER_FILE).exists():
        tensors = load_file(str(root / ADAPTER_FILE))
        with safe_open(str(root / ADAPTER_FILE), "pt") as f:
            scales = json.loads(f.metadata()["scales"])
        own = model.state_dict()
        with torch.no_grad():
            for name, (scale, transposed) in scales.items():  # W = base + scale * B @ A, in place
                w = own[name]
                a, b = tensors[f"{name}.lora_A"].to(w.dtype), tensors[f"{name}.lora_B"].to(w.dtype)
                w.copy_(held.base_layers[name])
                w.addmm_(a.T, b.T, alpha=scale) if transposed else w.addmm_(b, a, alpha=scale)
    return push, held


def _adapter_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(json.loads(f.metadata()["scales"]))


def _is_tied(state: dict[str, torch.Tensor], key: str) -> bool:
    """Whether ``key`` shares its storage with another entry of ``state`` (a tied weight)."""
    ptr = state[key].untyped_storage().data_ptr()
    return any(k != key and v.untyped_storage().data_ptr() == ptr for k, v in state.items())
