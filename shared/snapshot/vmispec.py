"""The part of a VMI's spec the launcher pod depends on (:data:`RENDER_SPEC_SHAPE`), pruned to it
(:func:`prune_vmi_spec`) and shared between VMIs of one template (:func:`compact_vmi_spec`)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final, cast

import msgspec

from shared.bounded import Bounded
from shared.kubevirt.render import render_annotations
from shared.snapshot.sharing import Shared

KEEP: Final = None
"""In a spec shape: keep the value verbatim."""
PRESENT: Final = "present"
"""In a spec shape: only whether the value is set matters (kept as ``{}``, or ``None`` when it is null)."""

SpecShape = Mapping[str, "SpecShape"] | tuple["SpecShape"] | str | None
"""How much of a value to keep: :data:`KEEP`, :data:`PRESENT`, an object shape (``{key: shape}``: only those keys)
or a one-element tuple (a list whose object items have that shape)."""

_DEVICE: Final[SpecShape] = ({"deviceName": KEEP, "claimRequest": PRESENT},)
RENDER_SPEC_SHAPE: Final[SpecShape] = {
    "domain": {
        "resources": KEEP,
        "cpu": {k: KEEP for k in ("sockets", "cores", "threads", "dedicatedCpuPlacement", "isolateEmulatorThread")},
        "ioThreadsPolicy": KEEP,
        "ioThreads": {"supplementalPoolThreadCount": KEEP},
        "memory": {"guest": KEEP, "hugepages": {"pageSize": KEEP}, "reservedOverhead": {"addedOverhead": KEEP}},
        "firmware": {"kernelBoot": {"container": {"image": KEEP}}},
        "launchSecurity": {"sev": PRESENT, "snp": PRESENT, "tdx": PRESENT},
        "devices": {
            "gpus": _DEVICE,
            "hostDevices": _DEVICE,
            "filesystems": ({"name": KEEP},),
            "interfaces": (
                {
                    "sriov": PRESENT,
                    "passtBinding": PRESENT,
                    "passt": PRESENT,
                    "binding": {"name": KEEP},
                    "model": KEEP,
                    "ports": KEEP,
                },
            ),
            "disks": ({"lun": {"reservation": KEEP}},),
            "autoattachPodInterface": KEEP,
            "autoattachVSOCK": KEEP,
            "autoattachSerialConsole": KEEP,
            "logSerialConsole": KEEP,
            "autoattachGraphicsDevice": KEEP,
            "tpm": KEEP,
        },
    },
    "volumes": ({"name": KEEP, "containerDisk": PRESENT, "downwardMetrics": PRESENT},),
    "networks": ({},),
    "architecture": KEEP,
    "livenessProbe": {"exec": PRESENT},
    "readinessProbe": {"exec": PRESENT},
}
"""The parts of a VMI spec that ``shared.vmi.vmi_spec`` and ``shared.kubevirt.render_launcher_pod`` read (sizes,
devices, volumes and probes that add containers, device-plugin resources or overhead). Cloud-init data, firmware
ids, disk and network details and the like change no launcher pod and are dropped (only a LUN's ``reservation``
and how many networks there are count). Kept in step with the renderer by ``tests/unit/test_snapshot.py``
(rendering from the pruned spec gives the same pod, or the same error, as from the full one)."""


def _prune(value: Any, shape: SpecShape) -> Any:
    if shape is KEEP:
        return value
    if shape == PRESENT:
        return None if value is None else {}
    if type(shape) is tuple:
        if type(value) is not list:
            return value  # not a list: kept as is, so the renderer reports it as it would have
        item = shape[0]
        return [_prune(v, item) if type(v) is dict else v for v in value]  # every item: indexes in errors stay
    assert isinstance(shape, Mapping)
    if type(value) is not dict:
        return value
    return {k: _prune(v, shape[k]) for k, v in value.items() if k in shape}


def prune_vmi_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a VMI spec (:data:`RENDER_SPEC_SHAPE`) the launcher pod depends on: rendering the pruned spec
    gives the same pod, or the same error naming the same field, as rendering the full one. Values of an
    unexpected type are kept as they are; key order is kept. Pruning a pruned spec changes nothing."""
    return _prune(dict(spec), RENDER_SPEC_SHAPE)  # type: ignore[no-any-return]


_SPEC_ENCODER: Final = msgspec.json.Encoder()

HELD_SPEC_FIELDS: Final = ("domain", "networks")
"""The parts of a VMI's spec an update of a running VMI can change that its launcher pod is rendered from (CPU and
memory hotplug with the resources KubeVirt adjusts, interfaces hotplug with their networks): what the reservation
guard keeps a holder VMI from changing while its room is open."""


def size_digest(spec: Mapping[str, Any], annotations: Mapping[str, str]) -> str:
    """A short digest of what a VMI's launcher pod is rendered from that an update of a running VMI can change:
    the rendering-relevant part (:func:`prune_vmi_spec`) of its spec's :data:`HELD_SPEC_FIELDS` (pruned or whole:
    the same digest, so for every reader) and its ``RENDER_ANNOTATIONS`` (``shared.kubevirt.render``). Equal
    digests, the same pod. The ledger records it for the VMI a migration target was reserved from; the enforcer
    compares the VMI's current one before it opens that room."""
    held = render_annotations(annotations)
    pruned: Any = {"spec": prune_vmi_spec({f: spec[f] for f in HELD_SPEC_FIELDS if f in spec}), "annotations": held}
    try:
        text = msgspec.json.encode(pruned, order="sorted")
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError):
        text = repr(pruned).encode()
    return hashlib.blake2b(text, digest_size=8).hexdigest()


class SharedSpec(Shared[Any]):
    """A pruned VMI spec that VMIs of one template share."""

    __slots__ = ()


_COMPACT: Final[Bounded[bytes, SharedSpec]] = Bounded(4096)
"""The encoded form of each shared pruned spec → that spec."""


def compact_vmi_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`prune_vmi_spec`, shared: VMIs of one template or instance type hold one dict (read-only, like the
    snapshot holding it). Specs that do not survive a JSON round trip unchanged are not shared. A spec equal to a
    shared one, with the same JSON form, is that one, without pruning it again (pruning a pruned spec changes
    nothing): the common case of a snapshot decoded from the wire, whose spec its writer pruned. A shared spec is
    itself."""
    if type(spec) is SharedSpec:
        return spec
    known: dict[str, Any] | None
    try:
        known = _COMPACT.get(_SPEC_ENCODER.encode(spec))
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError):  # (what pruning drops may not encode)
        known = None
    if known is not None and known == spec:
        return known
    pruned = prune_vmi_spec(spec)
    try:
        key = _SPEC_ENCODER.encode(pruned)
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError):
        return pruned
    shared = _COMPACT.get(key)
    if shared is None:
        shared = SharedSpec(cast(dict[str, Any], msgspec.json.decode(key)))
        if shared != pruned:
            return pruned
        return _COMPACT.keep(key, shared)
    return shared if shared == pruned else pruned
