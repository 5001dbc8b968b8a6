"""LoRA adapters on the policy with ``peft``, and the frozen base as the KL reference.

How a run uses them (``model.lora.r > 0``):

- Behaviour cloning trains an adapter; when BC ends it is merged into the weights and
  ``checkpoints/bc`` is saved as an ordinary HF directory. The flywheel and RL train a
  fresh adapter on top of it. The frozen base is then the BC policy, which is what the KL
  term compares with: ``FrozenBase`` runs the same module with its adapters disabled, so
  there is no second copy of the weights. (Without BC, the base is the pretrained model.)
- Every later checkpoint holds the merged model (``from_pretrained`` loads it) and the
  adapter alone in ``adapter/`` (``PeftModel.from_pretrained(base, DIR)`` loads it). A
  resume loads ``checkpoints/bc`` and the adapter, which gives the same weights bit for bit.

Several policies on one base (``agent.policies``): one adapter per policy name on the same
frozen base, each initialised from its own seed. ``use_adapter`` makes one the active one
(sampling, scoring and training run through it alone); ``trainable_parameters`` holds them all,
so one optimizer keeps each adapter's moments apart (Adam's state is per parameter, and a step
after one policy's backward pass leaves the others' parameters, which have no gradient, alone).
Their checkpoints hold the base weights (``from_pretrained`` loads the model every policy starts
from; no single merged model exists) and ``adapter/<name>/`` per policy.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Sequence

import torch

from turnforge.errors import UserError
from turnforge.policy.model import Policy

ADAPTER_DIR = "adapter"  # a checkpoint's subdirectory holding the LoRA adapter alone

# peft asks transformers a deprecated question on every wrap; the warning is peft's to fix, not the user's
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Last name components of the model's linear layers (what ``target_modules`` matches);
    GPT-2's ``Conv1D`` layers are linear layers too (peft adapts them)."""
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))})


def skeleton(config) -> torch.nn.Module:
    """The model an HF ``config`` describes, on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries adapters (without importing peft when no run used it)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def require_peft() -> None:
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise UserError("model.lora.r > 0 needs the peft package: pip install 'turnforge[lora]' (or pip install peft)")


def check_lora_targets(model: torch.nn.Module, target_modules: list[str]) -> None:
    """One ``UserError`` line naming target modules the model does not have, and those it has
    (or that peft is missing)."""
    require_peft()
    names = linear_module_names(model)
    missing = [t for t in target_modules if t not in names]
    if missing or not target_modules:
        raise UserError(
            f"model.lora.target_modules {missing or target_modules} {'do not exist in' if missing else 'is empty for'} "
            f"the model; its linear modules: {', '.join(names)}"
        )


def thinking_rows(policy: Policy) -> list[int]:
    """Token ids of the thinking markers ``model.thinking`` added: the embedding rows that train
    beside the adapters (a LoRA adapter alone would leave them at their initial values)."""
    from turnforge.types import THINKING_MARKERS

    return [int(i) for i in policy.tokenizer.convert_tokens_to_ids(list(THINKING_MARKERS[0]))]


def add_lora(policy: Policy, cfg, seed: int, stage: str, adapter_dir: Path | None = None,
             tokens: Sequence[int] = (), names: Sequence[str] = ()) -> None:
    """Wrap ``policy.model`` in a ``PeftModel``: a fresh adapter (A initialised from ``seed``
    and ``stage``, B zero, so the policy is unchanged) or the one saved in ``adapter_dir`` (to resume).
    ``tokens``: ids whose embedding rows train too (peft's trainable tokens; an output layer tied
    to the embeddings follows them). ``names``: one adapter per policy name (``agent.policies``;
    each initialised from ``seed``, ``stage`` and its name; read from ``adapter_dir/<name>``),
    the first one active."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from turnforge.seeding import stable_hash

    if adapter_dir is not None:
        if not names:
            policy.model = PeftModel.from_pretrained(policy.model, adapter_dir, is_trainable=True)
        else:
            policy.model = PeftModel.from_pretrained(policy.model, adapter_dir / names[0], adapter_name=names[0],
                                                     is_trainable=True)
            for name in names[1:]:
                policy.model.load_adapter(adapter_dir / name, adapter_name=name, is_trainable=True)
            policy.model.set_adapter(names[0])
        _rows_merged_for_sampling(policy.model)
        return
    check_lora_targets(policy.model, list(cfg.target_modules))
    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                        bias="none", task_type="CAUSAL_LM", trainable_token_indices=list(tokens) or None)
    with torch.random.fork_rng(devices=[]):
        if not names:
            torch.manual_seed(stable_hash(seed, "lora-init", stage))
            policy.model = get_peft_model(policy.model, config)
        else:
            torch.manual_seed(stable_hash(seed, "lora-init", stage, names[0]))
            policy.model = get_peft_model(policy.model, config, adapter_name=names[0])
            for name in names[1:]:
                torch.manual_seed(stable_hash(seed, "lora-init", stage, name))
                policy.model.add_adapter(name, copy.deepcopy(config))
            policy.model.set_adapter(names[0])
    _rows_merged_for_sampling(policy.model)


