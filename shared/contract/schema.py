"""JSON Schemas (draft 2020-12) of the messages on the bus, generated from the msgspec Structs that are the contract:
what a subscriber written in another language validates against (``vmquota schema``). Quantities are strings in
Kubernetes' form; a dead letter's payload is base64. The schemas admit unknown fields, as the decoders do, so a
newer producer's additional fields pass; the ``schema`` field says the version (docs/events.md)."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from shared.contract.messages import DeadLetter, Decision, ObjectEvent, RelistRequest, UsageSnapshot
from shared.quantity import Quantity

MESSAGES: Final[dict[str, Any]] = {
    "event": ObjectEvent,
    "usage": UsageSnapshot,
    "decision": Decision,
    "deadletter": DeadLetter,
    "relist": RelistRequest,
}
"""Each message's name → its type (``event``: upserted, deleted or sync, told apart by ``type``)."""

_QUANTITY: Final = {
    "type": "string",
    "description": "a Kubernetes quantity (`1Gi`, `500m`), printed in its canonical form",
    "pattern": r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$",
}


def _hook(tp: type) -> dict[str, Any]:
    if tp is Quantity:
        return dict(_QUANTITY)
    raise NotImplementedError(tp)


def json_schema(message: str) -> dict[str, Any]:
    """The JSON Schema of ``message`` (a key of :data:`MESSAGES`)."""
    out: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    out.update(msgspec.json.schema(MESSAGES[message], schema_hook=_hook))
    return out
