"""The enforcer's reservation guard writer: the VMI sizes it has read while a holder is listed, and the holders it
lists unconfirmed until then."""

from __future__ import annotations

import copy
from typing import Any

from services.enforcer.guard import GuardWriter
from services.enforcer.kube import KubeError
from shared import contract
from shared.normalize import normalize
from shared.quota import guard
from shared.snapshot import QuotaSnapshot, VmiSnapshot, size_digest
from tests.builders import NS, quota_obj, usage_snapshot, vmi_obj

VMI = vmi_obj("vm1")


def usage() -> contract.UsageSnapshot:
    snap = normalize(VMI)
    assert isinstance(snap, VmiSnapshot)
    size = size_digest(snap.spec, snap.annotations)
    pending = contract.MigrationState(name="m1", vmi="vm1", state="pending", vmi_size=size, vmi_uid=snap.uid)
    return usage_snapshot(NS, migrations=[pending])


class Api:
    """Only the calls the writer makes here; ``during_read`` runs while a VMI read is out."""

    def __init__(self) -> None:
        self.reads = 0
        self.during_read: Any = None
        self.vmi: dict[str, Any] = VMI
        self.written: list[dict[str, Any]] = []

    async def get_reservation(self, namespace: str) -> None:
        return None

    async def put_reservation(self, namespace: str, body: dict[str, Any], resource_version: str) -> str:
        self.written.append(body)
        return str(int(resource_version or "0") + 1)

    async def get_vmi(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        if self.during_read is not None:
            once, self.during_read = self.during_read, None  # (once: the next read finds the list as it is)
            once()
        return self.vmi


async def test_a_size_read_while_the_holder_was_taken_off_the_list_is_read_again() -> None:
    """The writer remembers a VMI's size only while its holder stays listed (the policy keeps it from then on). A
    shrink that takes the holder off the list while the read is out must not leave the size remembered: listed
    again, the VMI is read again (a hotplug may have come in between). Listed throughout, it is read once."""
    api = Api()
    writer = GuardWriter(api, (guard.DEFAULT_CREATOR,))  # type: ignore[arg-type]
    key = (NS, "compute")
    await writer.before(key, usage())  # vm1 listed

    def shrink() -> None:
        writer._listed[NS] = (frozenset(), frozenset(), writer._listed[NS][2])

    api.during_read = shrink
    assert await writer.confirm(NS, usage()) == "" and api.reads == 2, "not read again after being unlisted"
    assert guard.unconfirmed(api.written[-1]) == frozenset(), "listed again, read again, confirmed"
    assert await writer.confirm(NS, usage()) == "" and api.reads == 2, "read again while listed throughout"


async def test_a_holder_is_listed_unconfirmed_until_its_vmi_is_read_at_its_reserved_size() -> None:
    """A holder reserved at a size is listed unconfirmed first (its size kept, its pods not admitted), then
    confirmed once its VMI, read after the listing, has that size; one read larger stays unconfirmed (its room may be
    in ``hard`` already: the pod KubeVirt would render now is larger than it), whether or not a raise comes with it."""
    api = Api()
    writer = GuardWriter(api, (guard.DEFAULT_CREATOR,))  # type: ignore[arg-type]
    await writer.before((NS, "compute"), usage())
    assert [guard.unconfirmed(b) for b in api.written] == [frozenset({"uid-vm1"})]
    assert await writer.confirm(NS, usage()) == ""
    assert guard.unconfirmed(api.written[-1]) == frozenset() and guard.listed(api.written[-1]) == guard.listed(
        api.written[0]
    )

    api, grown = Api(), vmi_obj("vm1", guest="8Gi")
    api.vmi = grown
    writer = GuardWriter(api, (guard.DEFAULT_CREATOR,))  # type: ignore[arg-type]
    await writer.before((NS, "compute"), usage())
    assert await writer.confirm(NS, usage()) == "VMI vm1 is not the size its pod was reserved at"
    assert len(api.written) == 1 and guard.unconfirmed(api.written[0]) == frozenset({"uid-vm1"})


class VersionedApi(Api):
    """A QuotaReservation with a resourceVersion precondition, which another writer may bump."""

    def __init__(self) -> None:
        super().__init__()
        self.obj: dict[str, Any] | None = None
        self.version = 0

    async def get_reservation(self, namespace: str) -> dict[str, Any] | None:  # type: ignore[override]
        return copy.deepcopy(self.obj)

    async def put_reservation(self, namespace: str, body: dict[str, Any], resource_version: str) -> str:
        if self.obj is not None and resource_version != str(self.version):
            raise KubeError(409, "Conflict", "the object has been modified")
        self.version += 1
        self.obj = copy.deepcopy(body)
        self.obj["metadata"]["resourceVersion"] = str(self.version)
        self.written.append(body)
        return str(self.version)

    def outside_write(self) -> None:
        assert self.obj is not None
        self.version += 1
        self.obj["metadata"]["resourceVersion"] = str(self.version)


async def test_another_writers_version_met_while_confirming_does_not_leave_the_holder_unconfirmed() -> None:
    """Another writer (an earlier leader's last write, an administrator's label) bumps the QuotaReservation while
    the enforcer reads the VMI: its write meets the new version, reads the list again and forgets what it read. It
    reads the VMI again and confirms; nothing else would (with the room in ``hard`` already, the namespace would
    sit with every pod kept out)."""
    api = VersionedApi()
    writer = GuardWriter(api, (guard.DEFAULT_CREATOR,))  # type: ignore[arg-type]
    await writer.before((NS, "compute"), usage())
    api.during_read = api.outside_write
    assert await writer.confirm(NS, usage()) == ""
    assert guard.unconfirmed(api.obj) == frozenset() and {h.name for h in guard.listed(api.obj)} == {"vm1"}


async def test_after_a_restart_a_shrink_keeps_the_holders_a_quota_not_reconciled_yet_may_carry() -> None:
    """Two managed quotas, both raised by the previous enforcer for vm1's target, vm1 listed; the migration ends
    while the enforcer is down. The new one reconciles quota ``cpu`` first: its shrink took vm1 off the list while
    quota ``mem`` still held the raise in ``spec.hard`` and ``status.hard`` (its room open to every pod) until it was
    reconciled too. A quota of the namespace not reconciled since the start keeps what is listed."""
    api = VersionedApi()
    held = guard.reservation(NS, frozenset({guard.Holder("uid-vm1", "vm1", "migration m1")}), [guard.DEFAULT_CREATOR])
    held["metadata"]["resourceVersion"] = "1"
    api.obj, api.version = copy.deepcopy(held), 1
    names = {"cpu", "mem"}
    writer = GuardWriter(api, (guard.DEFAULT_CREATOR,), lambda ns: sorted(names))  # type: ignore[arg-type]
    budgets = {"cpu": {"requests.cpu": "4"}, "mem": {"requests.memory": "8Gi"}}
    quotas = {n: contract.QuotaTerms(mode="VmiPodUsage", budget=b, hard=b) for n, b in budgets.items()}
    u = usage_snapshot(NS, 2, quotas=quotas)  # (the migration is over: nothing reserved)
    for name in ("cpu", "mem"):
        await writer.before((NS, name), u)
        await writer.after((NS, name), quota_snapshot(name, budgets[name]), u)
        listed = {h.name for h in guard.listed(api.obj)}
        assert listed == ({"vm1"} if name == "cpu" else set()), (name, listed)


def quota_snapshot(name: str, hard: dict[str, str]) -> QuotaSnapshot:
    obj = quota_obj(name, hard)
    obj["status"] = {"hard": dict(hard), "used": {}}
    snap = normalize(obj)
    assert isinstance(snap, QuotaSnapshot)
    return snap


def _usage(hard: str, migrating: bool) -> contract.UsageSnapshot:
    terms = contract.QuotaTerms(mode="VmiPodUsage", budget={"limits.memory": "64Gi"}, hard={"limits.memory": hard})
    pending = [contract.MigrationState(name="m1", vmi="vm1", vmi_uid="uid-vm1", state="pending")]
    return usage_snapshot(NS, quotas={"compute": terms}, migrations=pending if migrating else [])


async def test_the_holders_of_a_failed_write_make_a_shrink_read_the_quota_first() -> None:
    """A raise for vm1 listed it (``before``), and its write failed with its answer lost: it may have landed. Then
    the migration is deleted, and the copy of the quota at hand is one from before the raise (its quota event
    lags). ``shrinks`` said nothing would come off, so the enforcer read nothing, and ``after`` took vm1 off against
    that copy while ``status.hard`` held the raise. ``shrinks`` counts those holders, as ``after`` does."""
    api = Api()
    writer = GuardWriter(api, (guard.DEFAULT_CREATOR,), lambda ns: ["compute"])  # type: ignore[arg-type]
    key, before_the_raise = (NS, "compute"), quota_snapshot("compute", {"limits.memory": "64Gi"})
    await writer.after(key, before_the_raise, _usage("64Gi", migrating=False))
    await writer.before(key, _usage("80Gi", migrating=True))  # (and the write of 80Gi fails, its answer lost)
    assert {h.name for h in guard.listed(api.written[-1])} == {"vm1"}
    assert writer.shrinks(key, before_the_raise, _usage("64Gi", migrating=False)), "no read before vm1 comes off"
    landed = quota_snapshot("compute", {"limits.memory": "80Gi"})  # (what the read finds: the raise landed)
    await writer.after(key, landed, _usage("64Gi", migrating=False))
    assert {h.name for h in guard.listed(api.written[-1])} == {"vm1"}, "vm1 off while status.hard holds its raise"
