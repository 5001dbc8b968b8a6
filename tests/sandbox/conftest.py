"""Fixtures of the sandbox tests: sandboxes (skipped where bubblewrap cannot run), a unique
token, a host listener on 127.0.0.1 that counts connections, and a survivor check."""

from __future__ import annotations

import os
import select
import socket
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
from helpers import bwrap_unusable

from turnforge.sandbox import Limits, Sandbox


@pytest.fixture()
def make_sandbox() -> Callable[..., Sandbox]:
    """``make_sandbox(**limit_overrides)``: a bwrap ``Sandbox``; skips the test where bwrap cannot run."""
    reason = bwrap_unusable()
    if reason:
        pytest.skip(reason)

    def make(**overrides) -> Sandbox:
        return Sandbox(Limits(**{"timeout_s": 20.0, **overrides}))

    return make


@pytest.fixture()
def token() -> str:
    return f"tf-sandbox-{uuid.uuid4().hex}"


class Listener:
    """A TCP listener on 127.0.0.1 of the host; ``accepted()`` counts connections made to it."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]

    def accepted(self, wait_s: float = 0.2) -> int:
        count = 0
        while select.select([self.sock], [], [], wait_s)[0]:
            self.sock.accept()[0].close()
            count += 1
        return count


@pytest.fixture()
def listener() -> Iterator[Listener]:
    lst = Listener()
    yield lst
    lst.sock.close()


@pytest.fixture()
def survivors() -> Callable[[str], list[int]]:
    """``survivors(token)``: host pids (other than ours) whose command line contains ``token``."""

    def find(token: str) -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if token.encode() in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    pass
        return found

    return find
