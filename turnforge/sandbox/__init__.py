"""Run an untrusted program (an agent's code, a test it wrote) under declared limits.

    from turnforge.sandbox import Limits, Sandbox
    result = Sandbox(Limits(timeout_s=5)).run(["python3", "main.py"], files={"main.py": code})

The default backend, bubblewrap (``apt-get install -y bubblewrap``, 0.8 or newer), gives the
program no network (its own namespace, loopback only), a read-only view of the system without
the host's home, project or run directories, a private size-capped work dir, its own pid
namespace and ``/proc``, a scrubbed environment and no privileges (see ``bwrap.py``); rlimits
(``Limits``) cap CPU, memory, processes and file size, and the wall-clock timeout kills every
process in the sandbox. ``tests/sandbox/test_conformance.py`` shows each guarantee with an
attack that must fail.

``SandboxError`` is an infrastructure fault (drop the sample); whatever the program does
yields a ``Result``. Backend ``"unsafe-none"`` runs without isolation, with a loud warning.

A terminal env's box (``box.py``: ``Box``, ``BoxSpec``, ``open_box``; ``shell.py``: ``BwrapBox``)
keeps one bash per episode in such a sandbox: ``box.exec("cd src && make")``.
"""

from turnforge.sandbox.box import BOX_KILL_REASONS, BOXES, Box, BoxSnapshot, BoxSpec, ExecResult, open_box
from turnforge.sandbox.limits import KILL_REASONS, Limits, Result, SandboxError
from turnforge.sandbox.process import TRUNCATED
from turnforge.sandbox.sandbox import BACKENDS, Sandbox, UnsafeSandboxWarning
from turnforge.sandbox.shell import BwrapBox  # registers "bwrap" in BOXES

__all__ = [
    "BACKENDS", "BOXES", "BOX_KILL_REASONS", "KILL_REASONS", "TRUNCATED", "Box", "BoxSnapshot", "BoxSpec", "BwrapBox",
    "ExecResult", "Limits", "Result", "Sandbox", "SandboxError", "UnsafeSandboxWarning", "open_box",
]
