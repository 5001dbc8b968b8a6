"""``turnforge view RUN [RUN2] [-o FILE.html] [--serve [--port P]]``: checks, then the page.

Every argument is checked before a run is read; every run directory is checked (and its
files opened) before anything is written or served. Problems are ``UserError``s: one line,
exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from turnforge.errors import UserError
from turnforge.paths import check_out_file, write_atomic

DEFAULT_PORT = 8765
#: A page bigger than this gets a note pointing at --serve.
LARGE_PAGE_BYTES = 50 * 2**20


def default_out(runs: Sequence[Path]) -> Path:
    """``RUN/view.html``, or ``RUN/view-vs-<RUN2's name>.html`` for two runs."""
    return runs[0] / ("view.html" if len(runs) == 1 else f"view-vs-{runs[1].resolve().name}.html")


def view(runs: Sequence[Path], out: Path | None, serve: bool, port: int | None) -> None:
    """Write the self-contained page of ``runs`` to ``out`` (default ``default_out``), or with
    ``serve`` serve it on 127.0.0.1:``port`` until interrupted."""
    # 1. the arguments
    if not 1 <= len(runs) <= 2:
        raise UserError(f"give one or two run directories (got {len(runs)}): turnforge view RUN [RUN2]")
    if serve and out is not None:
        raise UserError("-o writes a file and --serve serves the page; give one of them")
    if port is not None and not serve:
        raise UserError("--port is the port of --serve; add --serve, or drop --port to write a file")
    if out is not None and out.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"-o {str(out)!r} must end in .html")
    if out is not None:
        check_out_file(out, "-o", refuse_existing=False)

    # 2. the runs (a bad directory is one line, before anything is written or served)
    from turnforge.view.data import RunView

    views = [RunView(path, i) for i, path in enumerate(runs)]
    try:
        if serve:
            _serve(views, DEFAULT_PORT if port is None else port)
        else:
            _write(views, out if out is not None else default_out(runs))
    finally:
        for v in views:
            v.close()


def _write(views, out: Path) -> None:
    from turnforge.view.page import build_page

    if out.parent.is_dir():
        check_out_file(out, "output file", refuse_existing=False)
    html = build_page(views)
    try:
        write_atomic(out, html)
    except OSError as err:
        raise UserError(f"cannot write {str(out)!r}: {err.strerror}") from None
    totals = [v.overview().totals for v in views]
    what = "; ".join(f"{v.overview().name}: {t.episodes} episodes, {t.samples} samples" for v, t in zip(views, totals))
    print(f"wrote {out} ({len(html.encode()) / 2**20:.1f} MB; {what}); open it in a browser")
    if len(html) > LARGE_PAGE_BYTES:
        print("note: a page this large opens slowly; `turnforge view RUN --serve` pages the run through DuckDB instead")


def _serve(views, port: int) -> None:
    from turnforge.view.server import ViewServer

    server = ViewServer(views, "127.0.0.1", port)  # binds now: a port in use is one line
    names = " and ".join(v.overview().name for v in views)
    print(f"serving {names} on {server.url} (read-only); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
