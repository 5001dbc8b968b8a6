"""A headless Chromium per env, driven by Playwright's Python package.

The browser is Debian's ``chromium`` (``make setup`` installs it; ``TURNFORGE_CHROMIUM`` names
another binary), never one that ``playwright install`` downloads. Each env owns one browser,
launched at its first episode (an env built only to list tasks starts none) and closed by
``Env.close``, which env backends call when they close; a browser that crashes or hangs makes
the step raise, which the env backend counts as an infrastructure failure (and a hung worker
is restarted after ``engine.step_timeout``).

Playwright's sync API runs one driver process per Python process; envs of one process share
it, each with its own browser, and it stops when the process's last browser closes (nothing is
left running after a run). The driver and every page call live on one thread of their own
(``Browser.call``), so envs work from any thread and beside other Playwright users of the
process (the sync API refuses a second driver on a thread that has one); a call that takes
longer than ``CALL_TIMEOUT_S`` raises (an infrastructure failure, not a hung run). A process that
forked after starting the driver starts its own.

Temporary files: the driver and its browsers write theirs (profiles, artifacts, Chromium's
singleton sockets) under one directory per process, ``$TMPDIR/tf-browsers-<pid>-*``, removed
when the driver stops. Chromium's singleton socket lies 46 bytes below that directory and a
Unix socket path has at most 107 bytes, so where ``$TMPDIR`` is longer than 32 bytes (a
pytest ``tmp_path``, a CI runner's work directory) the directory goes under the first of
``/tmp``, ``/var/tmp`` and ``/dev/shm`` that is writable (``tmp_base``); with none of them, the
first browser start is one ``UserError`` line naming the cause. A process that was killed (a
hung env worker) cannot remove its own, so every driver start removes those of processes that
no longer exist: a crashed browser or a killed worker leaves nothing in ``/tmp`` for longer
than the next browser start.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from turnforge.errors import UserError
from turnforge.paths import alive

#: Chromium flags: no sandbox (the worker may run as root in a container), no GPU, no extensions
#: or first-run work, fixed device scale (screenshots and boxes in CSS pixels).
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-extensions",
                 "--no-first-run", "--force-device-scale-factor=1", "--disable-background-timer-throttling")

_driver: dict[int, Any] = {}  # pid -> the process's Playwright driver
_open: dict[int, int] = {}  # pid -> browsers open in that process
_thread: dict[int, ThreadPoolExecutor] = {}  # pid -> the thread every Playwright call of the process runs on
_tmp: dict[int, str] = {}  # pid -> the directory of the temporary files of the process's driver and browsers
_env_lock = threading.Lock()
TMP_PREFIX = "tf-browsers-"  # short: Chromium puts a Unix socket under it (paths of at most 107 bytes)
UNIX_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un's sun_path, less its NUL)
#: What goes below the base directory: the process's directory (a pid of up to 7 digits, mkdtemp's
#: 8 characters), then Chromium's singleton socket ("org.chromium.Chromium.XXXXXX/SingletonSocket").
BELOW_BASE = len(f"/{TMP_PREFIX}4194304-XXXXXXXX") + len("/org.chromium.Chromium.XXXXXX/SingletonSocket")
FALLBACK_BASES = ("/tmp", "/var/tmp", "/dev/shm")  # where the temporary files go when $TMPDIR is too long
CALL_TIMEOUT_S = 60.0
T = TypeVar("T")


def _on_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on the process's Playwright thread (started on first use)."""
    pid = os.getpid()
    if pid not in _thread:
        _thread.clear()  # a forked child's copy of its parent's thread does not run
        _thread[pid] = ThreadPoolExecutor(1, thread_name_prefix="turnforge-browser")
    return _thread[pid].submit(fn).result(timeout=CALL_TIMEOUT_S)


def chromium_path() -> str:
    """The Chromium binary, or one ``UserError`` line saying how to install it."""
    given = os.environ.get("TURNFORGE_CHROMIUM")
    path = given or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path or not os.access(path, os.X_OK):
        where = f"TURNFORGE_CHROMIUM={given!r} is not an executable" if given else "no `chromium` on PATH"
        raise UserError(f"browser envs need Chromium: {where}; run `make setup` (it runs `apt-get install -y chromium`) "
                        "or set TURNFORGE_CHROMIUM=/path/to/chromium")
    return path


