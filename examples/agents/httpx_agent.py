"""An agent written with plain ``httpx`` against the OpenAI chat-completions route: two turns,
a move and then a confirmation; rewarded when the first answer names the task's move."""

from __future__ import annotations

import httpx

MOVES = ("Up", "Down", "Left", "Right")


def agent(task: dict, base_url: str) -> float:
    with httpx.Client(base_url=base_url, timeout=60) as http:
        messages = [{"role": "user", "content": f"Board {task['board']}. Which move? Up, Down, Left or Right."}]
        first = http.post("/chat/completions", json={"model": "policy", "messages": messages}).raise_for_status()
        answer = first.json()["choices"][0]["message"]["content"] or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
        http.post("/chat/completions", json={"model": "policy", "messages": messages}).raise_for_status()
    said = [m for m in MOVES if m.lower() in answer.lower()]
    return 1.0 if said == [task["move"]] else 0.0
