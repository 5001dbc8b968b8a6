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
             tokens: Sequence[int] = ()) -> None:
    """Wrap ``policy.model`` in a ``PeftModel``: a fresh adapter (A initialised from ``seed``
    and ``stage``, B zero, so the policy is unchanged) or the one saved in ``adapter_dir`` (to resume).
    ``tokens``: ids whose embedding rows train too (peft's trainable tokens; an output layer tied
    to the embeddings follows them)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from turnforge.seeding import stable_hash

    if adapter_dir is not None:
        policy.model = PeftModel.from_pretrained(policy.model, adapter_dir, is_trainable=True)
        _rows_merged_for_sampling(policy.model)
        return
    check_lora_targets(policy.model, list(cfg.target_modules))
    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
                        bias="none", task_type="CAUSAL_LM", trainable_token_indices=list(tokens) or None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_hash(seed, "lora-init", stage))
        policy.model = get_peft_model(policy.model, config)
    _rows_merged_for_sampling(policy.model)


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
    """The parameters an optimizer updates: all of them, or only the adapters under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]
