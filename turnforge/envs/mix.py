"""``mix``: one env over several, for training one policy on a mix of tasks (multi-task RL).

``env.id=mix`` with ``env.kwargs={envs: [{id: sokoban, kwargs: {dim: 6}}, {id: frozenlake}], weights: [0.5, 0.5]}``:
task ``i`` of a split is task ``i`` of the same split of one member env, the member drawn from
``weights`` by a hash of (split, i) — fixed for the mix, whatever else the run does. So
``env.kwargs.weights=[1, 0]`` gives exactly the first member's tasks (held-out task ``i`` is the
member's held-out task ``i``), which is how a mix-trained policy is evaluated on one member env
with the prompts it trained on (``turnforge eval CKPT env.kwargs.weights=[1,0]``).

The mix has a capability when every member has it (snapshots, anchor keys, potentials, experts,
random actions, reseeding), delegating to the member playing the current episode; snapshots and
anchor keys carry the member's name. Members must agree on what frames their observations (tool
schemas, observation role); when their instructions differ, the system prompt shows each member's
under its name. Guidance, derived tasks and final answers are not offered by a mix. A member's
task data is kept in ``task.data`` as ``{"env": member id, "data": the member task's data}``.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

from turnforge.envs.base import Env, capabilities, close_env
from turnforge.envs.tasks import TaskSource
from turnforge.errors import UserError
from turnforge.seeding import stable_hash
from turnforge.types import EnvSnapshot, StepResult, Task

#: Capabilities a mix offers when every member does: (capability, the methods installed).
_DELEGATED = (("snapshot", ("snapshot", "restore")), ("anchor_key", ("anchor_key",)), ("potential", ("potential",)),
              ("expert", ("expert_action",)), ("reseed", ("reseed",)), ("random_action", ("random_action",)))


def _member_spec(i: int, spec: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, Mapping) or "id" not in spec or set(spec) - {"id", "kwargs"}:
        raise UserError(f"env mix: envs[{i}] is {spec!r}; give an env id or {{id: ID, kwargs: {{...}}}}")
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise UserError(f"env mix: envs[{i}].kwargs is {kwargs!r}; give a mapping of the env's options")
    return str(spec["id"]), dict(kwargs)


class MixTasks(TaskSource):
    """Task ``i`` of a split: the member's task ``i`` of that split, the member drawn by weight."""

    def __init__(self, members: Sequence[Env], weights: Sequence[float]) -> None:
        self.members, self.weights = list(members), [float(w) for w in weights]

    def member_index(self, split: str, index: int) -> int:
        u = (stable_hash("mix", split, int(index)) % 1_000_003) / 1_000_003 * sum(self.weights)
        for j, w in enumerate(self.weights):
            if u < w:
                return j
            u -= w
        return max(j for j, w in enumerate(self.weights) if w > 0)  # rounding at the top end

    def task(self, split: str, index: int) -> Task:
        j = self.member_index(split, index)
        inner = self.members[j].task(split, index)
        return Task("", split, index, {"env": self.members[j].env_id, "data": inner.data})  # type: ignore[arg-type]

    def size(self, split: str) -> int | None:
        """The smallest member's size (task ``i`` must exist in every member a draw may pick); None when all are unbounded."""
        sizes = [s for m in self.members if (s := m.task_source().size(split)) is not None]
        return min(sizes) if sizes else None

    def key(self, task: Task) -> str:
        data = task.data or {}
        j = self.names.index(data["env"])
        return f"{data['env']}:{self.members[j].task_source().key(self.member_task(task, j))}"

    @property
    def names(self) -> list[str]:
        return [m.env_id for m in self.members]

    def member_task(self, task: Task, j: int) -> Task:
        """The task of member ``j`` that the mix task ``task`` wraps."""
        return Task(self.members[j].env_id, task.split, task.index, (task.data or {}).get("data"))


