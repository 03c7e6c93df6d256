"""Quantities on the wire: :func:`enc_hook` prints them as canonical strings, :func:`dec_hook` reads them (msgspec
hooks for any Struct that embeds a snapshot or a resource list)."""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Final

from shared.bounded import Bounded
from shared.quantity import Quantity


def enc_hook(obj: Any) -> Any:
    """msgspec ``enc_hook``: quantities as canonical strings, fractions as decimal strings."""
    if type(obj) is Quantity:  # every quantity of every event (the printed form is cached on the object)
        return obj.canonical()
    if isinstance(obj, Fraction):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_WIRE_QUANTITIES: Final[Bounded[str, Quantity]] = Bounded(8192)
"""Quantities decoded, by printed form: quantities on the bus are canonical strings from a small set, so one
(immutable) object serves them all; a plain dict lookup is the cheapest call per quantity decoded, and sharing
the object lets snapshots share their resource lists (:func:`shared_resources`)."""


def dec_hook(tp: type, obj: Any) -> Any:
    """msgspec ``dec_hook``: quantities from strings (or JSON numbers)."""
    if tp is Quantity:
        if type(obj) is str:
            q = _WIRE_QUANTITIES.get(obj)
            if q is None:
                q = _WIRE_QUANTITIES.keep(obj, Quantity.parse(obj))
            return q
        return Quantity.parse(obj)
    raise NotImplementedError(f"cannot decode {tp}")
