"""mini-swe-agent (``pip install --no-deps mini-swe-agent platformdirs``), unmodified, on terminal
tasks: its ``DefaultAgent`` with its own prompts (``mini.yaml``) and tool-call parsing, its model
pointed at the rollout's gateway URL, its commands run in the ``terminal`` env's sandboxed box,
and the task's hidden tests scoring the final workspace (``turnforge.envs.terminal.harness``).

A task is a terminal task's data, e.g. a generated shell task ``{"source": "generated",
"family": "count_lines", "level": 1, "seed": 7, "split": "train"}`` (``terminal_tasks.jsonl``)
or a Harbor task directory ``{"source": "harbor", "path": "/abs/task-dir", "split": ...}``.
The agent stops when its command prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` first, after
``STEP_LIMIT`` model calls, or after 3 replies in a row without a bash tool call; the verifier's
reward is returned either way. A verifier or sandbox failure raises: the trainer counts an
infrastructure failure, never a 0.
"""

from __future__ import annotations

from turnforge.envs.terminal.harness import MiniSweConfig, gateway_model, run_task

STEP_LIMIT = 8
CONFIG = MiniSweConfig(step_limit=STEP_LIMIT, command_timeout_s=10.0)


def agent(task: dict, base_url: str) -> dict:
    result = run_task(task, gateway_model(base_url, CONFIG), CONFIG)
    return {"reward": result.reward, "success": result.success, "metrics": result.metrics()}
