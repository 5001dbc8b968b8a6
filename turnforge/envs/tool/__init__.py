"""Tool-calling envs: typed Python tools, chat-template tool calls, tool-role results."""

from turnforge.envs.tool.base import TOOL_CALL_FORMATS, Tool, ToolCall, ToolEnv, ToolError, clean_output, parse_tool_calls

__all__ = ["TOOL_CALL_FORMATS", "Tool", "ToolCall", "ToolEnv", "ToolError", "clean_output", "parse_tool_calls"]
