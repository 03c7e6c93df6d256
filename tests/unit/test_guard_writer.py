"""The enforcer's reservation guard writer: the VMI sizes it has read while a holder is listed."""

from __future__ import annotations

from typing import Any

from services.enforcer.guard import GuardWriter
from shared import contract
from shared.normalize import normalize
from shared.quota import guard
from shared.snapshot import VmiSnapshot, size_digest
from tests.builders import NS, usage_snapshot, vmi_obj

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

    async def get_reservation(self, namespace: str) -> None:
        return None

    async def put_reservation(self, namespace: str, body: dict[str, Any], resource_version: str) -> str:
        return str(int(resource_version or "0") + 1)

    async def get_vmi(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        if self.during_read is not None:
            self.during_read()
        return VMI


async def test_a_size_read_while_the_holder_was_taken_off_the_list_is_read_again() -> None:
    """The writer remembers a VMI's size only while its holder stays listed (the policy keeps it from then on). A
    shrink that takes the holder off the list while the read is out must not leave the size remembered: listed
    again, the VMI is read again (a hotplug may have come in between). Listed throughout, it is read once."""
    api = Api()
    writer = GuardWriter(api, (guard.DEFAULT_CREATOR,))  # type: ignore[arg-type]
    key = (NS, "compute")
    await writer.before(key, usage())  # vm1 listed

    def shrink() -> None:
        writer._listed[NS] = (frozenset(), writer._listed[NS][1])

    api.during_read = shrink
    assert await writer.resized(NS, usage()) == "" and api.reads == 1
    api.during_read = None
    await writer.write(NS, grow=True)  # listed again
    assert await writer.resized(NS, usage()) == "" and api.reads == 2, "not read again after being unlisted"
    assert await writer.resized(NS, usage()) == "" and api.reads == 2, "read again while listed throughout"
