"""Generic machinery of strict config loading: YAML, typed conversion, checks and messages.

:class:`ConfigError` lives here so that both this module and the sections can raise it;
:mod:`hicache.config` re-exports it. ``StrictLoader`` reads YAML refusing duplicate keys;
``build_section`` turns a parsed mapping into a frozen dataclass, field by field, from its type
hints: exact types, except that an integer is a fine float and ``null`` is ``None``. The
``check_*``, ``require`` and ``forbid`` helpers raise a :class:`ConfigError` whose one-line
message names the dotted key, the value as the YAML file spells it, the problem and the fix.
Nothing here knows the config's sections; :mod:`hicache.config.sections` does.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Hashable, Mapping
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration mistake. ``key`` is the dotted key at fault (``None`` for file errors)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ---- YAML ---------------------------------------------------------------------------------


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base class reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{where}: {' '.join(str(problem).split())}"


# ---- typed conversion ---------------------------------------------------------------------

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {int: "integers", str: "strings"}
_LIST_EXAMPLES = {int: "[1, 3]", str: "[first, second]"}


def build_section(cls: Any, data: object, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``data``; ``prefix`` is its dotted key."""
    where = prefix or "the config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys, got {_show(data)}; write "
                          f"'key: value' lines", key=prefix or None)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(_join(prefix, str(key)), str(key), list(fields))
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, spec in fields.items():
        key = _join(prefix, name)
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], key)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: missing required key; add it "
                              f"({_describe(hints[name])})", key=key)
    return cls(**kwargs)


def _convert(value: object, hint: Any, key: str) -> Any:
    """Check ``value`` against type ``hint``: exact, except int -> float and null -> None."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return None if value is None else _convert(value, inner[0], key)
    if dataclasses.is_dataclass(hint):
        return build_section(hint, {} if value is None else value, key)
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, list | tuple):
            raise fail(key, value, f"expected {_describe(hint)}, got {_type_word(value)}",
                        f"write it as {_LIST_EXAMPLES[item]}")
        return tuple(_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _to_enum(value, hint, key)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 2**1000 else math.inf
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise fail(key, value, f"expected {_TYPE_WORDS[hint]}, got {_type_word(value)}",
                    f"write {_TYPE_WORDS[hint]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise fail(key, value, "not a finite number", "write a finite number")
    return value


def _to_enum(value: object, cls: type[enum.Enum], key: str) -> enum.Enum:
    if isinstance(value, cls):
        return value
    choices = [member.value for member in cls]
    if value not in choices:
        raise fail(key, value, "not a valid choice", f"use one of: {', '.join(choices)}")
    return cls(value)


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {_PLURALS[typing.get_args(hint)[0]]}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of: " + ", ".join(member.value for member in hint)
    if dataclasses.is_dataclass(hint):
        return "a section of keys"
    return _TYPE_WORDS.get(hint, str(hint))


def _unknown_key(key: str, name: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
    return ConfigError(f"{key}: unknown key; {hint}", key=key)


# ---- checks and messages ------------------------------------------------------------------


def check_min(key: str, value: float, low: float) -> None:
    if value < low:
        raise fail(key, value, f"must be >= {low}", f"set it to {low} or more")


def check_positive(key: str, value: float) -> None:
    if value <= 0:
        raise fail(key, value, "must be > 0", "set a positive number")


def require(key: str, value: int | None, low: int, when: str) -> None:
    if value is None:
        raise ConfigError(f"{key}: missing, required {when}; add it (an integer >= {low})",
                          key=key)
    check_min(key, value, low)


def forbid(key: str, value: object, why: str) -> None:
    if value is not None:
        raise fail(key, value, f"not used: {why}", "remove it")


def fail(key: str, value: object, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{key} = {_show(value)}: {problem}; {fix}", key=key)


def _show(value: object) -> str:
    """A value as the YAML file spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return repr(value)


def _type_word(value: object) -> str:
    words = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a mapping", type(None): "null"}
    return words.get(type(value), type(value).__name__)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
