"""An agent written with smolagents (``pip install smolagents``): a ``ToolCallingAgent`` whose
model is smolagents' ``OpenAIServerModel`` pointed at the rollout's gateway URL. It has a
``hint`` tool; it is rewarded when its final answer names the task's move.

smolagents runs its own loop: it sends its own system prompt and tool list, parses the
model's tool calls (the gateway returns them as OpenAI ``tool_calls``), runs the tools, and
stops at ``final_answer`` or after ``max_steps``. An untrained model rarely calls
``final_answer``: smolagents then asks the model once more for an answer (one more gateway
call), which is scored like any other.
"""

from __future__ import annotations

import logging

from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

MOVES = ("Up", "Down", "Left", "Right")
logging.getLogger("smolagents").setLevel(logging.ERROR)


class Hint(Tool):
    name = "hint"
    description = "Tell which move to make."
    inputs: dict = {}
    output_type = "string"

    def __init__(self, move: str) -> None:
        super().__init__()
        self.move = move

    def forward(self) -> str:
        return self.move


def agent(task: dict, base_url: str) -> dict:
    # tool_choice="auto": smolagents asks for "required", which the gateway refuses (400) rather than
    # pretend: nothing constrains a sampled reply to be a tool call
    model = OpenAIServerModel(model_id="policy", api_base=base_url, api_key="unused", client_kwargs={"max_retries": 0},
                              tool_choice="auto")
    runner = ToolCallingAgent(tools=[Hint(task["move"])], model=model, max_steps=2, verbosity_level=0)
    answer = str(runner.run(f"Board {task['board']}. Which move: Up, Down, Left or Right?"))
    said = [m for m in MOVES if m.lower() in answer.lower()]
    won = said == [task["move"]]
    return {"reward": 1.0 if won else 0.0, "success": won, "metrics": {"steps": len(runner.memory.steps)}}
