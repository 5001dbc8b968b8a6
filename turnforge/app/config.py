"""A config from a recipe and ``key=value`` overrides, checked before any work.

The schema (``turnforge.config``) types every key; here, where the registries are visible, the
variant names that the schema holds as plain strings (``VARIANT_KEYS``) are checked against their
registries, and every cross-key rule runs (``turnforge.app.rules``). A typo in a key or a name, a
wrong type, malformed YAML or two keys that do not work together raise ``UserError`` with one
line (the CLI prints it and exits with code 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ValidationError

from turnforge.algos.corrections import CORRECTIONS
from turnforge.algos.estimators import ESTIMATORS
from turnforge.app.rules import config_conflict
from turnforge.config import TrainConfig
from turnforge.data.filters import FILTERS
from turnforge.envs.tool.formats import AUTO, TOOL_FORMATS
from turnforge.errors import UserError, choices
from turnforge.rollout.context import CONTEXTS
from turnforge.rollout.history import HISTORIES
from turnforge.train.mechanisms import MECHANISMS, MEMORY_SOURCES

@dataclass(frozen=True)
class VariantKey:
    """A key whose value names variants (one, or a list): the schema holds it as a plain string,
    checked here against its registry and listed by ``turnforge keys`` with each variant's words."""

    key: str  # dotted: rollout.context
    home: str  # the module of the registry
    choices: Callable[[], dict[str, str]]  # name -> a few words ("" when the registry has none)


VARIANT_KEYS: tuple[VariantKey, ...] = (
    VariantKey("rl.advantage", "turnforge.algos.estimators", lambda: {n: e.help for n, e in ESTIMATORS.items()}),
    VariantKey("engine.correction", "turnforge.algos.corrections", lambda: {n: c.help for n, c in CORRECTIONS.items()}),
    VariantKey("rollout.context", "turnforge.rollout.context", lambda: {n: c.help for n, c in CONTEXTS.items()}),
    VariantKey("rollout.history", "turnforge.rollout.history", lambda: {n: h.help for n, h in HISTORIES.items()}),
    VariantKey("flywheel.mechanisms", "turnforge.train.mechanisms", lambda: {n: m.help for n, m in MECHANISMS.items()}),
    VariantKey("flywheel.filters", "turnforge.data.filters", lambda: dict.fromkeys(FILTERS, "")),
    VariantKey("memory.sources", "turnforge.train.mechanisms", lambda: dict.fromkeys(MEMORY_SOURCES, "")),
    VariantKey("model.tool_format", "turnforge.envs.tool.formats",
               lambda: {AUTO: "the format the chat template shows, else hermes", **{n: f.help for n, f in TOOL_FORMATS.items()}}),
)


def recipe_dir() -> Path:
    return Path(str(resources.files("turnforge") / "recipes"))


def list_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(recipe_dir().glob("*.yaml"))}


def _format_error(err: ValidationError, model: type[BaseModel]) -> str:
    e = err.errors()[0]
    loc = [str(x) for x in e["loc"]]
    key = ".".join(loc)
    if e["type"] == "extra_forbidden":
        section: Any = model
        for part in loc[:-1]:
            field = section.model_fields.get(part)
            section = field.annotation if field is not None else None
            if not (isinstance(section, type) and issubclass(section, BaseModel)):
                break
        valid = section.model_fields if isinstance(section, type) and issubclass(section, BaseModel) else {}
        return f"unknown config key {key!r}; valid keys here: {choices(valid)}"
    if e["type"] == "literal_error":
        return f"bad value for {key!r}: {e['msg']}"
    if not loc:
        return f"invalid config: {e['msg'].removeprefix('Value error, ')}"
    return f"bad value for {key!r} ({e.get('input')!r}): {e['msg']}"


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"cannot set {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["rl.iterations=3", "env.kwargs.num_boxes=2"]`` -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"override {item!r} is not key=value (e.g. rl.iterations=10)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(out, key.strip(), value)
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_recipe_data(recipe: str) -> tuple[str, dict]:
    """Read a shipped recipe by name or a YAML file by path -> (name, data). A relative
    ``env.tasks`` path in a recipe file given by path is relative to the file; in a shipped
    recipe, as on the command line, relative to the current directory (the repository root
    for the recipes that use the examples/ folder)."""
    shipped = list_recipes()
    if recipe in shipped:
        path, name = shipped[recipe], recipe
    elif recipe.endswith((".yaml", ".yml")) or "/" in recipe:
        path, name = Path(recipe), Path(recipe).stem
        if not path.exists():
            raise UserError(f"recipe file {recipe!r} does not exist")
    else:
        raise UserError(f"unknown recipe {recipe!r}; valid recipes: {choices(shipped)} (or a path to a .yaml file)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"malformed YAML in {str(path)!r}{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {str(path)!r} must be a YAML mapping of config keys, got {type(data).__name__}")
    tasks = data.get("env", {}).get("tasks") if isinstance(data.get("env"), dict) else None
    if recipe not in shipped and isinstance(tasks, str) and not Path(tasks).expanduser().is_absolute():
        data = {**data, "env": {**data["env"], "tasks": str(path.parent / tasks)}}
    return name, data


def load_config(recipe: str = "sokoban-tiny", overrides: list[str] | None = None) -> TrainConfig:
    """Recipe (name or path) + ``key=value`` overrides -> validated ``TrainConfig``."""
    name, data = load_recipe_data(recipe)
    extra = parse_overrides(overrides or [])
    new_env = extra.get("env", {}).get("id") if isinstance(extra.get("env"), dict) else None
    if new_env is not None and new_env != data.get("env", {}).get("id"):
        # Another env: the recipe's env kwargs belonged to the old one.
        data = {**data, "env": {"id": new_env, "kwargs": {}}}
    data = _merge({"recipe": name, **data}, extra)
    return config_from_dict(data)


def config_from_dict(data: dict) -> TrainConfig:
    """A nested dict -> a ``TrainConfig`` that passed the schema, the variant names and every rule
    (``check_config``); the first problem is one ``UserError`` line."""
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_error(err, TrainConfig)) from None
    check_config(cfg)
    return cfg


def unknown_variant(cfg: TrainConfig) -> str | None:
    """One line naming a variant name that no registry knows (``VARIANT_KEYS``), or None."""
    for variant in VARIANT_KEYS:
        section, field = variant.key.rsplit(".", 1)
        value = getattr(getattr(cfg, section), field)
        valid = variant.choices()
        for name in [value] if isinstance(value, str) else value:
            if name not in valid:
                return f"bad value for {variant.key!r} ({value!r}): unknown name {name!r}; valid: {', '.join(valid)}"
    return None


def check_config(cfg: TrainConfig) -> None:
    """The checks a config passes before any work, after the schema's: every variant name is one
    its registry knows, and no cross-key rule is broken (``turnforge.app.rules``); else one
    ``UserError`` line naming the keys and the fix."""
    unknown = unknown_variant(cfg)
    if unknown:
        raise UserError(unknown)
    conflict = config_conflict(cfg)
    if conflict:
        raise UserError(f"invalid config: {conflict}")
