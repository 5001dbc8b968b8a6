"""Each recorded token id as the exact bytes it stands for, from the run's own tokenizer.

The viewer never re-templates or re-tokenizes: it shows the ids a sample recorded, each as the
bytes the tokenizer's vocabulary gives it, and the page decodes them as one UTF-8 stream (a
character split across two byte-level tokens shows once, on the token that completes it), so
a sample's text on the page is ``tokenizer.decode(ids, skip_special_tokens=False)`` token by
token.

Bytes of an id, by the tokenizer's decoder (``tokenizers`` JSON, what transformers' fast
tokenizers wrap):

- an added token (``<|im_start|>``, ``<tool_call>``): its content; ``special`` marks those the
  tokenizer flags special, which the page shows as visible tags;
- ``ByteLevel`` (GPT-2, Qwen2, Llama 3, SmolLM2): the token's characters mapped back through
  GPT-2's byte-to-unicode table;
- ``ByteFallback``/``Metaspace`` (SentencePiece models: Llama 2, Mistral): ``<0xNN>`` is byte NN,
  ``▁`` is a space;
- anything else: ``decode([id])`` as UTF-8.

The tokenizer comes from the run directory: the first of ``checkpoints/final``,
``checkpoints/last``, ``checkpoints/bc``, ``base_model`` and the config's ``model.path`` that
holds one (``tokenizer.json`` read with ``tokenizers``; a directory without it goes through
transformers' ``AutoTokenizer``, which converts it).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from turnforge.runs import RunDir


def tokenizer_dirs(run_dir: Path) -> list[Path]:
    """Where a run directory keeps a tokenizer, in the order they are tried: the final, last and
    BC checkpoints, then the base model."""
    run = RunDir(run_dir)
    return [run.checkpoint("final"), run.checkpoint("last"), run.checkpoint("bc"), run.base_model]


def find_tokenizer_dir(run_dir: Path, model_path: str | None) -> Path | None:
    """The first of ``tokenizer_dirs(run_dir)`` (then ``model_path``, the config's ``model.path``)
    with a tokenizer in it; None when there is none."""
    candidates = tokenizer_dirs(run_dir)
    if model_path and model_path != "tiny":
        candidates.append(Path(model_path))
    for d in candidates:
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            return d
    return None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte table, inverted (``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenPieces:
    """The bytes of each token id of one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.source = tokenizer_dir
        if (tokenizer_dir / "tokenizer.json").is_file():
            self.tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        else:  # a SentencePiece-only directory: transformers converts it to the same object
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(tokenizer_dir).backend_tokenizer
        added = self.tok.get_added_tokens_decoder()
        self.added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        decoder = json.loads(self.tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self.kind = "byte_level" if "ByteLevel" in kinds else "sentencepiece" if kinds & {"ByteFallback", "Metaspace"} else "decode"
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (empty for an id outside the vocabulary)."""
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self.kind == "byte_level":
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        elif self.kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        return self.tok.decode([token_id], skip_special_tokens=False).encode()

    def table(self, ids: Iterable[int]) -> dict[str, str]:
        """``{id: hex of its bytes}`` for the distinct ``ids`` (the page's vocabulary)."""
        return {str(i): self.bytes_of(i).hex() for i in sorted({int(i) for i in ids})}

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` as the page shows it: their bytes joined, decoded as UTF-8
        (an invalid sequence as U+FFFD)."""
        return b"".join(self.bytes_of(int(i)) for i in ids).decode("utf-8", errors="replace")
