"""A namespace's usage snapshot as the ledger publishes it, pure: built from an accounting result
(:func:`usage_snapshot`, with the digest that tells whether its content changed since the last one published) and
fitted to what the bus takes (:func:`fit`). The ledger service only sends what these give."""

from __future__ import annotations

import hashlib
from typing import NamedTuple, cast

import msgspec

from shared import contract
from shared.accounting.wire import vms_json


def usage_digest(body: contract.UsageBody, vms: msgspec.Raw | None = None) -> str:
    """SHA-256 of the body's JSON, the first 32 hex digits; ``vms``: its VMs already encoded (the same bytes)."""
    wire = body if vms is None else msgspec.structs.replace(body, vms=vms)
    return hashlib.sha256(contract.encode(wire)).hexdigest()[:32]


def usage_snapshot(
    body: contract.UsageBody, *, cluster: str, namespace: str, seq: int, source: str, time: str
) -> tuple[contract.UsageSnapshot, str]:
    """The usage snapshot of ``body`` (the namespace accounted at stream sequence ``seq``) and its content digest.
    Its VM states are encoded once, for the digest and the message alike."""
    errors = contract.capped_errors(body.errors)
    if errors is not body.errors:
        body = msgspec.structs.replace(body, errors=errors)
    vms = vms_json(namespace, body.vms)
    digest = usage_digest(body, vms)
    msg = contract.UsageSnapshot(
        id=f"{cluster}/usage/{namespace}/{seq}/{digest[:12]}",
        source=source,
        subject=namespace,
        time=time,
        cluster=cluster,
        namespace=namespace,
        seq=seq,
        quotas=body.quotas,
        vms=cast(list[contract.VmState], vms),  # encoded as the list it stands for
        migrations=body.migrations,
        errors=body.errors,
    )
    return msg, digest


class Fitted(NamedTuple):
    data: bytes | None
    """What to publish; None when even the smallest form is larger than the bus takes."""
    size: int
    """Bytes of the whole snapshot (more than the limit: ``data`` is trimmed, or None)."""


def fit(msg: contract.UsageSnapshot, vms: list[contract.VmState], limit: int) -> Fitted:
    """``msg`` (with the states ``vms``) encoded; when that is larger than ``limit`` (a namespace of thousands of
    VMs: ~400 bytes each), encoded with only the states the enforcer acts on (admitted VMs: their reservations, the
    guard's holders, the nudges), which ``errors`` says (the quotas' terms and the migrations are kept), and if that
    is still too large, with those by name, uid and whether their pod was refused only."""
    data = contract.encode(msg)
    if len(data) <= limit:
        return Fitted(data, len(data))
    kept = [v for v in vms if v.state == "admitted"]
    note = (
        f"the states of {len(vms) - len(kept)} of the {len(vms)} VMs are left out (admitted ones kept): with "
        f"them this snapshot is {len(data):,} bytes, over the {limit:,} the bus takes"
    )
    bare = [
        contract.VmState(name=v.name, uid=v.uid, state=v.state, pod_refused=v.pod_refused, vmi_size=v.vmi_size)
        for v in kept
    ]
    for states, what in ((kept, note), (bare, f"{note}; the admitted ones without their counts and reasons")):
        trimmed = contract.encode(msgspec.structs.replace(msg, vms=states, errors=[*msg.errors, what]))
        if len(trimmed) <= limit:
            return Fitted(trimmed, len(data))
    return Fitted(None, len(data))
