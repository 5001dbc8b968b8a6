"""An agent that compacts its own history, written with the official ``openai`` package: it
asks the model to think about the board, then for a one-line summary, and then restarts its
conversation from the task and that summary (as long-horizon agents do when their context
fills up) before asking for the move.

The gateway records the restarted conversation as a new segment of the same rollout
(``turnforge.gateway.trace``): the summary is trained in the segment where the model wrote
it and is context in the next, and the rollout's reward reaches both.
"""

from __future__ import annotations

from openai import OpenAI

MOVES = ("Up", "Down", "Left", "Right")
SYSTEM = "Answer with one of Up, Down, Left, Right."


def agent(task: dict, base_url: str) -> dict:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)

    def ask(messages: list[dict]) -> str:
        return client.chat.completions.create(model="policy", messages=messages, max_tokens=8).choices[0].message.content or ""

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Board {task['board']}. Think first."}]
    messages.append({"role": "assistant", "content": ask(messages)})
    messages.append({"role": "user", "content": "Summarize what you know in one line."})
    summary = ask(messages)
    # compaction: a fresh conversation holds only the task and the summary
    restarted = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"Board {task['board']}. Your notes: {summary}\nWhich move?"}]
    answer = ask(restarted)
    said = [m for m in MOVES if m.lower() in answer.lower()]
    won = said == [task["move"]]
    return {"reward": 1.0 if won else 0.0, "success": won, "metrics": {"summary_chars": len(summary)}}
