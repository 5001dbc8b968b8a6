"""An MCP server for tests: state, files, the host's view, a crash and a hang."""

import json
import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("probe", log_level="ERROR")
task = json.loads(os.environ.get("TURNFORGE_TASK") or "{}")
counter = {"n": int(task.get("start", 0))}


@server.tool()
def bump() -> str:
    """Add one to this server's counter and return it."""
    counter["n"] += 1
    return str(counter["n"])


@server.tool()
def write(path: str, text: str) -> str:
    """Write a file.

    Args:
        path: Where.
        text: What.
    """
    with open(path, "w") as f:
        f.write(text)
    return "ok"


@server.tool()
def read(path: str) -> str:
    """Read a file.

    Args:
        path: Which.
    """
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        raise ToolError(f"cannot read {path}: {err.strerror}") from None


@server.tool()
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


@server.tool()
def hang() -> str:
    """Never answer."""
    time.sleep(3600)
    return "late"


if __name__ == "__main__":
    server.run("stdio")
