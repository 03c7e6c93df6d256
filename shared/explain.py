"""``vmquota explain``: the timeline of one migration or one VM, from the bus alone (pure: the messages in, the
steps out).

What each step rests on:

* ``created``: the object's ``creationTimestamp``; ``seen``: when the watcher first published it.
* ``reserved`` / ``admitted`` / ``refused`` (a VM): the ledger's usage snapshots (``VMQUOTA_USAGE_HISTORY``), at
  the first snapshot that says so and at each change.
* ``raised`` / ``lowered``: the enforcer's decisions that name the migration's VMI (``for the migration of vm1``,
  ``the migration of vm1 ended``), with what changed.
* ``target-refused``: KubeVirt's ``FailedCreate`` Events on the VMI that quota refused while the migration ran,
  with how often; ``target-admitted``: the target pod KubeVirt's VMI status names (``migrationState.targetPod``)
  first published.
* ``succeeded`` / ``failed`` (a migration), ``running`` / ``stopped`` (a VM): the phases the watcher published.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from shared.contract import Decision, Deleted, Sync, Upserted, UsageSnapshot
from shared.kinds import EVENT_KIND, POD_KIND, VMI_KIND, VMIM_KIND
from shared.quota.enforcement import migrations_named
from shared.report import readable_list, refusal_amounts
from shared.snapshot import EventSnapshot, PodSnapshot, VmimSnapshot, VmiSnapshot
from shared.times import parse_rfc3339, rfc3339

ObjectEvent = Upserted | Deleted | Sync

MIGRATION_STEPS = (
    "created",
    "seen",
    "reserved",
    "raised",
    "target-refused",
    "target-admitted",
    "succeeded",
    "failed",
    "lowered",
)
VM_STEPS = ("created", "seen", "admitted", "refused", "running", "stopped")


@dataclass(frozen=True, slots=True)
class Step:
    time: str
    """RFC 3339 UTC."""
    step: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"time": self.time, "step": self.step, "detail": self.detail}


def _items(rl: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in readable_list(rl).items()) or "nothing"


def _of(events: Sequence[ObjectEvent], kind: str, namespace: str, name: str) -> list[Upserted | Deleted]:
    return [
        e for e in events if not isinstance(e, Sync) and e.kind == kind and e.namespace == namespace and e.name == name
    ]


_FAR = datetime(9999, 1, 1, tzinfo=UTC)


def _ordered(steps: list[Step]) -> list[Step]:
    """In time order (a stable sort: steps at the same instant keep the order they were found in), each detail
    with how long after the first step it came."""
    steps.sort(key=lambda s: parse_rfc3339(s.time) or _FAR)
    if not steps:
        return steps
    start = parse_rfc3339(steps[0].time)
    out: list[Step] = []
    for s in steps:
        at = parse_rfc3339(s.time)
        delta = ""
        if start is not None and at is not None and at > start:
            delta = f" (+{(at - start).total_seconds():.3f}s)"
        out.append(Step(rfc3339(at) if at is not None else s.time, s.step, s.detail + delta))
    return out


def migration_timeline(
    namespace: str,
    name: str,
    events: Sequence[ObjectEvent],
    decisions: Sequence[Decision],
    usages: Sequence[UsageSnapshot] = (),
) -> list[Step] | None:
    """The steps of the migration ``namespace/name``; None when no event of it is in ``events``. ``usages``: the
    namespace's usage snapshots, oldest first."""
    mine = _of(events, VMIM_KIND, namespace, name)
    snaps = [e.snapshot for e in mine if isinstance(e.snapshot, VmimSnapshot)]
    if not mine or not snaps:
        return None
    uid, vmi = mine[0].uid, snaps[0].vmi_name
    steps: list[Step] = []
    created = snaps[0].creation_timestamp
    if created is not None:
        steps.append(Step(rfc3339(created), "created", f"migration of VMI {vmi}"))
    steps.append(Step(mine[0].time, "seen", "published by the watcher"))
    end: str | None = None
    phase = ""
    for e, s in ((e, e.snapshot) for e in mine):
        if isinstance(s, VmimSnapshot) and s.phase != phase:
            phase = s.phase
            if phase in ("Succeeded", "Failed"):
                steps.append(Step(e.time, phase.lower(), f"phase {phase}"))
                end = end or e.time
    said = ""
    for usage in usages:
        for m in usage.migrations:
            if m.uid == uid or (not m.uid and m.name == name):
                what = _items(m.reserved) if m.reserved else "nothing"
                detail = f"the ledger holds {what} for its target ({m.state}): {m.reason}"
                if detail != said:
                    steps.append(Step(usage.time, "reserved", detail))
                    said = detail
    lo = created or parse_rfc3339(mine[0].time)  # (creationTimestamp has whole seconds: a lower bound)
    hi = parse_rfc3339(end) if end is not None else None
    raised: set[str] = set()  # quotas raised for it: their next lowering ends its room, whatever it says
    for d in decisions:
        at = parse_rfc3339(d.time)
        if d.namespace != namespace or at is None or (lo is not None and at < lo):
            continue
        lowering = d.reason.startswith("lowered")
        if hi is not None and at > hi and not (lowering and d.quota in raised):
            continue  # (after its end only the lowering of its room: a later migration of the VM is another's)
        if vmi in migrations_named(d.reason):
            steps.append(Step(d.time, "lowered" if lowering else "raised", f"quota {d.quota}: {d.reason}"))
            if lowering:
                raised.discard(d.quota)
            else:
                raised.add(d.quota)
        elif lowering and d.quota in raised:
            steps.append(Step(d.time, "lowered", f"quota {d.quota}: {d.reason}"))
            raised.discard(d.quota)
    refusals: dict[str, tuple[str, EventSnapshot]] = {}
    # (an Event is anyone's in the namespace to write: one KubeVirt's status does not confirm is said to be an
    # Event's word, and one about another incarnation of the VMI, by its uid, is not this migration's)
    confirmed = any(s.rejected_by_quota for s in snaps)
    word = "" if confirmed else " (an Event's word: KubeVirt's status never marked the migration refused by quota)"
    incarnations = {v.uid for v in _of(events, VMI_KIND, namespace, vmi) if v.uid}
    for e in _vmi_events(events, namespace, vmi):
        at, s = parse_rfc3339(e.time), e.snapshot
        if at is None or (lo is not None and at < lo) or (hi is not None and at > hi):
            continue  # (outside the migration: the VM's own start, or later)
        if isinstance(s, EventSnapshot) and s.quota_refusal:
            if s.involved_uid and incarnations and s.involved_uid not in incarnations:
                continue
            if s.uid not in refusals:
                said = f"quota {s.quota_name} refused a pod: {refusal_amounts(s.message)}{word}"
                steps.append(Step(e.time, "target-refused", said))
            refusals[s.uid] = (e.time, s)
    steps += _retries(refusals, "target-refused")
    target = _target_pod(events, namespace, vmi, uid)
    if target is not None:
        steps.append(Step(target[0], "target-admitted", f"target pod {target[1]} created"))
    return _ordered(steps)


