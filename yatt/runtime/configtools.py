"""Loading plain YAML/TOML data into frozen config dataclasses, loudly and once.

A config dataclass is frozen and keyword-only; each field has a one-line docstring comment.
``build(cls, data)`` checks every key and value against the field's type hint, rejects
unknown keys, and raises ``ConfigError`` naming the dotted field and the fix, e.g.
``buffer.max_staleness must be >= 0 (got -1)``. A dataclass may check relations between
its fields in ``__post_init__`` by calling ``require``; the loader adds the dotted prefix.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from yatt.errors import ConfigError

T = TypeVar("T")


class FieldError(ConfigError):
    """A bad value in one field; ``build`` prefixes ``path`` with the enclosing fields."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path} {message}")
        self.path = path
        self.detail = message


def require(condition: bool, field: str, message: str) -> None:
    """In ``__post_init__``: raise a ``FieldError`` on ``field`` unless ``condition``."""
    if not condition:
        raise FieldError(field, message)


def build(cls: type[T], data: Mapping[str, object] | None, path: str = "") -> T:
    """Make ``cls`` from ``data``, checking every field; ``path`` prefixes error names."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__} must be a mapping (got {type(data).__name__})")
    hints = get_type_hints(cls)
    fields = {config_key(f.name): f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {_join(path, close[0])}?" if close else ""
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key {_join(path, str(key))}{hint} (known: {known})")
    kwargs: dict[str, object] = {}
    for name, f in fields.items():
        dotted = _join(path, name)
        if name in data:
            kwargs[f.name] = _convert(hints[f.name], data[name], dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{dotted} is required (type {_type_name(hints[f.name])})")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError(f"{_join(path, e.path)} {e.detail}") from None


def config_key(name: str) -> str:
    """The config key of a field: its name, but a Python keyword's without the trailing
    underscore that lets a dataclass have it (``env.class`` is the field ``class_``)."""
    bare = name.removesuffix("_")
    return bare if keyword.iskeyword(bare) else name


def to_dict(obj: object) -> Any:
    """The plain-data form of a config (what ``build`` takes back)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {config_key(f.name): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML scalars) to ``data``."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ConfigError(
                f"override {key.strip()}: {raw!r} is not a YAML value{where}; quote it or close its brackets"
            ) from None
    return data


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(tp: object) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: object, path: str) -> object:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path} has a bad value {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path} must be one of {', '.join(map(repr, allowed))} (got {value!r})")
        return value
    if origin in (list, tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list (got {type(value).__name__})")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping (got {type(value).__name__})")
        _, val_tp = get_args(tp) or (str, Any)
        return {str(k): _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)  # type: ignore[arg-type]
    if tp is Any or tp is object:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false (got {value!r})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer (got {value!r})")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 3e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number (got {value!r})")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string (got {value!r})")
        return value
    raise ConfigError(f"{path}: unsupported config type {tp!r}")
