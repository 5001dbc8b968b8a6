"""Countdown with a calculator: combine the given numbers, each exactly once, with + - * /
and parentheses to reach the target. The agent may check expressions with the
``calculator`` tool before it answers ``<answer>expression</answer>``.

Levels are generated as in Countdown (TinyZero, Pan et al. 2025): the numbers are combined
left to right in a random order with random operators, keeping every intermediate result a
positive integer, so each level has a solution. Any expression that uses exactly the given
numbers and evaluates exactly to the target wins (reward ``success_reward``); a wrong or
malformed answer ends the episode with reward 0.

Two experts (``expert``): ``oracle`` checks the level's solution with the calculator and
answers it (wins every level; ``check_env`` proves solvability with it); ``guess`` is a
guess-and-check searcher that cannot do arithmetic in its head: it checks candidate
expressions (left-to-right combinations without commuted duplicates, in an order fixed per
level by a hash) with the calculator, answers the first whose result is the target, and when
its calls are spent answers the next unchecked candidate unverified. With two numbers and
one call it wins about 70% of the levels: demonstrations of the protocol that leave RL
something to learn (which operator to check first).
"""

from __future__ import annotations

import ast
import itertools
import json
import operator
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from turnforge.envs.tool.base import ToolEnv, ToolError
from turnforge.errors import UserError
from turnforge.seeding import stable_hash

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOL = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
MAX_EXPRESSION_CHARS = 200


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression of integers, + - * / and parentheses, and the
    integer literals it uses. ``ValueError`` (with the reason) for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    literals: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError("only integers, + - * / and parentheses are allowed")

    return ev(tree.body), literals


