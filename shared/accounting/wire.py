"""The accounting of a namespace view as a bus ``UsageBody`` (what the ledger publishes and ``vmquota replay``
prints): :func:`~shared.accounting.namespace.account_namespace` fed with the view's latest snapshots (and the
cluster's KubeVirt CR), its result rendered in the wire form (canonical quantity strings).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

import msgspec

from shared import contract
from shared.accounting.namespace import account_view
from shared.accounting.results import QuotaUsage, VmEntry
from shared.ledger.fold import NamespaceView
from shared.quantity import Quantity
from shared.quota.modes import ratio_text
from shared.resources import canonical_resource_list, saturated

_VM_STATES: dict[tuple[str, str, str], tuple[VmEntry, contract.VmState, bytes]] = {}
"""Wire form of the latest entry of each VM (namespace, uid, name), and its JSON: accounting hands out the same
entry for a running VM that did not change, so most of a namespace's VMs are neither formatted nor encoded again.
One per VM: the cache is as large as the fleet."""
_VM_STATES_MAX = 65536


def _vm_state(namespace: str, v: VmEntry) -> contract.VmState:
    key = (namespace, v.uid, v.name)
    hit = _VM_STATES.get(key)
    if hit is not None and hit[0] is v:
        return hit[1]
    state = contract.VmState(
        name=v.name,
        uid=v.uid,
        phase=v.phase,
        state=v.state,
        reason=v.reason,
        counts={k: canonical_resource_list(c) for k, c in sorted(v.counts.items())},
        reserved=canonical_resource_list(v.reserved),
        refused_by={k: list(r) for k, r in sorted(v.refused_by.items())},
        pod_refused=v.pod_refused,
        vmi_size=v.vmi_size,
    )
    _VM_STATES.pop(key, None)  # the newest last: the oldest (of a deleted VM) go first when full
    _VM_STATES[key] = (v, state, contract.encode(state))
    if len(_VM_STATES) > _VM_STATES_MAX:
        del _VM_STATES[next(iter(_VM_STATES))]
    return state


def vms_json(namespace: str, vms: list[contract.VmState]) -> msgspec.Raw:
    """The JSON array of ``vms`` (of ``namespace``), each VM's state encoded once: a usage snapshot is mostly
    running VMs whose state did not change since the last one (the same objects, from :func:`_vm_state`). Encoding
    a message with this in place of its ``vms`` gives the same bytes as encoding the list."""
    parts: list[bytes] = []
    for state in vms:
        hit = _VM_STATES.get((namespace, state.uid, state.name))
        # (not one of ours, e.g. another accountant's: encoded each time)
        parts.append(hit[2] if hit is not None and hit[1] is state else contract.encode(state))
    return msgspec.Raw(b"[" + b",".join(parts) + b"]")


def quota_terms(name: str, q: QuotaUsage, errors: list[str]) -> contract.QuotaTerms:
    """A managed quota's terms in the wire form (canonical quantity strings); a term beyond what Kubernetes can
    represent is published as the largest value it can, with a line in ``errors``."""

    def wire(field: str, rl: Mapping[str, Quantity]) -> dict[str, str]:
        out, cut = saturated(rl)
        if cut:
            errors.append(
                f"quota {name}: {field} of {', '.join(cut)} exceeds what Kubernetes can represent; published as "
                "the largest value it can"
            )
        return canonical_resource_list(out)

    return contract.QuotaTerms(
        mode=q.policy.mode.value,
        budget=canonical_resource_list(q.policy.budget),
        cpu_allocation_ratio=ratio_text(q.policy.cpu_allocation_ratio),
        used=wire("used", q.used),
        pods=wire("pods", q.pods),
        reserved=wire("reserved", q.reserved),
        overlap=wire("overlap", q.overlap),
        unvouched=wire("unvouched", q.unvouched),
        taken=wire("taken", q.taken),
        hard=canonical_resource_list(q.hard),
        over_budget=list(q.over_budget),
        vmi_minimums=dict(q.vmi_minimums),
    )


def account(view: NamespaceView, now: datetime | None = None) -> contract.UsageBody:
    """Usage of one namespace. ``now`` (default: the current time) decides which terminating pods are past
    their grace period, as the Kubernetes quota evaluator does."""
    usage = account_view(
        {**view.cluster_objects, **view.objects},  # (no kind is in both)
        view.namespace,
        now=now or datetime.now(UTC),
        late=view.late,
        settled=view.settled,
        departed=view.departed,
        made_for=view.made_for,
        refused=view.refused,
    )
    errors = list(usage.errors)
    quotas = {name: quota_terms(name, q, errors) for name, q in sorted(usage.quotas.items())}
    vms = [_vm_state(view.namespace, v) for v in usage.vms]
    migrations = [
        contract.MigrationState(
            name=m.name,
            uid=m.uid,
            vmi=m.vmi,
            phase=m.phase,
            state=m.state,
            reason=m.reason,
            reserved=canonical_resource_list(m.reserved),
            growth=canonical_resource_list(m.growth),
            rejected_by_quota=m.rejected_by_quota,
            vmi_size=m.vmi_size,
            vmi_uid=m.vmi_uid,
            target_pod_uid=m.target_pod_uid,
        )
        for m in usage.migrations
    ]
    return contract.UsageBody(quotas=quotas, vms=vms, migrations=migrations, errors=errors)
