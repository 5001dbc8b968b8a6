"""Two policies in one run (``agent.policies=[proposer,solver]``): the proposer writes tasks of the
moves family (a board of six cells with one arrow), the solver answers them.

A self-play task (``{"selfplay": true}``) asks the proposer for a board; the solver then answers
it ``ATTEMPTS`` times, each a conversation of its own. The solver's reward is the share it got
right; the proposer's is 1 for a board the solver solved sometimes but not always (the frontier
of what it can do), 0 for one it always or never solved, and -0.5 for a reply that holds no
board (Absolute Zero's format penalty; then the solver is not asked, so its adapter does not
train on it). A reply's board is its first arrow and up to five of its other board characters
(``_ . #``, in order, those before the arrow first; later arrows dropped), padded with ``_`` to
six cells: lenient, so that a model that writes boards only now and then still gives the
proposer something to learn from.
A task with a ``board`` (the fixed tasks of ``moves.jsonl``) is answered by the solver alone,
``attempts`` times (1 when the task does not say), and the held-out evaluation's success is the
solver's. The request's ``model`` field picks the policy; ``rewards`` gives each its reward.

    turnforge train agent-selfplay-tiny                                 # self-play
    turnforge train agent-selfplay-tiny agent.tasks=examples/agents/selfplay_fixed.jsonl   # the solver on fixed tasks
"""

from __future__ import annotations

import httpx

MOVES = {"^": "Up", "v": "Down", "<": "Left", ">": "Right"}
CELLS = "_.#"
ATTEMPTS = 4
PROPOSE = ("Write a new board for the moves game: six cells, each one of _ . # except one arrow (^ v < >), "
           "for example _#^.._ or .>__#. Answer with the board only.")
ASK = "Board {board}. The arrow in it (^ up, v down, < left, > right) names the move. Which move? Answer Up, Down, Left or Right."


def ask(http: httpx.Client, model: str, text: str) -> str:
    reply = http.post("/chat/completions", json={"model": model, "messages": [{"role": "user", "content": text}]})
    return reply.raise_for_status().json()["choices"][0]["message"]["content"] or ""


def solve(http: httpx.Client, board: str) -> bool:
    """One attempt of the solver: does it name the board's move, and only that one?"""
    answer = ask(http, "solver", ASK.format(board=board)).lower()
    said = [m for m in MOVES.values() if m.lower() in answer]
    return said == [MOVES[next(c for c in board if c in MOVES)]]


def board_of(text: str) -> str | None:
    """The board a proposal writes (module docstring), or None without an arrow."""
    cells = [c for c in text if c in CELLS or c in MOVES]
    first = next((i for i, c in enumerate(cells) if c in MOVES), None)
    if first is None:
        return None
    before = [c for c in cells[:first] if c in CELLS][:5]
    after = [c for c in cells[first + 1:] if c in CELLS][:5 - len(before)]
    return "".join(before + [cells[first]] + after).ljust(6, "_")


def agent(task: dict, base_url: str) -> dict:
    with httpx.Client(base_url=base_url, timeout=600) as http:  # agent.timeout_s bounds the rollout
        if "board" in task:  # a fixed task: the solver alone
            solved = [solve(http, task["board"]) for _ in range(int(task.get("attempts", 1)))]
            share = sum(solved) / len(solved)
            return {"reward": share, "success": share == 1.0, "rewards": {"solver": share}}
        board = board_of(ask(http, "proposer", PROPOSE))
        if board is None:  # not a board: nothing for the solver to learn from
            return {"reward": 0.0, "success": False, "rewards": {"proposer": -0.5}, "metrics": {"valid_board": 0.0}}
        share = sum(solve(http, board) for _ in range(ATTEMPTS)) / ATTEMPTS
        frontier = 1.0 if 0.0 < share < 1.0 else 0.0
        return {"reward": share, "success": share == 1.0, "rewards": {"proposer": frontier, "solver": share},
                "metrics": {"valid_board": 1.0}}