def format_value(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


@dataclass(frozen=True)
class CountdownLevel:
    numbers: tuple[int, ...]
    target: int
    solution: str


def left_to_right(numbers: tuple[int, ...], ops: str) -> list[tuple[str, int]]:
    """Every (expression, value) that combines ``numbers`` left to right in some order with
    operators of ``ops``, all intermediate results positive integers; distinct expressions."""
    out: dict[str, int] = {}
    for order in itertools.permutations(numbers):
        for chosen in itertools.product(ops, repeat=len(numbers) - 1):
            value, text, ok = Fraction(order[0]), str(order[0]), True
            for op, n in zip(chosen, order[1:]):
                value = _SYMBOL[op](value, Fraction(n))
                if value <= 0 or value.denominator != 1:
                    ok = False
                    break
                text = f"({text}){op}{n}" if op in "*/" and ("+" in text or "-" in text) else f"{text}{op}{n}"
            if ok:
                out.setdefault(text, int(value))
    return sorted(out.items())


class CalculatorEnv(ToolEnv):
    """Countdown with a calculator tool (see the module docstring)."""

    def __init__(self, *, num_numbers: int = 2, max_value: int = 9, ops: str = "+-*", max_tool_calls: int = 1,
                 expert: str = "oracle", success_reward: float = 1.0, **kwargs) -> None:
        if expert not in EXPERTS:
            raise UserError(f"unknown expert {expert!r}; valid experts: {', '.join(EXPERTS)}")
        if not 2 <= num_numbers <= 5:
            raise UserError(f"num_numbers must be in 2..5; got {num_numbers}")
        if max_value < 2:
            raise UserError(f"max_value must be >= 2; got {max_value}")
        if not ops or set(ops) - set(_SYMBOL):
            raise UserError(f"ops must be a non-empty string of + - * /; got {ops!r}")
        kwargs.setdefault("max_steps", max_tool_calls + 3)
        super().__init__(max_tool_calls=max_tool_calls, **kwargs)
        self.num_numbers, self.max_value, self.ops, self.success_reward = num_numbers, max_value, ops, float(success_reward)
        self.expert = expert

    @property
    def instructions(self) -> str:
        return (f"Combine all the numbers, each exactly once, with {' '.join(self.ops)} and parentheses to make the "
                f"target. You may check an expression with the calculator first. Answer <answer>expression</answer>.")

    def tool_functions(self):
        return [self.calculator]

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: integers, + - * / and parentheses, e.g. "(3+4)*2"
        """
        try:
            return format_value(evaluate(expression)[0])
        except ValueError as err:
            return ToolError(f"error: {err}")

    # ------------------------------------------------------------------ levels
    def generate_level(self, level_seed: int) -> CountdownLevel:
        rng = random.Random(level_seed)
        while True:
            numbers = tuple(rng.randint(1, self.max_value) for _ in range(self.num_numbers))
            options = left_to_right(numbers, self.ops)
            if options:
                solution, target = rng.choice(options)
                return CountdownLevel(numbers, target, solution)

    def level_key(self, level: CountdownLevel) -> str:
        return f"{level.numbers}->{level.target}"

    def question(self, level: CountdownLevel) -> str:
        return f"Numbers: {' '.join(map(str, level.numbers))}\nTarget: {level.target}"

    def score(self, level: CountdownLevel, answer: str) -> tuple[float, bool]:
        try:
            value, literals = evaluate(answer)
        except ValueError:
            return 0.0, False
        won = sorted(literals) == sorted(level.numbers) and value == level.target
        return (self.success_reward if won else 0.0), won

    # ------------------------------------------------------------------ expert
    def expert_action(self) -> str:
        level = self.state["level"]
        if self.expert == "oracle":
            if not self.state["calls"] and self.max_tool_calls > 0:
                return self.call_text("calculator", {"expression": level.solution})
            return f"<answer>{level.solution}</answer>"
        candidates = list(dict.fromkeys(_uncommuted(e) for e, _ in left_to_right(level.numbers, self.ops)))
        random.Random(stable_hash("expert-order", self.level_key(level))).shuffle(candidates)
        checked = {args: result for _, args, result in self.state["calls"]}
        for args, result in checked.items():
            if result == str(level.target):
                return f"<answer>{_expression_of(args)}</answer>"
        unchecked = [e for e in candidates if _args_of(e) not in checked]
        if len(self.state["calls"]) < self.max_tool_calls and unchecked:
            return self.call_text("calculator", {"expression": unchecked[0]})
        return f"<answer>{(unchecked or candidates)[0]}</answer>"


EXPERTS = ("guess", "oracle")


def _uncommuted(expression: str) -> str:
    """``expression`` with the operands of its first + or * in ascending order ("7+2" ->
    "2+7"), so a searcher does not check both orders."""
    m = re.match(r"^(\d+)([+*])(\d+)", expression)
    if m and int(m.group(1)) > int(m.group(3)):
        return f"{m.group(3)}{m.group(2)}{m.group(1)}{expression[m.end():]}"
    return expression


def _args_of(expression: str) -> str:
    """The arguments JSON of a calculator call, as ``ToolEnv`` records it."""
    return json.dumps({"expression": expression}, sort_keys=True)


def _expression_of(args: str) -> str:
    return json.loads(args)["expression"]


@dataclass(frozen=True)
class ArithmeticLevel:
    expression: str
    value: int


class ArithmeticEnv(CalculatorEnv):
    """Compute the value of an arithmetic expression of multi-digit integers (``num_numbers``
    numbers in 2..``max_value``, operators from ``ops``, no division) and answer the number:
    ``<answer>10081</answer>``. Unlike Countdown, the question holds no answer in plain
    sight: a small model cannot multiply three-digit numbers in its head, so the way to
    win is to pass the expression to the calculator and copy its result. Only a plain
    integer answer counts (answering the expression itself scores 0). The ``oracle``
    expert does exactly that; ``guess`` answers at once, off by one (always wrong: a
    player that skips the tool, for tests)."""

    def __init__(self, *, num_numbers: int = 2, max_value: int = 999, ops: str = "+-*", expert: str = "oracle",
                 **kwargs) -> None:
        if "/" in ops:
            raise UserError(f"ops must be a non-empty string of + - * (no /: answers are integers); got {ops!r}")
        super().__init__(num_numbers=num_numbers, max_value=max_value, ops=ops, expert=expert, **kwargs)

    @property
    def instructions(self) -> str:
        return ("Compute the value of the expression. You may use the calculator. "
                "Answer with the number only: <answer>number</answer>.")

    def generate_level(self, level_seed: int) -> ArithmeticLevel:
        rng = random.Random(level_seed)
        numbers = [rng.randint(2, self.max_value) for _ in range(self.num_numbers)]
        text = str(numbers[0])
        for n in numbers[1:]:
            text += rng.choice(self.ops) + str(n)
        return ArithmeticLevel(text, int(evaluate(text)[0]))

    def level_key(self, level: ArithmeticLevel) -> str:
        return level.expression

    def question(self, level: ArithmeticLevel) -> str:
        return f"Expression: {level.expression}"

    def score(self, level: ArithmeticLevel, answer: str) -> tuple[float, bool]:
        won = re.fullmatch(r"\s*-?\d+\s*", answer) is not None and int(answer) == level.value
        return (self.success_reward if won else 0.0), won

    def expert_action(self) -> str:
        level = self.state["level"]
        if self.expert == "oracle" and not self.state["calls"] and self.max_tool_calls > 0:
            return self.call_text("calculator", {"expression": level.expression})
        if self.expert == "oracle":
            return f"<answer>{level.value}</answer>"
        return f"<answer>{level.value + 1}</answer>"
