"""A LangGraph agent (``pip install langgraph langchain-openai``, unmodified) playing turnforge's
``calculator`` env (Countdown with a calculator tool): LangGraph's prebuilt ReAct agent
(``langgraph.prebuilt.create_react_agent``) on LangChain's ``ChatOpenAI``, pointed at the
rollout's gateway URL over the chat-completions API.

The env is the game: its instructions are the system prompt, its first observation the user
message, its ``calculator`` tool (the env's own JSON schema) the agent's one tool. Each tool call
the graph runs is an env step (the call written in the env's tool-call format), and its result is
the env's observation; the agent's final message is the env's last step, which scores
``<answer>expression</answer>`` (any other text, or none, is an invalid action: the env's
penalty). The reward is the episode's return, the sum of the env's step rewards.

A task is ``{"index": i, "split": "train"}``: level ``i`` of the env's split (``countdown.jsonl``).
The graph stops at a reply without tool calls or after ``MAX_MODEL_CALLS`` model calls (its
recursion limit: LangGraph then ends on its own "need more steps" message, which is not the
model's, so the env scores an empty answer).
"""

from __future__ import annotations

from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from turnforge.envs import make
from turnforge.types import StepResult, Task

ENV_ID = "calculator"
ENV_KWARGS = {"num_numbers": 2, "max_value": 9, "max_tool_calls": 1}
MAX_MODEL_CALLS = 3


def agent(task: dict, base_url: str) -> dict:
    env = make(ENV_ID, **ENV_KWARGS)
    first = env.reset(Task(ENV_ID, task["split"], int(task["index"])))
    steps: list[StepResult] = []

    def calculator(**arguments) -> str:
        """The env's tool: the call, as the model wrote its arguments, is an env step (the env checks
        them against its schema); the step's observation is the result."""
        if env.done:
            return "The episode is over."
        steps.append(env.step(env.call_text("calculator", arguments)))
        return steps[-1].observation

    (schema,) = env.tools
    tool = StructuredTool.from_function(calculator, name=schema["function"]["name"],
                                        description=schema["function"]["description"],
                                        args_schema=schema["function"]["parameters"])
    # chat completions: ChatOpenAI's own choice for function tools, pinned (use_responses_api=False)
    model = ChatOpenAI(base_url=base_url, api_key="unused", model="policy", max_retries=0, use_responses_api=False)
    graph = create_react_agent(model, [tool], prompt=env.instructions)
    # a model call and a tool round are a graph step each: 2k - 1 steps allow k model calls
    state = graph.invoke({"messages": [("user", first)]}, {"recursion_limit": 2 * MAX_MODEL_CALLS - 1})
    last = state["messages"][-1]
    # the model's own final reply (ChatOpenAI records its finish_reason; LangGraph's stand-in has none)
    replied = isinstance(last, AIMessage) and not last.tool_calls and "finish_reason" in last.response_metadata
    tool_calls = len(steps)
    if not env.done:
        steps.append(env.step(last.text if replied else ""))
    return {"reward": sum(s.reward for s in steps), "success": any(s.success for s in steps),
            "metrics": {"tool_calls": tool_calls, "replied": float(replied)}}
