"""turnforge: multi-turn reinforcement learning for LLM agents in interactive environments.

The env contract is importable from the top level: ``turnforge.Env`` (``reset(task, seed)``,
``step(action)``), ``turnforge.StepResult``, ``turnforge.Task`` and the task sources
``turnforge.TaskDataset`` / ``turnforge.TaskGenerator``.

Layers, bottom to top. A module imports only from its own layer or a lower one, at module level
and inside functions alike, and the units of a layer import each other without a circle
(``tests/test_layers.py`` reads every import and fails on one that climbs):

1. core: ``types``, ``errors``, ``seeding``, ``kernels``, ``memory``, ``batching``, ``plots``, ``paths``, ``settings``, ``algos``, ``optim``, ``dist``, ``runs``, ``config``
2. components: ``sandbox``, ``envs``, ``envpool``, ``policy``, ``rewards``, ``rollout``, ``critic``, ``data``, ``inference``
3. services: ``gateway``, ``view``
4. stages: ``train``
5. application: ``app``
6. commands: ``cli``, ``scaling``, ``merge``

The config *schema* is core (variant names are plain strings there); the application layer
loads a config, checks every variant name against its registry and every cross-key rule, sets
up the run and tells its story top to bottom (``turnforge.app``).
"""

__version__ = "0.1.0"

from turnforge.envs.base import Env  # noqa: E402
from turnforge.envs.tasks import TaskDataset, TaskGenerator  # noqa: E402
from turnforge.types import StepResult, Task  # noqa: E402

__all__ = ["Env", "StepResult", "Task", "TaskDataset", "TaskGenerator", "__version__"]
