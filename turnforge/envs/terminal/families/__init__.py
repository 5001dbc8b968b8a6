"""The registry of generated shell-task families (``FAMILIES``), gathered from one module per
group: files and directories (``files``), text processing (``text``), finding files (``search``),
CSV and JSON (``data``), scripts (``scripts``) and the held-out recombinations (``heldout``).
``turnforge.envs.terminal.generated`` builds tasks from them."""

from __future__ import annotations

from turnforge.envs.terminal.families import data, files, heldout, scripts, search, text
from turnforge.envs.terminal.families.base import Check, Draft, Family


def _registry(*groups: tuple[Family, ...]) -> dict[str, Family]:
    out: dict[str, Family] = {}
    for family in (f for group in groups for f in group):
        if family.name in out:
            raise ValueError(f"two shell-task families are named {family.name!r}")
        out[family.name] = family
    return out


#: Every family by name; ``Family.heldout`` marks those made for the held-out split only.
FAMILIES: dict[str, Family] = _registry(files.FAMILIES, text.FAMILIES, search.FAMILIES, data.FAMILIES, scripts.FAMILIES,
                                        heldout.FAMILIES)

__all__ = ["FAMILIES", "Check", "Draft", "Family"]
