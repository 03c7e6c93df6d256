"""Readers of the fields of raw Kubernetes objects (JSON-like mappings): each returns the field as the expected type
(an absent or null field as the empty value) or raises :class:`~shared.errors.InvalidInput` naming the field's path
(``where`` is the path of ``obj``; empty for the object's top level). Used by the snapshot normalisers, the VMI
reader, the launcher-pod renderer and the KubeVirt CR reader, so a malformed field is reported the same way
wherever it is read."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from shared.errors import InvalidInput

_EMPTY: Final[Mapping[str, Any]] = MappingProxyType({})


def path(where: str, key: str) -> str:
    """The path of field ``key`` of the object at ``where``."""
    return f"{where}.{key}" if where else key


def mapping(obj: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """An object field (absent or null: an empty, read-only mapping)."""
    v = obj.get(key)
    if type(v) is dict:  # the common case first: an ABC check costs more than the rest of this
        return v
    if v is None:
        return _EMPTY
    if not isinstance(v, Mapping):
        raise InvalidInput(f"expected an object, got {type(v).__name__}", path(where, key))
    return v


def string(obj: Mapping[str, Any], key: str, where: str) -> str:
    """A string field (absent or null: empty)."""
    v = obj.get(key)
    if type(v) is str:
        return v
    if v is None:
        return ""
    if not isinstance(v, str):
        raise InvalidInput(f"expected a string, got {type(v).__name__}", path(where, key))
    return v


def boolean(obj: Mapping[str, Any], key: str, where: str) -> bool | None:
    """A boolean field (absent or null: None); anything but true/false is an error (``"false"`` is not false)."""
    v = obj.get(key)
    if v is None or isinstance(v, bool):
        return v
    raise InvalidInput(f"expected true or false, got {v!r}", path(where, key))


def sequence(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    """A list field (absent or null: empty)."""
    v = obj.get(key)
    if v is None:
        return []
    if type(v) is not list:
        raise InvalidInput(f"expected a list, got {type(v).__name__}", path(where, key))
    return v


def objects(obj: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    """A list of objects (``devices.interfaces``, ``volumes`` ...): each element must be an object."""
    out = sequence(obj, key, where)
    for i, item in enumerate(out):
        if type(item) is not dict and not isinstance(item, Mapping):
            raise InvalidInput(f"expected an object, got {type(item).__name__}", f"{path(where, key)}[{i}]")
    return out


def string_map(obj: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    """A map of strings to strings (labels, annotations), copied (absent or null: empty)."""
    m = mapping(obj, key, where)
    for k, v in m.items():
        if type(v) is not str or type(k) is not str:
            if not isinstance(k, str):
                raise InvalidInput(f"expected a string key, got {type(k).__name__} {k!r}", path(where, key))
            if not isinstance(v, str):
                raise InvalidInput(f"expected a string value, got {type(v).__name__}", f"{path(where, key)}.{k}")
    return dict(m)
