"""The package's layers (``turnforge/__init__.py``'s docstring) hold in the code's own imports.

Every ``import`` and ``from ... import`` of every module is read with ``ast``: at module level,
inside functions and under ``if TYPE_CHECKING:`` alike (a function-level import that reaches up
only hides a circle). A module may import its own layer or a lower one; the top-level units
(packages and single modules under ``turnforge/``) import each other without a circle; and the
layer list names every unit exactly once, so a new package must be placed before it is used.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import turnforge

PACKAGE = Path(turnforge.__file__).parent


def layers() -> dict[str, int]:
    """``unit -> layer`` from the docstring's numbered list (``1. core: types, errors, ...``)."""
    out: dict[str, int] = {}
    for line in (turnforge.__doc__ or "").splitlines():
        m = re.match(r"\s*(\d)\. (?:[a-z ]+: )?(.+)$", line)
        if not m:
            continue
        for name in re.findall(r"``?([a-z_]+)``?", m.group(2)) or [x.strip() for x in m.group(2).split(",")]:
            assert name not in out, f"{name} is listed twice in turnforge's layer list"
            out[name] = int(m.group(1))
    return out


def units() -> set[str]:
    """The top-level units: every package and module directly under ``turnforge/`` (the face
    ``__init__.py`` and ``__main__.py`` aside)."""
    found = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if any(p.glob("*.py"))}
    return found - {"__init__", "__main__"}


def imports() -> list[tuple[str, str, str, int]]:
    """``(importing unit, imported unit, file, line)`` for every import of one turnforge unit by another."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",):  # the face re-exports the env contract
            continue
        unit = rel.parts[0].removesuffix(".py")
        package = ["turnforge", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                targets = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[0] == "turnforge" and len(parts) > 1 and parts[1] != unit:
                    out.append((unit, parts[1], str(rel), node.lineno))
    return out


def test_every_unit_has_a_layer():
    listed, present = set(layers()), units()
    assert not present - listed, f"not in turnforge's layer list (turnforge/__init__.py): {sorted(present - listed)}"
    assert not listed - present, f"in the layer list but not in the package: {sorted(listed - present)}"


def test_no_import_climbs():
    layer = layers()
    climbs = [f"{file}:{line}: {a} (layer {layer[a]}) imports {b} (layer {layer[b]})"
              for a, b, file, line in imports() if b in layer and a in layer and layer[b] > layer[a]]
    assert not climbs, "imports that climb:\n" + "\n".join(climbs)


def test_no_circle_between_units():
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for a, b, file, line in imports():
        graph[a].add(b)
        where.setdefault((a, b), f"{file}:{line}")
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            circle = visit(start, [start])
            assert circle is None, "import circle: " + " -> ".join(circle) + "\n" + "\n".join(
                f"  {a} -> {b} at {where[(a, b)]}" for a, b in zip(circle, circle[1:]))


def test_the_checker_sees_a_climb(tmp_path, monkeypatch):
    """The checks above can fail: a function-level import from core to train is seen."""
    pkg = tmp_path / "turnforge"
    (pkg / "train").mkdir(parents=True)
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "types.py").write_text("def f():\n    from turnforge.train import x\n")
    (pkg / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    found = imports()
    assert ("types", "train", "types.py", 2) in found
    assert layers()["types"] < layers()["train"]