def _retries(refusals: Mapping[str, tuple[str, EventSnapshot]], kind: str) -> list[Step]:
    """One step summing the refusal Events (uid → (time, Event)) when there are more than one: KubeVirt's retries,
    each Event's ``count`` up to :data:`_COUNT_SHOWN`."""
    total = sum(min(s.count, _COUNT_SHOWN) for _, s in refusals.values())
    if total <= 1:
        return []
    return [Step(max(t for t, _ in refusals.values()), kind, f"refused {total} times in all (KubeVirt retries)")]


_COUNT_SHOWN: Final = 1_000_000
"""The most an Event's ``count`` adds to the refusals a timeline sums (an Event's count is its writer's to say)."""


def _vmi_events(events: Sequence[ObjectEvent], namespace: str, vmi: str) -> list[Upserted]:
    return [
        e
        for e in events
        if isinstance(e, Upserted)
        and e.kind == EVENT_KIND
        and e.namespace == namespace
        and isinstance(e.snapshot, EventSnapshot)
        and e.snapshot.involved_name == vmi
    ]


def _target_pod(events: Sequence[ObjectEvent], namespace: str, vmi: str, uid: str) -> tuple[str, str] | None:
    """(first published, name) of the target pod the VMI's status names for migration ``uid``."""
    name = ""
    for v in _of(events, VMI_KIND, namespace, vmi):
        s = v.snapshot
        if isinstance(s, VmiSnapshot) and s.migration is not None and s.migration.migration_uid == uid:
            name = name or s.migration.target_pod
    if not name:
        return None
    for p in _of(events, POD_KIND, namespace, name):
        if isinstance(p, Upserted) and isinstance(p.snapshot, PodSnapshot):
            return p.time, name
    return None


def vm_timeline(
    namespace: str,
    name: str,
    events: Sequence[ObjectEvent],
    usages: Sequence[UsageSnapshot] = (),
) -> list[Step] | None:
    """The steps of the VM (its VMI) ``namespace/name``; None when no event of its VMI is in ``events``.
    ``usages``: the namespace's usage snapshots, oldest first."""
    mine = _of(events, VMI_KIND, namespace, name)
    if not mine:
        return None
    steps: list[Step] = []
    first = mine[0].snapshot
    if isinstance(first, VmiSnapshot) and first.creation_timestamp is not None:
        steps.append(Step(rfc3339(first.creation_timestamp), "created", "VMI created"))
    steps.append(Step(mine[0].time, "seen", "published by the watcher"))
    running = False
    for e in mine:
        s = e.snapshot
        if isinstance(e, Deleted):
            steps.append(Step(e.time, "stopped", "VMI deleted"))
            running = False
        elif isinstance(s, VmiSnapshot):
            if s.phase == "Running" and not running:
                steps.append(Step(e.time, "running", f"phase Running on {s.node_name or 'a node'}"))
            elif s.phase in ("Succeeded", "Failed") and running:
                steps.append(Step(e.time, "stopped", f"phase {s.phase}"))
            running = s.phase == "Running"
    refusals: dict[str, tuple[str, EventSnapshot]] = {}
    said_by: set[str] = set()
    for e in _vmi_events(events, namespace, name):
        s = e.snapshot
        if isinstance(s, EventSnapshot) and s.quota_refusal:
            if s.quota_name not in said_by:  # (the first of each quota's; its retries are counted below)
                said_by.add(s.quota_name)
                steps.append(
                    Step(e.time, "refused", f"quota {s.quota_name} refused its pod: {refusal_amounts(s.message)}")
                )
            refusals[s.uid] = (e.time, s)
    steps += _retries(refusals, "refused")
    said = ""
    for usage in usages:
        for v in usage.vms:
            if v.name == name and v.state in ("admitted", "refused"):
                by = "; ".join(f"{q}: {', '.join(r)}" for q, r in sorted(v.refused_by.items()))
                detail = f"the ledger: {v.state}, {v.reason}" + (f" (does not fit {by})" if by else "")
                if detail != said:
                    steps.append(Step(usage.time, v.state, detail))
                    said = detail
    return _ordered(steps)
