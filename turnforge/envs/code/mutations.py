"""Bug injection: one small, typical mistake put into a correct function by rewriting its AST.

Kinds (``KINDS``):

- ``off_by_one``: an integer literal moved by one (``range(1, n + 1)`` -> ``range(1, n + 2)``);
- ``wrong_operator``: an arithmetic, comparison or boolean operator swapped for a plausible
  neighbour (``<`` -> ``<=``, ``+`` -> ``-``, ``and`` -> ``or``, ``in`` -> ``not in``);
- ``inverted_condition``: the test of an ``if``/``while``/conditional expression negated;
- ``wrong_return``: a returned value replaced by another name of the function (an argument
  or a local), or a returned boolean flipped.

``mutate(source, kind, site)`` rewrites the ``site``-th candidate place (in AST walk order) of
that kind; both the original and the mutant are ``ast.unparse``-d, so they differ only on the
mutated line(s). Whether a mutant is a bug the tests catch is decided by running the tests
(``CodeRepairEnv`` keeps only mutants that fail some test and do not time out).
"""

from __future__ import annotations

import ast
import copy

KINDS = ("inverted_condition", "off_by_one", "wrong_operator", "wrong_return")

_SWAP = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv,
    ast.Div: ast.Mult, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.And: ast.Or, ast.Or: ast.And,
}


def normalize(source: str) -> str:
    """The source as ``ast.unparse`` writes it (the form both original and mutant take)."""
    return ast.unparse(ast.parse(source)) + "\n"


def _names(fn: ast.FunctionDef) -> list[str]:
    args = [a.arg for a in fn.args.args]
    stores = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return list(dict.fromkeys(args + stores))


def _sites(tree: ast.Module, kind: str) -> list[tuple[ast.AST, object]]:
    """(node, how) pairs of the candidate places of ``kind``, in walk order."""
    out: list[tuple[ast.AST, object]] = []
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    for node in ast.walk(fn):
        if kind == "off_by_one" and isinstance(node, ast.Constant) and type(node.value) is int:
            out += [(node, +1), (node, -1)]
        elif kind == "wrong_operator":
            if isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in _SWAP:
                out.append((node, None))
            elif isinstance(node, ast.Compare):
                out += [(node, i) for i, op in enumerate(node.ops) if type(op) in _SWAP]
        elif kind == "inverted_condition" and isinstance(node, (ast.If, ast.While, ast.IfExp)):
            out.append((node, None))
        elif kind == "wrong_return" and isinstance(node, ast.Return) and node.value is not None:
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                out.append((node, not value.value))
            else:
                current = ast.unparse(value)
                out += [(node, name) for name in _names(fn) if name != current]
    return out


def count_sites(source: str, kind: str) -> int:
    return len(_sites(ast.parse(source), kind))


def mutate(source: str, kind: str, site: int) -> str:
    """``source`` with the bug ``kind`` at candidate place ``site`` (0-based), unparsed."""
    if kind not in KINDS:
        raise ValueError(f"unknown bug kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    tree = copy.deepcopy(ast.parse(source))
    sites = _sites(tree, kind)
    if not 0 <= site < len(sites):
        raise ValueError(f"{kind}: site {site} of {len(sites)}")
    node, how = sites[site]
    if kind == "off_by_one":
        node.value += how
    elif kind == "wrong_operator":
        if isinstance(node, ast.Compare):
            node.ops[how] = _SWAP[type(node.ops[how])]()
        else:
            node.op = _SWAP[type(node.op)]()
    elif kind == "inverted_condition":
        test = node.test
        node.test = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else ast.UnaryOp(ast.Not(), test)
    else:
        node.value = ast.Constant(how) if isinstance(how, bool) else ast.Name(how, ast.Load())
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"
