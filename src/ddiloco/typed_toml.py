"""Typed dataclasses from TOML and ``key=value`` overrides, shared by every config in the
project (the run config, the cluster simulator's parameters).

Unknown keys and wrong types are refused with the dotted key named, so a typo never silently
runs defaults. No torch here: the cluster simulator imports it.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from ddiloco.errors import ConfigError

# Keys that were renamed: an old config gets the new name in its error, not a bare refusal.
RENAMED = {"sync.strategy": "sync.partition", "dp": "data_parallel"}


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict, or a ConfigError naming the file."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("config", str(path), "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", str(path), f"invalid TOML: {exc}") from None


def set_override(data: dict[str, Any], item: str, depth: int | None = None) -> None:
    """Apply one ``dotted.key=value`` (value parsed as TOML, a bare word as a string);
    ``depth`` requires exactly that many key parts."""
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts) or (depth is not None and len(parts) != depth):
        shape = "key=value" if depth is None else ".".join(["key"] * depth) + "=value"
        raise ConfigError("--set", item, f"expected {shape}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as exc:
        if raw.strip().startswith(("[", "{")):  # a list or table, not a bare word
            raise ConfigError("--set", item, _list_hint(key.strip(), raw, exc)) from None
        value = raw  # a bare word is a string
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError("--set", item, f"{part} is not a table")
    node[parts[-1]] = value


_BARE = re.compile(
    r'("(?:[^"\\]|\\.)*"|\'[^\']*\')'  # a quoted string
    r"|(?<![\w.+\-])([A-Za-z_][\w.\-]*)(?![\w.\-]|\s*=)"  # a bare word, not a key
)
_TOML_WORDS = ("true", "false", "inf", "nan")


def _list_hint(key: str, raw: str, exc: tomllib.TOMLDecodeError) -> str:
    """Why a ``[...]`` or ``{...}`` value is not TOML: strings in it need quotes, which a shell
    removes unless the whole item is in single quotes."""

    def quote(m: re.Match[str]) -> str:
        word = m.group(2)
        return m.group(0) if word is None or word in _TOML_WORDS else f'"{word}"'

    what = "list" if raw.strip().startswith("[") else "table"
    where = re.sub(r"at line 1, column (\d+)", lambda m: f"at column {int(m[1]) - 4}", str(exc))
    why = f"not a TOML {what} ({where})"
    quoted = _BARE.sub(quote, raw.strip())
    if quoted == raw.strip():
        return why
    why += f"; strings in a TOML {what} need double quotes"
    try:
        tomllib.loads(f"v = {quoted}")
    except tomllib.TOMLDecodeError:
        return why
    if "'" in quoted:
        return f"{why}: {key}={quoted}"
    return f"{why}, which a shell drops unless the item is in single quotes: --set '{key}={quoted}'"


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """``cls(**data)`` with nested dataclasses built and every value type-checked."""
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", data, "expected a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            renamed = RENAMED.get(f"{prefix}{key}")
            why = f"renamed to {renamed}" if renamed else f"unknown key; known: {sorted(names)}"
            raise ConfigError(f"{prefix}{key}", data[key], why)
    kwargs = {k: coerce(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def coerce(hint: Any, value: Any, key: str) -> Any:
    """``value`` checked against the type ``hint`` (ints widen to floats)."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return build(typing.cast(type, hint), value, key + ".")
    if origin is tuple:
        (item, *_rest) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            example = f'{key}=["{value}"]' if isinstance(value, str) and item is str else ""
            hint = f" (strings quoted), e.g. --set '{example}'" if example else ""
            raise ConfigError(key, value, f"expected a list{hint}")
        return tuple(coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (
        not isinstance(value, hint) or (hint is not bool and isinstance(value, bool))
    ):
        raise ConfigError(key, value, f"expected {hint.__name__}")
    return value
