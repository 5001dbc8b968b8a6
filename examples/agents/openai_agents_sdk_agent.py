"""An OpenAI Agents SDK agent (``pip install openai-agents``, unmodified) playing turnforge's
``calculator`` env (Countdown with a calculator tool): an ``agents.Agent`` run by ``Runner.run``
on the SDK's ``OpenAIResponsesModel`` (the Responses API, the SDK's default), whose
``AsyncOpenAI`` client points at the rollout's gateway URL. Tracing is off (it would upload
spans to OpenAI).

The env is the game, as in ``langgraph_agent.py``: its instructions are the agent's, its first
observation the input, its ``calculator`` tool (the env's own JSON schema) a ``FunctionTool``
whose every call is an env step; the agent's final output is the env's last step, which scores
``<answer>expression</answer>`` (any other text, or none, is an invalid action: the env's
penalty). The reward is the episode's return, the sum of the env's step rewards.

A task is ``{"index": i, "split": "train"}``: level ``i`` of the env's split (``countdown.jsonl``).
The run stops at a reply without tool calls, after ``MAX_MODEL_CALLS`` model calls (the SDK's
``max_turns``), or when the SDK refuses a reply (``ModelBehaviorError``: it does so for a reply cut
at its token limit, a ``response.incomplete``); the env then scores an empty answer. These are
the model's doing, so they are rewarded episodes, not failures.
"""

from __future__ import annotations

import json
import logging

from agents import (Agent, FunctionTool, MaxTurnsExceeded, ModelBehaviorError, OpenAIResponsesModel, Runner,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from turnforge.envs import make
from turnforge.types import StepResult, Task

ENV_ID = "calculator"
ENV_KWARGS = {"num_numbers": 2, "max_value": 9, "max_tool_calls": 1}
MAX_MODEL_CALLS = 3

set_tracing_disabled(True)
# the SDK logs every model error before raising it: a refused reply is scored (the docstring), the rest
# reach the trainer as the rollout's infrastructure failure, with their message
logging.getLogger("openai.agents").setLevel(logging.CRITICAL)


async def agent(task: dict, base_url: str) -> dict:
    env = make(ENV_ID, **ENV_KWARGS)
    first = env.reset(Task(ENV_ID, task["split"], int(task["index"])))
    steps: list[StepResult] = []

    async def calculator(ctx, arguments: str) -> str:
        """The env's tool: the call is an env step, its observation the result."""
        if env.done:
            return "The episode is over."
        steps.append(env.step(env.call_text("calculator", json.loads(arguments))))
        return steps[-1].observation

    (schema,) = env.tools
    tool = FunctionTool(name=schema["function"]["name"], description=schema["function"]["description"],
                        params_json_schema=schema["function"]["parameters"], on_invoke_tool=calculator,
                        strict_json_schema=False)  # the env's schema as it is; the env checks the arguments
    # closed in this event loop (the engine runs each rollout's coroutine in a loop of its own)
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        player = Agent(name="player", instructions=env.instructions, tools=[tool],
                       model=OpenAIResponsesModel(model="policy", openai_client=client))
        try:
            answer = str((await Runner.run(player, first, max_turns=MAX_MODEL_CALLS)).final_output)
        except (MaxTurnsExceeded, ModelBehaviorError):
            answer = None
    tool_calls = len(steps)
    if not env.done:
        steps.append(env.step(answer or ""))
    return {"reward": sum(s.reward for s in steps), "success": any(s.success for s in steps),
            "metrics": {"tool_calls": tool_calls, "replied": float(answer is not None)}}
