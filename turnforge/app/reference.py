"""The config reference: every key of the typed config (``turnforge.config.TrainConfig``) with its
type, default and description, as the markdown table that ``turnforge keys`` prints and
docs/guide.md holds (a test keeps the two equal)."""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from turnforge.app.config import VARIANT_KEYS
from turnforge.config import TrainConfig
from turnforge.errors import UserError, choices


@dataclass(frozen=True)
class Key:
    key: str  # dotted, as on the command line: rollout.max_new_tokens
    type: str
    default: str
    description: str


def config_keys(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[Key]:
    """The leaf keys of ``model`` in declaration order (a section's keys under its name); a key
    that names variants (``VARIANT_KEYS``) shows its registry's names and their words."""
    variants = {v.key: v.choices() for v in VARIANT_KEYS}
    keys: list[Key] = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys += config_keys(kind, f"{prefix}{name}.")
            continue
        default = field.default_factory() if field.default is PydanticUndefined else field.default
        key, type_name, description = prefix + name, _type_name(kind), field.description or ""
        if key in variants:
            names = " or ".join(repr(n) for n in variants[key])
            type_name = f"list of {names}" if get_origin(kind) is list else names
            if any(variants[key].values()):
                description += ": " + "; ".join(f"{n} ({h})" for n, h in variants[key].items())
        keys.append(Key(key, type_name, _value(default), description))
    return keys


def reference(section: str = "") -> str:
    """The markdown table of the keys under ``section`` (e.g. ``rollout``; "": all of them)."""
    keys = config_keys()
    if section:
        keys = [k for k in keys if k.key == section or k.key.startswith(section + ".")]
        if not keys:
            sections = {k.key.split(".")[0] for k in config_keys() if "." in k.key}
            raise UserError(f"no config key or section {section!r}; sections: {choices(sections)}")
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{k.key}` | {_cell(k.type)} | {_cell(k.default, code=True)} | {_cell(k.description)} |" for k in keys]
    return "\n".join(lines) + "\n"


def _type_name(kind: Any) -> str:
    origin, args = get_origin(kind), get_args(kind)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return "None" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _value(value: Any) -> str:
    """A default as it is written on the command line (YAML reads JSON)."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _cell(text: str, code: bool = False) -> str:
    """``text`` as one markdown table cell: ``|`` escaped, ``code`` in backticks."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if code else text
