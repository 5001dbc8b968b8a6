"""Multi-turn text environments: the Env contract, task sources, the registry, check_env, built-in games."""

from turnforge.envs.base import Capabilities, Env, InvalidAction, capabilities, parse_choice
from turnforge.envs.checker import EnvCheckError, EnvCodeError, check_env
from turnforge.envs.gym_adapter import from_gymnasium, to_gymnasium
from turnforge.envs.levels import LevelEnv, Outcome
from turnforge.envs.registry import list_envs, make, make_batch, register
from turnforge.envs.tasks import TaskDataset, TaskGenerator, TaskSource
from turnforge.seeding import stable_hash  # env authors seed their own draws with it
from turnforge.types import EnvSnapshot  # what snapshot() returns

# Built-ins are registered by "module:Class" strings, so a game's module is imported on first make().
register("sokoban", "turnforge.envs.sokoban:SokobanEnv", dim=6, num_boxes=1)
register("frozenlake", "turnforge.envs.frozenlake:FrozenLakeEnv", size=4, is_slippery=False)
register("frozenlake-slippery", "turnforge.envs.frozenlake:FrozenLakeEnv", size=4, is_slippery=True)
register("sokoban-slow", "turnforge.envs.latency:SlowSokobanEnv", dim=6, num_boxes=1)
register("keydoor", "turnforge.envs.keydoor:KeyDoorEnv")
register("2048", "turnforge.envs.game2048:Game2048Env", size=4, target_tile=256)
register("calculator", "turnforge.envs.tool.calculator:CalculatorEnv", num_numbers=2, max_value=9)
register("arithmetic", "turnforge.envs.tool.calculator:ArithmeticEnv", num_numbers=2, max_value=999)
register("ledger", "turnforge.envs.tool.ledger:LedgerEnv")
register("mcp-tools", "turnforge.envs.tool.mcp_tools:McpToolEnv")
register("python-tasks", "turnforge.envs.tool.python_tasks:PythonTasksEnv")
register("code-repair", "turnforge.envs.code.repair:CodeRepairEnv")
register("miniwob", "turnforge.envs.web.miniwob:MiniWoBEnv")
register("gui-click", "turnforge.envs.gui.click:GuiClickEnv")
register("terminal", "turnforge.envs.terminal.env:TerminalEnv")
register("mix", "turnforge.envs.mix:MixEnv", envs=[{"id": "sokoban"}, {"id": "frozenlake"}])

__all__ = [
    "Capabilities",
    "Env",
    "EnvCheckError",
    "EnvCodeError",
    "EnvSnapshot",
    "InvalidAction",
    "LevelEnv",
    "Outcome",
    "TaskDataset",
    "TaskGenerator",
    "TaskSource",
    "capabilities",
    "check_env",
    "from_gymnasium",
    "list_envs",
    "make",
    "make_batch",
    "parse_choice",
    "register",
    "stable_hash",
    "to_gymnasium",
]
