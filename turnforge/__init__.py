"""turnforge: multi-turn reinforcement learning for LLM agents in interactive environments.

The env contract is importable from the top level: ``turnforge.Env`` (``reset(task, seed)``,
``step(action)``), ``turnforge.StepResult``, ``turnforge.Task`` and the task sources
``turnforge.TaskDataset`` / ``turnforge.TaskGenerator``.
"""

__version__ = "0.1.0"

from turnforge.envs.base import Env  # noqa: E402
from turnforge.envs.tasks import TaskDataset, TaskGenerator  # noqa: E402
from turnforge.types import StepResult, Task  # noqa: E402

__all__ = ["Env", "StepResult", "Task", "TaskDataset", "TaskGenerator", "__version__"]
