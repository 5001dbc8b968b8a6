"""An MCP server (stdio) of a shop's inventory: the tools an agent uses in the env ``mcp-tools``.

turnforge starts one process of it per episode, inside the sandbox, with the episode's task
as JSON in ``TURNFORGE_TASK``: the task's ``stock`` (item -> count) is this process's
inventory, so two episodes never share it. Run it by hand with
``TURNFORGE_TASK='{"stock": {"pears": 3}}' python examples/mcp/inventory_server.py``.
"""

import json
import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError  # shown to the agent; other exceptions are hidden

server = MCPServer("inventory", log_level="ERROR")
task = json.loads(os.environ.get("TURNFORGE_TASK") or "{}")
stock: dict[str, int] = {str(k): int(v) for k, v in task.get("stock", {}).items()}


@server.tool()
def count(item: str) -> str:
    """How many of an item are in stock.

    Args:
        item: The item's name, e.g. "pears".
    """
    if item not in stock:
        raise ToolError(f"unknown item {item!r}; items: {', '.join(sorted(stock))}")
    return str(stock[item])


@server.tool()
def restock(item: str, amount: int) -> str:
    """Add an amount of an item to the stock (a new item starts at 0).

    Args:
        item: The item's name.
        amount: How many to add (1 or more).
    """
    if amount < 1:
        raise ToolError("amount must be 1 or more")
    stock[item] = stock.get(item, 0) + amount
    return str(stock[item])


if __name__ == "__main__":
    server.run("stdio")
