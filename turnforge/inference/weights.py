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
only (as ART ships adapters). The broadcast transports (gloo, NCCL) carry the same tensors
(``push_tensors``) and are numbered alike (``PushSequence``): ``turnforge.inference.collective``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

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
    """Publishes the trainer's weights and has replicas load them: ``FileWeightSync`` (here),
    ``CollectiveWeightSync`` (``turnforge.inference.collective``)."""

    transport: str

    def publish(self, model: torch.nn.Module, version: int, fingerprint: str) -> WeightPush:
        """Write (or stage) a push of ``model``'s weights at ``version``."""
        ...

    def deliver(self, push: WeightPush, replicas: Sequence[Any], load: Callable[[Any, dict], Any]) -> dict[Any, str | None]:
        """Have ``replicas`` load ``push``: ``load(replica, body)`` starts ``POST /v1/weights`` on
        one and returns its future. Per replica None (it holds the push) or why not."""
        ...

    def invalidate(self) -> None:
        """The base weights changed (behaviour cloning, a LoRA adapter merged): the next push is full."""
        ...

    def close(self) -> None:
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
        if "lora_" in key or "trainable_tokens_" in key:
            continue
        out[key.replace(".token_adapter.", ".").replace(".base_layer.", ".")] = value
    return out


def token_rows(model: torch.nn.Module) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Per embedding of a peft model whose token rows train (``model.thinking`` under LoRA),
    under the Hugging Face name of its weight: (token ids, their rows' values). An output layer
    tied to the embeddings follows them and is not listed."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    out = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, TrainableTokensLayer) and not module.tied_adapter and "default" in module.token_indices:
            weight = name.removesuffix(".token_adapter") + ".weight"
            out[weight] = (list(module.token_indices["default"]), module.trainable_tokens_delta["default"].detach())
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


def _untied(state: dict[str, torch.Tensor], move: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without tensors sharing storage with an earlier one (safetensors refuses shared
    tensors), each through ``move``."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for key, value in state.items():
        ident = (value.untyped_storage().data_ptr(), value.storage_offset())
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = move(value.detach())
    return out


@dataclass
class PushTensors:
    """What a push carries, whatever the transport: ``full``, the plain weights (a tensor tied to
    an earlier one left out) of a full push; ``adapter``, ``<name>.lora_A``/``<name>.lora_B`` of
    every adapted layer of a LoRA model, with ``scales[name] = [scale, fan_in_fan_out]``, and
    ``<name>.rows`` of an embedding whose token rows train, with ``scales[name] = {"rows": ids}``
    (the rows' values, written over the weight's rows)."""

    full: dict[str, torch.Tensor] | None
    adapter: dict[str, torch.Tensor] | None
    scales: dict[str, list] | None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in (self.full, self.adapter) if part for t in part.values())


def push_tensors(model: torch.nn.Module, kind: str, on_cpu: bool = True) -> PushTensors:
    """The tensors of a ``kind`` ('full' or 'adapter') push of ``model``: views of its own
    weights (copied to the CPU with ``on_cpu`` when the model is on a GPU)."""
    from turnforge.policy.lora import is_lora

    move = (lambda t: t.contiguous().cpu()) if on_cpu else (lambda t: t.contiguous())
    full = _untied(plain_state_dict(model), move) if kind == "full" else None
    if not is_lora(model):
        return PushTensors(full, None, None)
    adapter, scales = {}, {}
    for name, (a, b, scale, transposed) in lora_layers(model).items():
        adapter[f"{name}.lora_A"], adapter[f"{name}.lora_B"] = move(a), move(b)
        scales[name] = [scale, transposed]
    for name, (ids, rows) in token_rows(model).items():
        adapter[f"{name}.rows"] = move(rows)
        scales[name] = {"rows": ids}
    return PushTensors(full, adapter, scales)


class PushSequence:
    """Push numbers and kinds, whatever the transport: pushes are numbered 1, 2, ...; the first,
    and the first after ``invalidate``, is full; a LoRA model's others are adapter pushes on
    the last full one; a plain model's are all full."""

    def __init__(self) -> None:
        self.last = 0
        self._base: int | None = None  # the full push adapter pushes apply to (None: the next push is full)

    def invalidate(self) -> None:
        self._base = None

    def next(self, model: torch.nn.Module) -> tuple[int, str, int]:
        """(number, kind, base) of the next push of ``model``."""
        from turnforge.policy.lora import is_lora

        n = self.last + 1
        kind = "adapter" if is_lora(model) and self._base is not None else "full"
        return n, kind, n if kind == "full" else self._base

    def done(self, model: torch.nn.Module, push: WeightPush) -> None:
        from turnforge.policy.lora import is_lora

        self.last, self._base = push.push, push.base if is_lora(model) else None


def deliver_all(body: dict, replicas: Sequence[Any], load: Callable[[Any, dict], Any]) -> dict[Any, str | None]:
    """``load`` (an HTTP call's future) of ``body`` on every replica at once; per replica None or why it failed."""
    futures = {r: load(r, body) for r in replicas}
    outcome: dict[Any, str | None] = {}
    for replica, fut in futures.items():
        try:
            fut.result()
            outcome[replica] = None
        except Exception as err:  # noqa: BLE001 - the sampler's ReplicaFailed; the replica is named by the caller
            outcome[replica] = str(err)
    return outcome


class FileWeightSync:
    """The file transport: pushes under ``root`` (see the module docstring); keeps the last
    ``keep`` pushes and the full push the newest adapter push applies to."""

    transport = "file"

    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root, self.keep = Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.pushes: list[WeightPush] = []
        self.sequence = PushSequence()

    def invalidate(self) -> None:
        self.sequence.invalidate()

    def deliver(self, push: WeightPush, replicas: Sequence[Any], load: Callable[[Any, dict], Any]) -> dict[Any, str | None]:
        """Have every replica load ``push`` from its directory."""
        return deliver_all({"path": push.path}, replicas, load)

    def close(self) -> None:
        pass

    def publish(self, model: torch.nn.Module, version: int, fingerprint: str) -> WeightPush:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        n, kind, base = self.sequence.next(model)
        final, tmp = self.root / f"push-{n}", self.root / f".push-{n}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        carried = push_tensors(model, kind)
        if carried.full is not None:
            save_file(carried.full, str(tmp / MODEL_FILE))
        if carried.adapter is not None:
            save_file(carried.adapter, str(tmp / ADAPTER_FILE), metadata={"scales": json.dumps(carried.scales)})
        push = WeightPush(n, version, kind, base, str(final), carried.bytes, 0.0, fingerprint)
        (tmp / PUSH_FILE).write_text(json.dumps(asdict(push)) + "\n")
        os.replace(tmp, final)
        push = WeightPush(**{**asdict(push), "seconds": time.perf_counter() - t0})
        self.sequence.done(model, push)
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


class ReplicaFailed(Exception):
    """A request to one replica failed (the message says how); ``status``: the HTTP status of
    its answer (None when it did not answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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
    check_push(push, held, fingerprint)
    root = Path(path)
    own = model.state_dict()
    if push.kind == "full":
        tensors = load_file(str(root / MODEL_FILE))
        check_names(push, own, tensors)
        with torch.no_grad():
            for key, value in tensors.items():
                own[key].copy_(value)
    adapter, scales = None, None
    if (root / ADAPTER_FILE).exists():
        adapter = load_file(str(root / ADAPTER_FILE))
        with safe_open(str(root / ADAPTER_FILE), "pt") as f:
            scales = json.loads(f.metadata()["scales"])
    return push, loaded(model, push, held, adapter, scales)


def check_push(push: WeightPush, held: LoadedWeights, fingerprint: str) -> None:
    """``PushError`` for a push of another model, or an adapter push on a base this replica does not hold."""
    if push.fingerprint != fingerprint:
        raise PushError(f"push {push.push} is of another model (fingerprint {push.fingerprint}, this replica's {fingerprint})")
    if push.kind != "full" and (push.base != held.base or held.base_layers is None):
        raise PushError(f"adapter push {push.push} applies to full push {push.base}; this replica holds {held.base}")


def check_names(push: WeightPush, own: dict[str, torch.Tensor], names) -> None:
    """``PushError`` unless a full push's tensor ``names`` are ``own``'s (a tied weight written once)."""
    unexpected = sorted(set(names) - set(own))
    missing = sorted(k for k in own if k not in names and not _is_tied(own, k))
    if unexpected or missing:
        raise PushError(f"push {push.push} does not match the model: unexpected {unexpected[:3]}, missing {missing[:3]}")


@torch.no_grad()
def loaded(model: torch.nn.Module, push: WeightPush, held: LoadedWeights, adapter: dict[str, torch.Tensor] | None,
           scales: dict[str, list] | None) -> LoadedWeights:
    """What ``model`` holds once ``push`` is in it: a full push's weights already copied in, its
    adapter (or an adapter push's) applied here on the base layers of the full push: each
    adapted weight ``W = base + scale * B @ A``, and trained token rows written over their rows."""
    own = model.state_dict()
    adapted = {k: how for k, how in (scales or {}).items() if not isinstance(how, dict)}
    if push.kind == "full":
        base_layers = None if scales is None else {k: own[k].detach().clone() for k in adapted}
        held = LoadedWeights(push.push, push.version, push.push, base_layers)
    else:
        held = LoadedWeights(push.push, push.version, held.base, held.base_layers)
    for name, how in (scales or {}).items():
        if isinstance(how, dict):
            own[name][how["rows"]] = adapter[f"{name}.rows"].to(own[name].dtype)
    for name, (scale, transposed) in adapted.items():
        w = own[name]
        a, b = adapter[f"{name}.lora_A"].to(w.dtype), adapter[f"{name}.lora_B"].to(w.dtype)
        w.copy_(held.base_layers[name])
        w.addmm_(a.T, b.T, alpha=scale) if transposed else w.addmm_(b, a, alpha=scale)
    return held


def _is_tied(state: dict[str, torch.Tensor], key: str) -> bool:
    """Whether ``key`` shares its storage with another entry of ``state`` (a tied weight)."""
    ptr = state[key].untyped_storage().data_ptr()
    return any(k != key and v.untyped_storage().data_ptr() == ptr for k, v in state.items())
