"""The page: ``static/index.html`` with its style, script and data inlined.

File mode (``build_page``): one HTML file that needs nothing else (no network, no server). Per
run it embeds one JSON document (overview, every episode by column, every sample's place in the
token arrays, the bytes of each token id used, the gateway's splits) and the four per-token
arrays as raw little-endian bytes (``ids`` int32, ``logprobs`` float32 with NaN where nothing
was sampled, ``mask`` int8, ``versions`` int32); each is gzip-compressed and base64-encoded in a
``<script type="application/octet-stream">`` element, which the page decompresses with the
browser's own ``DecompressionStream``. Serve mode (``serve_page``) is the same page with no data:
it asks the local server (``turnforge.view.server``).
"""

from __future__ import annotations

import base64
import gzip
import json
from importlib import resources
from typing import Sequence

import numpy as np

from turnforge.data.store import SAMPLE_SPANS
from turnforge.view.data import RunView
from turnforge.view.records import to_jsonable

_MARKERS = ("__TF_TITLE__", "__TF_STYLE__", "__TF_SCRIPT__", "__TF_BOOT__", "__TF_DATA__")


def _static(name: str) -> str:
    return resources.files("turnforge.view").joinpath("static", name).read_text(encoding="utf-8")


def _fill(title: str, boot: dict, data: str) -> str:
    page = _static("index.html")
    values = dict(zip(_MARKERS, (_html_text(title), _static("style.css"), _static("app.js"),
                                 json.dumps(boot).replace("</", "<\\/"), data)))
    for marker in _MARKERS:  # each marker once, in order, and never inside an inserted value
        head, sep, tail = page.partition(marker)
        assert sep, f"index.html lacks {marker}"
        page = head + values[marker] + tail
    return page


def _html_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _packed(element_id: str, data: bytes) -> str:
    # mtime=0: the same run gives the same bytes
    b64 = base64.b64encode(gzip.compress(data, compresslevel=6, mtime=0)).decode("ascii")
    return f'<script id="{element_id}" type="application/octet-stream">{b64}</script>'


def _title(runs: Sequence[RunView]) -> str:
    names = [r.path.resolve().name for r in runs]
    return "turnforge view: " + " vs ".join(names)


def run_document(run: RunView) -> tuple[dict, dict[str, np.ndarray]]:
    """The JSON document and the per-token arrays the file-mode page embeds for ``run``."""
    arrays = run.token_arrays()
    pieces = run.pieces.table(np.unique(arrays.ids).tolist()) if run.pieces else {}
    special = sorted(run.pieces.special & {int(i) for i in pieces}) if run.pieces else []
    episodes = run.episode_columns()
    episodes["env_seed"] = [None if s is None else str(s) for s in episodes["env_seed"]]  # 64-bit: beyond a JS number
    doc = {
        "overview": to_jsonable(run.overview()),
        "episodes": episodes,
        "samples": {"episode": arrays.episode.tolist(), "turn_index": arrays.turn_index.tolist(),
                    "action_text": arrays.action_text, "turn_reward": arrays.turn_reward, "advantage": arrays.advantage,
                    "start": arrays.start.tolist(), "length": arrays.length.tolist(),
                    **{k: getattr(arrays, k).tolist() for k in SAMPLE_SPANS}, "images": arrays.images},
        "image_data": _image_data(run, arrays.images),
        "pieces": pieces,
        "special": special,
        "splits": run.splits(),
    }
    blobs = {"ids": arrays.ids.astype("<i4"), "logprobs": arrays.logprobs.astype("<f4"), "mask": arrays.mask.astype("i1"),
             "versions": arrays.versions.astype("<i4")}
    return doc, blobs


#: Bytes of images (PNG, before base64) a file-mode page embeds per run; the samples' images beyond it
#: show as their hash (``turnforge view --serve`` serves every one).
IMAGE_BUDGET = 8 * 2**20


def _image_data(run: RunView, images: list[list[str]]) -> dict[str, str]:
    """sha256 -> base64 PNG of the images the samples show, first seen first, up to ``IMAGE_BUDGET``."""
    out: dict[str, str] = {}
    used = 0
    for sha in dict.fromkeys(s for row in images for s in row or ()):
        png = run.image(sha)
        if png is None or used + len(png) > IMAGE_BUDGET:
            continue
        out[sha] = base64.b64encode(png).decode()
        used += len(png)
    return out


def build_page(runs: Sequence[RunView]) -> str:
    """The self-contained page of ``runs`` (one, or two side by side)."""
    parts = []
    for i, run in enumerate(runs):
        doc, blobs = run_document(run)
        parts.append(_packed(f"tf-run-{i}", json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()))
        parts += [_packed(f"tf-blob-{i}-{name}", arr.tobytes()) for name, arr in blobs.items()]
    return _fill(_title(runs), {"mode": "file", "runs": len(runs)}, "\n".join(parts))


def serve_page(runs: Sequence[RunView]) -> str:
    """The page that ``turnforge view --serve`` serves: no data, the server answers its queries."""
    return _fill(_title(runs), {"mode": "serve", "runs": len(runs)}, "")
