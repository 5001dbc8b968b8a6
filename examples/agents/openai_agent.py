"""An agent written with the official ``openai`` package: it offers the model a ``hint`` tool,
answers its tool calls, and is rewarded when the model's final answer names the task's move.

The tool round trip is what exact token capture must survive: the gateway returns
``tool_calls``; the agent sends them back in the assistant message with a ``tool`` message;
the gateway splices the re-sent history onto the tokens the model sampled.

``pinned_agent`` is the same agent sending ``temperature=1.0`` on every call, as many agent
frameworks do: while training, the trainer's temperature wins (``agent.sampling``).
"""

from __future__ import annotations

import json

from openai import NOT_GIVEN, OpenAI

MOVES = ("Up", "Down", "Left", "Right")
TOOLS = [{"type": "function", "function": {
    "name": "hint", "description": "Tell which move to make.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}]


def agent(task: dict, base_url: str, temperature: float | None = None) -> dict:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Answer with one of Up, Down, Left, Right."},
                {"role": "user", "content": f"Board {task['board']}. Which move?"}]
    tool_calls = 0
    for _ in range(3):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS,
            temperature=NOT_GIVEN if temperature is None else temperature).choices[0].message
        if not reply.tool_calls:
            break
        tool_calls += len(reply.tool_calls)
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"move": task["move"]})})
    said = [m for m in MOVES if m.lower() in (reply.content or "").lower()]
    won = said == [task["move"]]
    return {"reward": 1.0 if won else 0.0, "success": won, "metrics": {"tool_calls": tool_calls}}


def pinned_agent(task: dict, base_url: str) -> dict:
    return agent(task, base_url, temperature=1.0)
