"""Snapshots on the wire: :func:`encode` and :func:`decode` (JSON), :func:`to_builtins` and :func:`from_builtins`."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from shared.snapshot.fastpath import _WIRE_DECODER, from_wire
from shared.snapshot.hooks import dec_hook, enc_hook
from shared.snapshot.types import AnySnapshot, Snapshot

_ENCODER: Final = msgspec.json.Encoder(enc_hook=enc_hook)
_DECODER: Final = msgspec.json.Decoder(AnySnapshot, dec_hook=dec_hook)


def encode(snapshot: Snapshot) -> bytes:
    return _ENCODER.encode(snapshot)


def decode(data: bytes | str) -> AnySnapshot:
    """Decode any snapshot; msgspec.ValidationError (a ValueError) on a malformed one. (Read as
    :data:`WIRE_SNAPSHOT` first: :func:`from_wire`; anything that does not read so is decoded again as
    :data:`AnySnapshot`, which says what is wrong.)"""
    try:
        snap: AnySnapshot = from_wire(_WIRE_DECODER.decode(data))
    except Exception:
        return _DECODER.decode(data)
    return snap


def to_builtins(snapshot: Snapshot) -> Any:
    return msgspec.to_builtins(snapshot, enc_hook=enc_hook)


def from_builtins(obj: Any) -> AnySnapshot:
    snap: AnySnapshot = msgspec.convert(obj, AnySnapshot, dec_hook=dec_hook)
    return snap
