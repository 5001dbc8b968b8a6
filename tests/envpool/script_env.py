"""The scripted test env shared by the EnvPool tests, in its own module so that worker
processes and Ray actors import it by reference without importing a test module."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from turnforge.envs import LevelEnv, Outcome, make, register


class ScriptEnv(LevelEnv):
    """Actions are commands: 'sleep S', 'spin S' (busy CPU loop), 'alloc MB', 'raise', 'crash' (the process exits), 'crash_once P' /
    'hang_once P' (crash / hang 60 s unless file P exists, creating it first), anything else a
    plain move. Every completed action draws from ``self.rng``, so observations depend on the
    RNG state and a wrongly restored snapshot shows."""

    instructions = "Type a command."
    valid_actions_text = "any text"

    def generate_level(self, level_seed: int) -> int:
        return level_seed % 1000

    def level_key(self, level: int) -> str:
        return str(level)

    def initial_state(self, level: int, rng: random.Random) -> dict:
        return {"level": level, "n": 0, "x": rng.randint(0, 10**6)}

    def render(self) -> str:
        return f"level {self.state['level']} move {self.state['n']} x {self.state['x']}"

    def parse_action(self, text: str) -> str:
        return text

    def apply(self, action: str) -> Outcome:
        cmd, _, arg = action.partition(" ")
        if cmd == "sleep":
            time.sleep(float(arg))
        elif cmd == "spin":
            end = time.process_time() + float(arg)
            while time.process_time() < end:
                pass
        elif cmd == "alloc":
            self.state["blob"] = bytearray(int(arg) * 2**20)
        elif cmd == "raise":
            raise RuntimeError("boom from the env")
        elif cmd == "crash":
            os._exit(3)
        elif cmd in ("crash_once", "hang_once") and not Path(arg).exists():
            Path(arg).touch()
            if cmd == "crash_once":
                os._exit(3)
            time.sleep(60)
        self.state["n"] += 1
        self.state["x"] = self.rng.randint(0, 10**6)
        return Outcome(reward=1.0)


register("test-script", ScriptEnv, overwrite=True)


def run_reference(seed: int, actions: list[str]) -> list[str]:
    """Observations of an in-process ``test-script`` env: the reset, then one per action."""
    env = make("test-script")
    obs = [env.reset(seed=seed)]
    obs += [env.step(a).observation for a in actions]
    return obs