def require_playwright() -> None:
    """One ``UserError`` line when Playwright's Python package is missing."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        raise UserError("browser envs need the `playwright` Python package: pip install -e '.[web]' "
                        "(`make setup` installs it; never `playwright install`, Debian's chromium is used)") from None


def _playwright():
    pid = os.getpid()
    if pid not in _driver:
        from playwright.sync_api import sync_playwright

        _driver.clear()  # a forked child's copy of its parent's driver is not usable
        _open.clear()
        _tmp.clear()
        remove_stale_tmp()
        root = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{pid}-", dir=tmp_base())
        # The driver takes the process's environment when it starts (Playwright has no option for
        # it) and its browsers inherit it: TMPDIR only for that moment.
        with _env_lock:
            before = os.environ.get("TMPDIR")
            os.environ["TMPDIR"] = root
            try:
                _driver[pid] = sync_playwright().start()
            finally:
                if before is None:
                    del os.environ["TMPDIR"]
                else:
                    os.environ["TMPDIR"] = before
        _tmp[pid] = root
        atexit.register(_stop, pid)
    return _driver[pid]


def tmp_base() -> str:
    """The directory the browsers' temporary directories go under: ``$TMPDIR`` (``tempfile``'s),
    or, where Chromium's socket path would pass ``UNIX_PATH_MAX`` below it, the first writable
    one of ``FALLBACK_BASES``; none: a ``UserError`` naming the cause and the fix."""
    given, limit = tempfile.gettempdir(), UNIX_PATH_MAX - BELOW_BASE
    for base in (given, *FALLBACK_BASES):
        if len(os.fsencode(base)) <= limit and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            return base
    raise UserError(f"browser envs need a temporary directory of at most {limit} bytes: Chromium's singleton socket "
                    f"goes {BELOW_BASE} bytes below it and a Unix socket path has at most {UNIX_PATH_MAX}; TMPDIR="
                    f"{given!r} is {len(os.fsencode(given))} bytes and none of {', '.join(FALLBACK_BASES)} is writable: "
                    "set TMPDIR to a shorter directory")


def remove_stale_tmp() -> list[str]:
    """Remove the browser temp directories of processes that no longer exist; returns them."""
    removed, base = [], tmp_base()
    for name in os.listdir(base):
        if not name.startswith(TMP_PREFIX):
            continue
        pid = name[len(TMP_PREFIX):].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


def _stop(pid: int) -> None:
    driver = _driver.pop(pid, None)
    _open.pop(pid, None)
    root = _tmp.pop(pid, None)
    if driver is not None and os.getpid() == pid:
        try:
            driver.stop()
        except Exception:  # the driver already went away with the interpreter
            pass
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


class Browser:
    """One headless Chromium with one page of ``width`` x ``height`` CSS pixels."""

    def __init__(self, width: int, height: int) -> None:
        self._pid = os.getpid()
        self.browser = self.page = None
        _on_thread(lambda: self._launch(width, height))

    def _launch(self, width: int, height: int) -> None:
        driver = _playwright()
        _open[self._pid] = _open.get(self._pid, 0) + 1
        try:
            tag = os.environ.get("TURNFORGE_BROWSER_TAG")  # lets a test find the browsers of its run
            args = [*CHROMIUM_ARGS, *([f"--turnforge-tag={tag}"] if tag else [])]
            self.browser = driver.chromium.launch(executable_path=chromium_path(), args=args)
            self.page = self.browser.new_page(viewport={"width": width, "height": height})
            self.page.set_default_timeout(10_000)
        except Exception:
            self._release()
            raise

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(page)`` on the Playwright thread."""
        return _on_thread(lambda: fn(self.page))

    def close(self) -> None:
        if os.getpid() != self._pid or self.browser is None:
            return
        browser, self.browser = self.browser, None

        def shut() -> None:
            try:
                browser.close()
            except Exception:  # already gone (crashed, or the driver stopped first)
                pass
            self._release()

        _on_thread(shut)

    def _release(self) -> None:
        """One browser fewer in this process; the driver stops with the last."""
        if os.getpid() != self._pid or self._pid not in _open:
            return
        _open[self._pid] -= 1
        if _open[self._pid] <= 0:
            _stop(self._pid)
