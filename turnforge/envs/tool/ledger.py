"""Ledger: facts gathered one tool call at a time and carried to the end, a tool task that
needs memory over many calls.

The question names ``num_accounts`` accounts (drawn from a pool of fruit names) and asks which
has the largest balance. The ``lookup`` tool returns one account's record: its balance among
other fields (owner, city, year opened, status) that do not matter, so each result is a few
dozen tokens and a whole episode's results overflow a small context. The agent looks the
accounts up, one call per turn, and answers ``<answer>name</answer>`` (reward
``success_reward`` for the right name, 0 otherwise). A ``window`` context forgets the early
balances, ``full_history`` overflows, and a ``summarize`` context keeps them only if its
summaries carry the best balance so far. Balances are distinct, so the answer is unique.

``expert_action`` looks the accounts up in the question's order, then answers;
``expert_summary`` is the running best and the accounts looked up ("Best: plum 42. Done:
kiwi, plum.").
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from turnforge.envs.tool.base import ToolEnv, ToolError
from turnforge.errors import UserError
from turnforge.seeding import stable_hash

ACCOUNTS = ("apple", "apricot", "banana", "cherry", "date", "fig", "grape", "guava", "kiwi", "lemon", "lime", "mango",
            "melon", "nectarine", "olive", "orange", "papaya", "peach", "pear", "plum", "quince", "raisin", "lychee",
            "tangerine")
OWNERS = ("Ada", "Ben", "Cleo", "Dana", "Eli", "Fay", "Gus", "Hana")
CITIES = ("Lyon", "Oslo", "Lima", "Pune", "Kobe", "Perth", "Quito", "Riga")


@dataclass(frozen=True)
class LedgerLevel:
    accounts: tuple[str, ...]  # in the question's order
    balances: tuple[int, ...]  # distinct, one per account
    records: tuple[str, ...]  # what lookup returns for each

    @property
    def answer(self) -> str:
        return self.accounts[self.balances.index(max(self.balances))]


class LedgerEnv(ToolEnv):
    """Which of ``num_accounts`` accounts has the largest balance (see the module docstring)."""

    def __init__(self, *, num_accounts: int = 12, max_balance: int = 99, success_reward: float = 1.0, **kwargs) -> None:
        if not 2 <= num_accounts <= len(ACCOUNTS):
            raise UserError(f"ledger: num_accounts must be in 2..{len(ACCOUNTS)}; got {num_accounts}")
        if max_balance < num_accounts:
            raise UserError(f"ledger: max_balance must be >= num_accounts (balances are distinct); got {max_balance}")
        kwargs.setdefault("max_tool_calls", num_accounts)
        kwargs.setdefault("max_steps", 2 * num_accounts + 4)
        super().__init__(**kwargs)
        self.num_accounts, self.max_balance, self.success_reward = int(num_accounts), int(max_balance), float(success_reward)

    @property
    def instructions(self) -> str:
        return ("Look up every account the question names with the lookup tool, one per turn, then answer with the "
                "name of the account with the largest balance: <answer>name</answer>.")

    def tool_functions(self):
        return [self.lookup]

    def lookup(self, account: str) -> str:
        """Look up one account's record.

        Args:
            account: The account's name, as the question gives it.
        """
        level: LedgerLevel = self.state["level"]
        name = account.strip().lower()
        if name not in level.accounts:
            return ToolError(f"no account {account!r} in this ledger; accounts: {', '.join(level.accounts)}")
        return level.records[level.accounts.index(name)]

    def generate_level(self, level_seed: int) -> LedgerLevel:
        rng = random.Random(stable_hash("ledger", level_seed))
        accounts = tuple(rng.sample(ACCOUNTS, self.num_accounts))
        balances = tuple(rng.sample(range(1, self.max_balance + 1), self.num_accounts))
        records = tuple(f"Account {a}: owner {rng.choice(OWNERS)}, city {rng.choice(CITIES)}, opened "
                        f"{rng.randint(1990, 2025)}, balance {b}, status {rng.choice(('active', 'frozen', 'closed'))}."
                        for a, b in zip(accounts, balances))
        return LedgerLevel(accounts, balances, records)

    def level_key(self, level: LedgerLevel) -> str:
        return "|".join(level.records)

    def question(self, level: LedgerLevel) -> str:
        return f"Which of these accounts has the largest balance? {', '.join(level.accounts)}."

    def score(self, level: LedgerLevel, answer: str) -> tuple[float, bool]:
        won = answer.strip().lower() == level.answer
        return (self.success_reward if won else 0.0), won

    def _looked_up(self) -> list[str]:
        level: LedgerLevel = self.state["level"]
        return [json.loads(args)["account"].strip().lower() for name, args, _ in self.state["calls"]
                if name == "lookup" and json.loads(args).get("account", "").strip().lower() in level.accounts]

    def expert_action(self) -> str:
        level: LedgerLevel = self.state["level"]
        done = set(self._looked_up())
        left = [a for a in level.accounts if a not in done]
        if left and len(self.state["calls"]) < self.max_tool_calls:
            return self.call_text("lookup", {"account": left[0]})
        return f"<answer>{level.answer}</answer>"

    def expert_summary(self) -> str:
        """The running best and the accounts looked up so far."""
        level: LedgerLevel = self.state["level"]
        done = list(dict.fromkeys(self._looked_up()))
        if not done:
            return "Best: none yet. Done: none."
        best = max(done, key=lambda a: level.balances[level.accounts.index(a)])
        return f"Best: {best} {level.balances[level.accounts.index(best)]}. Done: {', '.join(done)}."

__all__ = ["ACCOUNTS", "LedgerEnv", "LedgerLevel"]
