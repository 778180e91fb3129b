"""Strict, typed access to one JSON object of the pool's: what events and results are parsed with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from .errors import PoolError
from .wire import json_type

__all__ = ["Fields", "broken", "short"]


class Fields:
    """Typed access to one JSON object of the pool's; a missing or mistyped field is a PoolError."""

    def __init__(self, obj: Any, what: str) -> None:
        if not isinstance(obj, Mapping):
            broken(f"{what} is not a JSON object: {short(obj)}")
        self._obj = obj
        self._what = what

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self._obj:
            broken(f"{self._what} lacks {key!r}: {short(self._obj)}")
        return self._check(key, self._obj[key], kind)

    def optional(self, key: str, kind: type) -> Any:
        value = self._obj.get(key)
        return None if value is None else self._check(key, value, kind)

    def strings(self, key: str) -> tuple[str, ...]:
        values = self.get(key, list)
        if not all(isinstance(item, str) for item in values):
            broken(f"{self._what}: {key} must be a list of strings, got {short(values)}")
        return tuple(values)

    def nested(self, key: str, build: Any) -> Any:
        value = self.get(key, (Mapping, type(None)))
        return None if value is None else build(Fields(value, f"{self._what}'s {key}"))

    def _check(self, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # JSON true is not the integer 1, and 1 is not true.
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds)
        if not ok:
            broken(f"{self._what}: {key} has the wrong type: {short(value)}")
        return value


def short(value: Any, limit: int = 200) -> str:
    """``value`` for an error message, cut to ``limit`` characters. A value nested past Python's
    depth (the strict parser takes any depth a line's bound allows) is named by its type: its
    repr would recurse out, and an error message must never be an error of its own."""
    try:
        text = repr(value)
    except RecursionError:
        return f"{json_type(value)} nested too deeply to show"
    return text if len(text) <= limit else text[:limit] + "..."


def broken(message: str) -> NoReturn:
    raise PoolError(f"readie pool broke the protocol: {message}")
