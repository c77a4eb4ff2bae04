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
import re
import threading
import types
import typing
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np
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


def build_section(cls: Any, data: object, prefix: str, root: Any = None) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``data``; ``prefix`` is its dotted key and
    ``root`` the whole config's dataclass (``cls`` itself when ``None``), where a key that is
    unknown here is looked up in the other sections."""
    root = cls if root is None else root
    where = prefix or "the config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys, got {_show(data)}; write "
                          f"'key: value' lines", key=prefix or None)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(_join(prefix, str(key)), str(key), list(fields), root)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, spec in fields.items():
        key = _join(prefix, name)
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], key, root)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: missing required key; add it "
                              f"({_describe(hints[name])})", key=key)
    return cls(**kwargs)


def check_types(section: Any, prefix: str) -> None:
    """Check every field of frozen dataclass ``section`` (made in Python: by hand, or with
    ``dataclasses.replace``, which the loader never saw) as the loader checks a file's value,
    and keep what that gives: a numpy number becomes a Python one, a choice given as text
    its enum (a field compared with
    ``is`` would misread the text silently: ``swa_history="all"`` built window-tail pools),
    an int where a float goes a float. ``ConfigError`` naming the dotted key otherwise.
    Sections inside ``section`` check themselves."""
    hints = typing.get_type_hints(type(section))
    for spec in dataclasses.fields(section):
        value = getattr(section, spec.name)
        if dataclasses.is_dataclass(hints[spec.name]):
            continue
        # a numpy number (pools sized with numpy arithmetic) is the Python number it holds
        plain = value.item() if isinstance(value, np.generic) else value
        converted = _convert(plain, hints[spec.name], _join(prefix, spec.name), type(section))
        if converted is not value:
            object.__setattr__(section, spec.name, converted)


def _convert(value: object, hint: Any, key: str, root: Any) -> Any:
    """Check ``value`` against type ``hint``: exact, except int -> float and null -> None."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return None if value is None else _convert(value, inner[0], key, root)
    if dataclasses.is_dataclass(hint):
        return build_section(hint, {} if value is None else value, key, root)
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, list | tuple):
            raise fail(key, value, f"expected {_describe(hint)}, got {_type_word(value)}",
                        f"write it as {_LIST_EXAMPLES[item]}")
        return tuple(_convert(v, item, f"{key}[{i}]", root) for i, v in enumerate(value))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _to_enum(value, hint, key)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 2**1000 else math.inf
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        fix = _number_text_fix(value, hint) or f"write {_TYPE_WORDS[hint]}"
        raise fail(key, value, f"expected {_TYPE_WORDS[hint]}, got {_type_word(value)}", fix)
    if isinstance(value, float) and not math.isfinite(value):
        raise fail(key, value, "not a finite number", "write a finite number")
    return value


def _to_enum(value: object, cls: type[enum.Enum], key: str) -> enum.Enum:
    if isinstance(value, cls):
        return value
    choices = [member.value for member in cls]
    if value not in choices:
        raise fail(key, value, "not a valid choice",
                   f"{case_hint(value, choices)}use one of: {', '.join(choices)}")
    return cls(value)


def case_hint(value: object, choices: list[str]) -> str:
    """``"did you mean 'x'? "`` when ``value`` is choice ``x`` in another case, else ``""``.
    A choice in the wrong case is refused, not taken: the file then says what is meant."""
    lowered = {choice.lower(): choice for choice in choices}
    meant = lowered.get(value.lower()) if isinstance(value, str) else None
    return f"did you mean '{meant}'? " if meant is not None else ""


_EXPONENT = re.compile(r"([+-]?)([0-9]+)(?:\.([0-9]*))?[eE]([+-]?)([0-9]+)")


def _number_text_fix(value: object, hint: Any) -> str | None:
    """The fix for a number written as text (quoted, or an exponent YAML 1.1 reads as a
    string: ``1e-2``; PyYAML's floats need a dot and a signed exponent, ``1.0e-2``)."""
    if not isinstance(value, str) or hint not in (int, float):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    if hint is int:
        return f"write {int(number)} (an integer, no quotes)" if number.is_integer() else None
    found = _EXPONENT.fullmatch(value.strip())
    if found is None:
        return f"write {number!r} (a number, no quotes)"
    sign, whole, fraction, exp_sign, exponent = found.groups()
    spelled = f"{sign}{whole}.{fraction or '0'}e{exp_sign or '+'}{exponent}"
    return (f"YAML reads {value} as text (its floats need a dot and a signed exponent); "
            f"write {spelled}")


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {_PLURALS[typing.get_args(hint)[0]]}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of: " + ", ".join(member.value for member in hint)
    if dataclasses.is_dataclass(hint):
        return "a section of keys"
    return _TYPE_WORDS.get(hint, str(hint))


def _unknown_key(key: str, name: str, valid: list[str], root: Any) -> ConfigError:
    homes = _key_homes(root).get(name)
    if homes:
        places = [home if "." in home else f"{home} (top level)" for home in homes]
        return ConfigError(f"{key}: unknown key in this section; it belongs in "
                           f"{' or '.join(places)}: move it there", key=key)
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"
    return ConfigError(f"{key}: unknown key; {hint}", key=key)


def _key_homes(cls: Any, prefix: str = "") -> dict[str, list[str]]:
    """Every key name of dataclass ``cls`` and its sections -> the dotted keys it is at."""
    homes: dict[str, list[str]] = {}
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        key = _join(prefix, spec.name)
        homes.setdefault(spec.name, []).append(key)
        if dataclasses.is_dataclass(hints[spec.name]):
            for name, keys in _key_homes(hints[spec.name], key).items():
                homes.setdefault(name, []).extend(keys)
    return homes


# ---- checks and messages ------------------------------------------------------------------

MAX_GIB = float(2**33)
"""The most GiB a size may be: 2**63 bytes, the most a byte count (an int64, a tensor's size)
holds. A larger size is a typo, and scaled to bytes it can overflow to infinity."""


def check_min(key: str, value: float, low: float) -> None:
    if value < low:
        raise fail(key, value, f"must be >= {low}", f"set it to {low} or more")


def check_max(key: str, value: float, high: float, why: str) -> None:
    if value > high:
        raise fail(key, value, f"must be <= {high:g} ({why})", f"set it to {high:g} or less")


def check_seconds(key: str, value: float) -> None:
    """A duration Python can wait for (``threading.TIMEOUT_MAX``, about 292 years): a longer
    one makes a lock's or a socket's wait raise ``OverflowError`` where it is used."""
    check_max(key, value, threading.TIMEOUT_MAX, "the longest wait Python can make")


def check_gib(key: str, value: float) -> None:
    """A size in GiB that scaled to bytes is a finite byte count (see :data:`MAX_GIB`)."""
    if value > MAX_GIB:
        raise fail(key, value, "more than 2**63 bytes, the most a byte count can hold",
                   f"give the size in GiB (at most {MAX_GIB:.0f}), e.g. 64")


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