def saved_policies(checkpoint: Path) -> list[str]:
    """The policies whose adapters a checkpoint of several holds (``adapter/<name>/``, in name
    order); [] for a checkpoint of one policy."""
    root = Path(checkpoint) / ADAPTER_DIR
    if not root.is_dir() or (root / "adapter_config.json").exists():
        return []
    return sorted(d.name for d in root.iterdir() if (d / "adapter_config.json").exists())


def several_policies(checkpoint: Path, label: str, instead: str) -> None:
    """A ``UserError`` line when ``checkpoint`` holds several policies (its weights are their shared
    base, not any one of them): ``instead`` says what to do (``{adapter}``: the first one's adapter
    directory, ``{path}``: the checkpoint)."""
    names = saved_policies(checkpoint)
    if names:
        what = instead.format(adapter=Path(checkpoint) / ADAPTER_DIR / names[0], path=checkpoint)
        raise UserError(f"{label} holds {len(names)} policies ({', '.join(names)}), each a LoRA adapter on the base its "
                        f"weights are: {what}")


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The adapters ``model`` carries, in the order they were added ([] without LoRA)."""
    return list(model.peft_config) if is_lora(model) else []


def active_adapter(model: torch.nn.Module) -> str:
    """The adapter that sampling and training run through ("" without LoRA)."""
    return str(model.active_adapter) if is_lora(model) else ""


def use_adapter(model: torch.nn.Module, name: str) -> None:
    """Make adapter ``name`` the active one (a no-op when it already is). peft marks the active
    adapter's parameters trainable and the others' not, so a backward pass reaches only its own."""
    if active_adapter(model) != name:
        model.set_adapter(name)


def adapter_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """The parameters of adapter ``name`` (its LoRA matrices)."""
    return [p for n, p in model.named_parameters() if ".lora_" in n and n.split(".lora_", 1)[1].split(".")[1] == name]


def _rows_merged_for_sampling(model: torch.nn.Module) -> None:
    """peft's trainable token rows write themselves into a copy of the whole embedding matrix on
    every forward (2.5x the time of a SmolLM2 decoding step). Here a forward without gradient
    (sampling, scoring) runs on the rows merged into the weights (peft's ``merge``: the same
    values) and one with gradient on the unmerged layer, so the rows train and sampling costs
    what it costs without them. peft unmerges by itself when the adapters are disabled (the
    frozen base)."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    for module in model.modules():
        if isinstance(module, TrainableTokensLayer):
            module.register_forward_pre_hook(_rows_for_the_mode)


def _rows_for_the_mode(module, args) -> None:
    if module.disable_adapters:
        return
    if torch.is_grad_enabled():
        if module.merged:
            module.unmerge()
        return
    # rows merged before an in-place change of their values (an optimizer step, a copy) are merged again
    stamp = tuple(module.trainable_tokens_delta[name]._version for name in module.active_adapters)
    if module.merged and getattr(module, "_merged_at", None) != stamp:
        module.unmerge()
    if not module.merged:
        module.merge()
        module._merged_at = stamp


def merge_lora(policy: Policy) -> None:
    """Fold the adapter into the weights (``merge_and_unload``): ``policy.model`` becomes the
    plain model again."""
    policy.model = _merged(policy.model)


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the adapter folded in, leaving ``model`` (and its adapter) untouched."""
    return _merged(copy.deepcopy(model))


def _merged(model: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():  # token rows merged already for sampling (``_rows_merged_for_sampling``): peft says so
        warnings.filterwarnings("ignore", message="All adapters are already merged", category=UserWarning)
        return model.merge_and_unload()


class FrozenBase(torch.nn.Module):
    """The base of a ``PeftModel`` as a module of its own: every call runs the shared weights
    with the adapters disabled and no gradient. Used as the KL reference in place of a copy."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_peft", peft_model)  # not a submodule: its parameters stay the policy's

    def forward(self, *args, **kwargs):
        with torch.no_grad(), self._peft.disable_adapter():
            return self._peft(*args, **kwargs)

    @property
    def peft_model(self) -> torch.nn.Module:
        """The ``PeftModel`` whose base this runs (shared, not a copy)."""
        return self._peft

    def parameters(self, recurse: bool = True):  # device lookups (next(model.parameters())) see the shared weights
        return self._peft.parameters(recurse)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer updates: all of them, or only the adapters under LoRA (every
    policy's, with several: see the module docstring)."""
    names = adapter_names(model)
    if len(names) > 1:
        return [p for name in names for p in adapter_parameters(model, name)]
    return [p for p in model.parameters() if p.requires_grad]


def adapter_change(model: torch.nn.Module, name: str) -> float:
    """How far adapter ``name`` moves the base: sqrt of the sum over its layers of
    ||scaling * B A||_F^2 (0 for a fresh adapter, whose B is zero)."""
    from peft.tuners.lora import LoraLayer

    total = 0.0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer) and name in module.lora_A:
                delta = module.lora_B[name].weight.float() @ module.lora_A[name].weight.float()
                total += float((module.scaling[name] * delta).pow(2).sum())
    return total ** 0.5


def base_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The plain base model under ``model``'s adapters (a copy: ``model`` keeps them)."""
    return copy.deepcopy(model).unload()
