"""``turnforge view --serve``: the page on 127.0.0.1, its data paged through DuckDB.

A ``ThreadingHTTPServer`` from the standard library answers GET only, read-only:

- ``/`` the page (``turnforge.view.page.serve_page``);
- ``/api/overview``: every run's ``Overview`` (the run directory is read again first, so a live
  run shows the files written since; a file being written is left out);
- ``/api/groups?run=I&<BrowseQuery fields>``: a ``GroupPage``;
- ``/api/group?run=I&stage=S&iteration=N&group=G``, ``/api/trajectory?run=I&stage=S&iteration=N&id=T``:
  a ``Detail`` (the samples' tokens and the bytes of their ids);
- ``/api/same_task?run=I&task=T``: episode rows.

A bad parameter is a 400 with ``{"error": ...}``; nothing is ever written to the run directory.
"""

from __future__ import annotations

import errno
import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Sequence
from urllib.parse import parse_qsl, urlsplit

from turnforge.errors import UserError
from turnforge.view.data import RunView
from turnforge.view.records import BrowseQuery, to_jsonable
from turnforge.view.page import serve_page


class ViewServer:
    """The viewer's HTTP server on ``host:port`` (0 = a free port), bound when made: a port in
    use is a ``UserError``. ``serve_forever()`` blocks; ``start()`` serves from a thread;
    ``close()`` stops it."""

    def __init__(self, runs: Sequence[RunView], host: str = "127.0.0.1", port: int = 8765) -> None:
        self.runs = list(runs)
        self.page = serve_page(self.runs).encode()
        handler = type("Handler", (_Handler,), {"view": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use; give another --port (or --port 0 for a free one)") from None
            raise UserError(f"cannot listen on {host}:{port} ({err.strerror})") from None
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> "ViewServer":
        if self._thread is not None:  # serving already (a second loop would outlive close())
            return self
        self._thread = threading.Thread(target=self.serve_forever, name="turnforge-view", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> "ViewServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the API
    def run(self, params: dict[str, str]) -> RunView:
        text = params.get("run", "0")
        if not text.isdigit() or int(text) >= len(self.runs):
            raise UserError(f"run={text!r}: give 0" + (f" to {len(self.runs) - 1}" if len(self.runs) > 1 else ""))
        return self.runs[int(text)]

    def answer(self, path: str, params: dict[str, str]) -> Any:
        """The JSON answer of an ``/api/...`` path (``UserError`` for a bad parameter)."""
        routes: dict[str, Callable[[dict[str, str]], Any]] = {
            "overview": self._overview, "groups": self._groups, "group": self._group,
            "trajectory": self._trajectory, "same_task": self._same_task,
        }
        name = path.removeprefix("/api/")
        if name not in routes:
            raise UserError(f"no API {path!r}; valid: " + ", ".join(f"/api/{r}" for r in routes))
        return to_jsonable(routes[name](params))

    def _overview(self, params: dict[str, str]) -> Any:
        for r in self.runs:
            r.refresh()
        return [r.overview() for r in self.runs]

    def _groups(self, params: dict[str, str]) -> Any:
        run = self.run(params)
        run.refresh()
        return run.groups(BrowseQuery.from_params(params))

    def _group(self, params: dict[str, str]) -> Any:
        return self.run(params).group(_need(params, "stage"), _int(params, "iteration"), _need(params, "group"))

    def _trajectory(self, params: dict[str, str]) -> Any:
        detail = self.run(params).trajectory(_need(params, "stage"), _int(params, "iteration"), _need(params, "id"))
        data = to_jsonable(detail)
        for t in data["trajectories"]:  # 64-bit seeds: beyond a JS number
            t["env_seed"] = None if t["env_seed"] is None else str(t["env_seed"])
        return data

    def _same_task(self, params: dict[str, str]) -> Any:
        return self.run(params).same_task(_need(params, "task"))


def _need(params: dict[str, str], key: str) -> str:
    if not params.get(key):
        raise UserError(f"missing parameter {key!r}")
    return params[key]


def _int(params: dict[str, str], key: str) -> int:
    text = _need(params, key)
    try:
        return int(text)
    except ValueError:
        raise UserError(f"parameter {key}={text!r} is not an integer") from None


class _Handler(BaseHTTPRequestHandler):
    view: ViewServer
    server_version = "turnforge-view"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the command prints its URL only
        pass

    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        if url.path in ("/", "/index.html"):
            return self._send(HTTPStatus.OK, self.view.page, "text/html; charset=utf-8")
        if not url.path.startswith("/api/"):
            return self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {url.path!r}"})
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        if url.path == "/api/image":  # a sample's image, as PNG
            try:
                png = self.view.run(params).image(_need(params, "sha"))
            except UserError as err:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
            if png is None:
                return self._json(HTTPStatus.NOT_FOUND, {"error": f"no image {params.get('sha')!r} in this run"})
            return self._send(HTTPStatus.OK, png, "image/png")
        try:
            body = self.view.answer(url.path, params)
        except UserError as err:
            return self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
        except Exception as err:  # noqa: BLE001 - a bug: the page shows it, the server goes on
            return self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {type(err).__name__}: {err}"})
        self._json(HTTPStatus.OK, body)

    def _json(self, status: HTTPStatus, body: Any) -> None:
        self._send(status, json.dumps(body, separators=(",", ":"), allow_nan=False).encode(), "application/json")

    def _send(self, status: HTTPStatus, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)
