"""What the enforcer reports of a plan: the Kubernetes Events (on the quota; ``VMQuotaExceeded`` on a refused VM's or
hotplug's VMI, which a tenant reads) and the decision it publishes on the bus.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final

from shared.contract import (
    Decision,
    MigrationState,
    VmState,
    source,
)
from shared.errors import InvalidInput
from shared.kinds import EVENT_KIND, QUOTA_KIND, VMI_KIND
from shared.quantity import Quantity
from shared.quota.enforcement import VM_QUOTA_EXCEEDED, WARNING, Plan, patch_body
from shared.report import names_list
from shared.report import readable as human_quantity
from shared.resources import canonical_resource_list
from shared.times import rfc3339

# ---- reports -----------------------------------------------------------------------------------------------------

EVENT_COMPONENT: Final = "vmquota-enforcer"
EVENT_MESSAGE_MAX: Final = 1024


STATUS_ONLY_NOTE: Final = " (written to status.hard, which quota admission checks; spec.hard not changed)"
"""What the Event of a decision that wrote ``status.hard`` alone adds to its reason."""


def event_body(p: Plan, *, identity: str, now: datetime) -> dict[str, Any]:
    """The core/v1 Event recording a change on the quota (``kubectl get events`` lists it)."""
    involved = {"apiVersion": "v1", "kind": QUOTA_KIND, "namespace": p.namespace, "name": p.name, "uid": p.uid}
    message = f"{p.reason}{STATUS_ONLY_NOTE if p.status_only else ''}"
    return _event(involved, p.event_reason, p.event_type, message, action=p.action.value, identity=identity, now=now)


def size_change_refused_event(
    namespace: str, migration: MigrationState, *, identity: str, now: datetime
) -> dict[str, Any]:
    """The Warning Event that tells a tenant, on its VMI, why a size change (a hotplug) does not happen: its growth
    does not fit the budget, or the migration whose end would carry it out unadmitted was canceled (the
    migration's reason says which, and by how much); the VM keeps running at its current size."""
    involved = {"apiVersion": "kubevirt.io/v1", "kind": VMI_KIND, "namespace": namespace}
    involved["name"] = migration.vmi
    message = f"migration {migration.name}: {migration.reason}"
    return _event(involved, VM_QUOTA_EXCEEDED, WARNING, message, action="Refuse", identity=identity, now=now)


def vm_refused_event(
    namespace: str, vm: VmState, *, identity: str, now: datetime, others: Sequence[VmState] = ()
) -> dict[str, Any]:
    """The Warning Event that tells a tenant, on its VMI, why the VM does not start: it does not fit the budget
    (the ledger's reason names the quota, the resource, what it needs and what is left), and which of ``others``
    (the namespace's VMs) hold that resource of the budget, largest first."""
    involved = {"apiVersion": "kubevirt.io/v1", "kind": VMI_KIND, "namespace": namespace}
    involved["name"] = vm.name
    if vm.uid:
        involved["uid"] = vm.uid
    message = f"VM {vm.name} is not admitted: {vm.reason.removeprefix('pending, ')}" + _held_by(vm, others)
    return _event(involved, VM_QUOTA_EXCEEDED, WARNING, message, action="Refuse", identity=identity, now=now)


def _held_by(vm: VmState, others: Sequence[VmState]) -> str:
    """``; limits.memory of quota compute is held by vm1 16Gi, vm2 16Gi, vm3 8Gi``: the VMs counted in the first
    resource the VM does not fit (at most five named: the names are the tenant's)."""
    for quota, resources in sorted(vm.refused_by.items()):
        for r in resources:
            held: list[tuple[Quantity, str]] = []
            for o in others:
                amount = o.counts.get(quota, {}).get(r)
                if o.name == vm.name or o.state not in ("running", "admitted") or amount is None:
                    continue
                try:
                    q = Quantity.parse(amount)
                except InvalidInput:
                    continue
                if q.nanos > 0:
                    held.append((q, o.name))
            if held:
                held.sort(key=lambda h: (-h[0].nanos, h[1]))
                names = [f"{name} {human_quantity(q, r)}" for q, name in held]
                return f"; {r} of quota {quota} is held by {names_list(names)}"
    return ""


def _event(
    involved: dict[str, str], reason: str, type_: str, message: str, *, action: str, identity: str, now: datetime
) -> dict[str, Any]:
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > EVENT_MESSAGE_MAX:
        message = message[: EVENT_MESSAGE_MAX - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": EVENT_KIND,
        "metadata": {"name": f"{involved['name']}.{int(now.timestamp() * 1e9):x}", "namespace": involved["namespace"]},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": type_,
        "action": action,
        "source": {"component": EVENT_COMPONENT},
        "reportingComponent": EVENT_COMPONENT,
        "reportingInstance": identity,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def decision(p: Plan, *, cluster: str, dry_run: bool, resource_version: str = "", time: str | None = None) -> Decision:
    """The bus record of a change: written (``resource_version`` is the quota's version after the patch), or
    what a dry run would write. Its id is the message id: a write is recorded once per quota version."""
    if dry_run:
        digest = zlib.crc32(json.dumps(patch_body(p), sort_keys=True).encode())
        mid = f"{cluster}/decision/{p.uid or p.namespace + '/' + p.name}/{p.resource_version}/dry-run-{digest:08x}"
    else:
        mid = f"{cluster}/decision/{p.uid or p.namespace + '/' + p.name}/{resource_version}"
    return Decision(
        id=mid,
        source=source("enforcer", cluster),
        subject=f"{p.namespace}/{p.name}",
        time=time or rfc3339(),
        cluster=cluster,
        namespace=p.namespace,
        quota=p.name,
        mode=p.mode,
        budget=canonical_resource_list(p.budget),
        hard_before=canonical_resource_list(p.written_before),
        hard_after=canonical_resource_list(p.written_after),
        reason=p.reason,
        usage_seq=p.usage_seq,
        charged=canonical_resource_list(p.charged),
        dry_run=dry_run,
        status_only=p.status_only,
    )