class MixEnv(Env):
    """See the module docstring."""

    def __init__(self, envs: Sequence[Any] = (), weights: Sequence[float] | None = None) -> None:
        from turnforge.envs.registry import make

        if not envs or isinstance(envs, (str, Mapping)):
            raise UserError("env mix needs env.kwargs.envs, a list of at least 2 envs, e.g. "
                            "{envs: [{id: sokoban}, {id: frozenlake}]}")
        specs = [_member_spec(i, s) for i, s in enumerate(envs)]
        if len(specs) < 2:
            raise UserError(f"env mix needs at least 2 envs in env.kwargs.envs, got {len(specs)}")
        names = [name for name, _ in specs]
        if "mix" in names or len(set(names)) != len(names):
            raise UserError(f"env mix: envs {names} must be distinct env ids other than 'mix'")
        ws = [1.0] * len(specs) if weights is None else list(weights)
        if len(ws) != len(specs) or any(not isinstance(w, (int, float)) or w < 0 for w in ws) or sum(ws) <= 0:
            raise UserError(f"env mix: weights {list(ws)} must be {len(specs)} non-negative numbers, not all 0 (one per env)")
        self.members = [make(name, **kwargs) for name, kwargs in specs]
        for field in ("tools", "observation_role"):
            if len({repr(getattr(m, field)) for m in self.members}) > 1:
                raise UserError(f"env mix: envs {names} have different {field}; a mix needs members that agree on it")
        texts = [m.instructions for m in self.members]
        self.instructions = texts[0] if len(set(texts)) == 1 else "\n\n".join(
            f"[{m.env_id}]\n{m.instructions}" for m in self.members if m.instructions)
        self.observation_role = self.members[0].observation_role
        self.tools = self.members[0].tools
        same_actions = len({frozenset(m.action_names) for m in self.members}) == 1
        self.action_names = self.members[0].action_names if same_actions else ()
        self.tasks_may_be_alike = any(m.tasks_may_be_alike for m in self.members)
        self.tasks = MixTasks(self.members, ws)
        self.active: Env | None = None
        for name, methods in _DELEGATED:  # installed only when every member has the capability
            if all(getattr(capabilities(m), name) for m in self.members):
                for method in methods:
                    setattr(self, method, getattr(self, f"_{method}"))

    # ------------------------------------------------------------------ the contract
    def reset(self, task: Task, seed: int) -> str:
        data = task.data or {}
        if "env" not in data:
            raise ValueError(f"env mix: task {task} is not a mix task (its data names no member env)")
        j = self.tasks.names.index(data["env"])
        self.active = self.members[j]
        return self.active.reset(self.tasks.member_task(task, j), seed)

    def step(self, action: str) -> StepResult:
        if self.active is None:
            raise RuntimeError("env mix: step() before reset()")
        return self.active.step(action)

    def task_label(self, task: Task) -> str:
        """The member env a task is drawn from (evaluations report success per member)."""
        return str((task.data or {}).get("env", ""))

    def close(self) -> None:
        for m in self.members:
            close_env(m)

    # ------------------------------------------------------------------ delegated capabilities
    def _playing(self) -> Env:
        if self.active is None:
            raise RuntimeError("env mix: no episode is being played (call reset() first)")
        return self.active

    def _snapshot(self) -> EnvSnapshot:
        env = self._playing()
        return EnvSnapshot(self.env_id, (env.env_id, env.snapshot()))  # type: ignore[attr-defined]

    def _restore(self, snapshot: EnvSnapshot) -> str:
        if not isinstance(snapshot, EnvSnapshot) or snapshot.env_id != self.env_id:
            raise TypeError(f"{self.env_id}: restore() needs an EnvSnapshot taken from this env id")
        name, inner = snapshot.payload
        self.active = self.members[self.tasks.names.index(name)]
        return self.active.restore(inner)  # type: ignore[attr-defined]

    def _anchor_key(self) -> str:
        env = self._playing()
        return f"{env.env_id}:{env.anchor_key()}"  # type: ignore[attr-defined]

    def _potential(self) -> float:
        return self._playing().potential()  # type: ignore[attr-defined]

    def _expert_action(self) -> str:
        return self._playing().expert_action()  # type: ignore[attr-defined]

    def _reseed(self, seed: int) -> None:
        self._playing().reseed(seed)  # type: ignore[attr-defined]

    def _random_action(self, rng: random.Random) -> str:
        env = self._playing()
        return env.random_action(rng) if callable(getattr(env, "random_action", None)) else rng.choice(env.action_names)  # type: ignore[attr-defined]
