"""Computation tasks the agent solves by writing Python that runs in the sandbox.

Each level is a question with one integer answer, from a few seeded families (Fibonacci
numbers, digit sums of powers, prime counts, Collatz steps, multiples in a range); the
``run_python`` tool runs the agent's program with ``python3`` in a ``turnforge.sandbox``
(no network, read-only system, private work dir, time and memory limits) and returns what
it printed. Reward ``success_reward`` for ``<answer>N</answer>`` with the right N.

The agent's program crashing, timing out or printing megabytes is a normal tool result
(exit code, the limit that killed it, output cut with a marker). The sandbox itself failing
(``SandboxError``: bubblewrap missing or broken) is raised out of ``step``, so the rollout
records an infrastructure failure instead of a reward. The expert writes a correct program,
runs it and answers what it printed.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from turnforge.envs.tool.base import ToolEnv, ToolError
from turnforge.errors import UserError

_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class PythonTask:
    family: str
    question: str
    answer: int
    program: str  # the expert's program


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[0:2] = b"\x00\x00"
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytes(len(range(i * i, n, i)))
    return sum(sieve)


def _make_task(family: str, rng: random.Random) -> PythonTask:
    if family == "fibonacci":
        n = rng.randint(30, 90)
        return PythonTask(family, f"What is the Fibonacci number F({n}), with F(0) = 0 and F(1) = 1?", _fib(n),
                          f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nprint(a)\n")
    if family == "digit_sum":
        a, b = rng.randint(2, 9), rng.randint(50, 200)
        return PythonTask(family, f"What is the sum of the decimal digits of {a}**{b}?", sum(map(int, str(a ** b))),
                          f"print(sum(int(d) for d in str({a} ** {b})))\n")
    if family == "primes":
        n = rng.randint(1000, 20000)
        return PythonTask(family, f"How many prime numbers are smaller than {n}?", _primes_below(n),
                          f"n = {n}\nsieve = [True] * n\nsieve[0:2] = [False, False]\n"
                          "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n"
                          "        sieve[i * i::i] = [False] * len(sieve[i * i::i])\nprint(sum(sieve))\n")
    if family == "collatz":
        n = rng.randint(100, 100_000)
        return PythonTask(family, f"How many Collatz steps (n -> n/2 if even, else 3n+1) take {n} to 1?", _collatz(n),
                          f"n, steps = {n}, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
                          "    steps += 1\nprint(steps)\n")
    p, q, n = rng.randint(3, 13), rng.randint(3, 13), rng.randint(10_000, 1_000_000)
    count = n // p + n // q - n // math.lcm(p, q)
    return PythonTask(family, f"How many integers from 1 to {n} are divisible by {p} or by {q}?", count,
                      f"print(sum(1 for k in range(1, {n} + 1) if k % {p} == 0 or k % {q} == 0))\n")


FAMILIES = ("collatz", "digit_sum", "fibonacci", "multiples", "primes")


class PythonTasksEnv(ToolEnv):
    """Integer-answer computation tasks solved with a sandboxed ``run_python`` tool."""

    def __init__(self, *, families: tuple[str, ...] | list[str] = FAMILIES, timeout_s: float = 10.0,
                 memory_mb: int = 512, sandbox_backend: str = "bwrap", max_starting: int | None = None,
                 max_tool_calls: int = 3,
                 success_reward: float = 1.0, **kwargs) -> None:
        from turnforge.sandbox import Limits, Sandbox

        unknown = sorted(set(families) - set(FAMILIES))
        if unknown or not families:
            raise UserError(f"unknown task families {unknown}; valid families: {', '.join(FAMILIES)}")
        kwargs.setdefault("max_steps", max_tool_calls + 3)
        super().__init__(max_tool_calls=max_tool_calls, **kwargs)
        self.families, self.success_reward = tuple(sorted(families)), float(success_reward)
        self.sandbox = Sandbox(Limits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)), memory_mb=memory_mb),
                               backend=sandbox_backend, max_starting=max_starting)

    @property
    def instructions(self) -> str:
        return ("Answer the question with one integer. You may run Python 3 programs with run_python and read what "
                "they print. Answer <answer>N</answer>.")

    def tool_functions(self):
        return [self.run_python]

    def run_python(self, code: str) -> str:
        """Run a Python 3 program in a sandbox (no network, no files kept) and return what it printed.

        Args:
            code: the program's source; print the values you need
        """
        result = self.sandbox.run(["python3", "main.py"], files={"main.py": code})
        parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
        if result.stderr.strip():
            parts.append("stderr:\n" + result.stderr.rstrip("\n"))
        if result.killed_reason is not None:
            parts.append(f"killed: {result.killed_reason} limit")
        elif result.exit_code != 0:
            parts.append(f"exit code {result.exit_code}")
        text = "\n".join(parts) or "(no output)"
        return ToolError(text) if result.exit_code != 0 or result.killed_reason else text

    def generate_level(self, level_seed: int) -> PythonTask:
        rng = random.Random(level_seed)
        return _make_task(rng.choice(self.families), rng)

    def level_key(self, level: PythonTask) -> str:
        return level.question

    def question(self, level: PythonTask) -> str:
        return level.question

    def score(self, level: PythonTask, answer: str) -> tuple[float, bool]:
        text = answer.strip().replace(",", "")
        won = _INT.fullmatch(text) is not None and int(text) == level.answer
        return (self.success_reward if won else 0.0), won

    def expert_action(self) -> str:

        calls = self.state["calls"]
        if calls and _INT.fullmatch(calls[-1][2].strip()):
            return f"<answer>{calls[-1][2].strip()}</answer>"
        return self.call_text("run_python", {"code": self.state["level"].program})
