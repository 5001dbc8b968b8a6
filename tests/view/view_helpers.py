"""Helpers of the viewer's browser tests: build a page through the CLI, load it and wait for a
view, query the run with DuckDB, check a trajectory's tokens on the page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from turnforge.data.query import TrajectoryStore
from turnforge.view.tokens import TokenPieces


def wait_ready(page, view: str) -> None:
    """Wait until the page has drawn ``view`` (``body[data-ready]``) and shows no error."""
    page.wait_for_function(f"document.body.dataset.ready === {view!r}", timeout=60_000)
    error = page.query_selector("[data-testid=error]")
    assert error is None, error.inner_text()


def goto(page, url: str, view: str) -> None:
    """Load ``url`` (a page address with its ``#view?...``) and wait for ``view``."""
    if page.url != "about:blank":
        page.evaluate("delete document.body.dataset.ready")
    if page.url == url:
        page.reload()
    else:
        page.goto(url)
    wait_ready(page, view)


def build(run_dirs, out: Path) -> Path:
    """``turnforge view RUN... -o OUT`` in a process; OUT."""
    proc = subprocess.run([sys.executable, "-m", "turnforge.cli", "view", *map(str, run_dirs), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out} (")
    return out


def duck(run: Path, query: str, params=None) -> list[dict]:
    """Rows of ``query`` on the run's trajectory store."""
    with TrajectoryStore(run) as store:
        return store.sql(query, params).to_pylist()


def visible(text: str) -> str:
    """``text`` as the page shows it: line breaks and tabs marked, other control characters as
    their Unicode control pictures (app.js, ``visible``)."""
    text = text.replace("\n", "↵\n").replace("\t", "→\t").replace("\x7f", "␡")
    return "".join(chr(0x2400 + ord(c)) if ord(c) < 32 and c not in "\n\t" else c for c in text)


def tokens_on_page(page) -> list[list[int]]:
    """The ids of the tokens of each sample the trajectory view shows."""
    return page.evaluate("""[...document.querySelectorAll('.turn')].map(t =>
        [...t.querySelectorAll('.tok')].map(s => +s.dataset.id))""")


def check_trajectory(page, run: Path, stage: str, iteration: int, trajectory_id: str) -> None:
    """The trajectory view shows each sample's recorded ids, in order, and their text as the
    run's tokenizer decodes them (special tokens included)."""
    rows = duck(run, "SELECT token_ids, loss_mask FROM samples WHERE stage = ? AND iteration = ? AND trajectory_id = ? "
                     "AND token_ids IS NOT NULL ORDER BY turn_index, segment_index", [stage, iteration, trajectory_id])
    assert rows, trajectory_id
    assert tokens_on_page(page) == [r["token_ids"] for r in rows]
    tokenizer = TokenPieces(run / "checkpoints" / "final" if (run / "checkpoints" / "final").is_dir() else run / "base_model").tok
    texts = page.evaluate("""[...document.querySelectorAll('.turn')].map(t =>
        [...t.querySelectorAll('.tok')].map(s => s.classList.contains('partial') ? '' : s.textContent).join(''))""")
    for shown, row in zip(texts, rows):
        assert shown == visible(tokenizer.decode(row["token_ids"], skip_special_tokens=False))
    trained = page.evaluate("[...document.querySelectorAll('.turn')].map(t => t.querySelectorAll('.tok.act').length)")
    assert trained == [sum(r["loss_mask"]) for r in rows]
