"""Checks the agent's counts against the log (the tests recount it: they hold no answer key)."""
from pathlib import Path

LOG = Path("/app/app.log").read_text().splitlines()


def _number(path):
    return int(Path(path).read_text().strip())


def test_errors():
    assert _number("/app/errors.txt") == sum(1 for line in LOG if line.split()[1] == "ERROR")


def test_db_errors():
    assert _number("/app/db_errors.txt") == sum(1 for line in LOG if line.split()[1:3] == ["ERROR", "service=db"])
