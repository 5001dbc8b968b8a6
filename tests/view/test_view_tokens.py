"""Token ids as bytes (``turnforge.view.tokens``): joined, they decode to what the tokenizer
decodes, for the tiny tokenizer and SmolLM2's real one, characters split across tokens included."""

from __future__ import annotations

import shutil

import pytest

from view_helpers import build, check_trajectory, goto
from turnforge.view.tokens import TokenPieces, find_tokenizer_dir
from view_bench import synthesize_run

TEXTS = ["<|im_start|>user\nnaïve café 🦀 日本語 ½<|im_end|>\n<|im_start|>assistant\nUp<|im_end|>",
         "tabs\tand\r\ncontrol \x1e characters", "Ünïcödé ✓✓✓ 👩‍👩‍👧"]


@pytest.mark.parametrize("name", ["tiny_model_dir", "smollm2_tiny_dir"])
def test_bytes_of_the_ids_decode_as_the_tokenizer_does(request, name):
    pieces = TokenPieces(request.getfixturevalue(name))
    assert pieces.kind == "byte_level"
    split = 0
    for text in TEXTS:
        ids = pieces.tok.encode(text, add_special_tokens=False).ids
        assert pieces.decode(ids) == pieces.tok.decode(ids, skip_special_tokens=False) == text
        split += sum(1 for i in ids if _not_utf8(pieces.bytes_of(i)))
    assert split > 0  # some characters are split across tokens: the hard case is exercised
    assert {pieces.tok.token_to_id("<|im_start|>"), pieces.tok.token_to_id("<|im_end|>")} <= pieces.special
    table = pieces.table([5, 5, 3])
    assert list(table) == ["3", "5"] and bytes.fromhex(table["5"]) == pieces.bytes_of(5)


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_the_page_shows_split_characters_once(page, smollm2_tiny_dir, tmp_path):
    """In the browser: the page decodes each sample as one UTF-8 stream (SmolLM2's tokenizer,
    emoji and CJK split across byte-level tokens)."""
    run = synthesize_run(tmp_path / "run", smollm2_tiny_dir, samples=6, group_size=2, max_turns=3, groups_per_iteration=1,
                         text="\nnaïve café 🦀 日本語 ½ \x1e").path
    assert find_tokenizer_dir(run, None) == run / "base_model"
    out = build([run], tmp_path / "page.html")
    goto(page, out.as_uri() + "#traj?run=0&stage=rl&iteration=0&id=rl-0-0-0", "traj")
    check_trajectory(page, run, "rl", 0, "rl-0-0-0")
    assert "🦀" in page.locator(".turn").first.inner_text()


def test_without_a_tokenizer_tokens_show_as_ids(page, tiny_model_dir, tmp_path):
    run = synthesize_run(tmp_path / "run", tiny_model_dir, samples=4, group_size=2, max_turns=2, groups_per_iteration=1).path
    shutil.rmtree(run / "base_model")
    assert find_tokenizer_dir(run, None) is None
    out = build([run], tmp_path / "page.html")
    goto(page, out.as_uri() + "#traj?run=0&stage=rl&iteration=0&id=rl-0-0-0", "traj")
    shown = page.evaluate("[...document.querySelector('.turn').querySelectorAll('.tok')].map(s => s.textContent)")
    ids = page.evaluate("[...document.querySelector('.turn').querySelectorAll('.tok')].map(s => +s.dataset.id)")
    assert shown == [f"⟨{i}⟩" for i in ids] and ids
    assert page.locator(".note", has_text="No tokenizer in the run directory").count() == 1
