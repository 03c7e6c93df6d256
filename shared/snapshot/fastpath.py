"""The events decoder's fast path: a pod's resource lists and a VMI's kept spec recur byte for byte on the wire
(pods of one size, VMIs of one template), so they are read as JSON text and each distinct text is decoded once.
:func:`wire_variant` makes the Struct that reads so, :func:`from_wire` the snapshot; the results are the plain
decoder's (tested equal).

It is also where a ledger's memory is kept small (the snapshot types stay plain): the snapshots it makes share
equal resource lists and specs, and their identity strings and short label values are interned (a VM's name and
uid recur in its VMI, its pods' labels and owner references and every version of them, and a ledger keys its
records by the uid)."""

from __future__ import annotations

import sys
from typing import Any, Final, Union

import msgspec

from shared.bounded import Bounded
from shared.quantity import Quantity
from shared.snapshot.hooks import dec_hook
from shared.snapshot.sharing import NO_QUANTITIES, Shared, shared_resources
from shared.snapshot.types import SNAPSHOT_TYPES, PodSnapshot, VmiSnapshot
from shared.snapshot.vmispec import compact_vmi_spec

RAW: Final = msgspec.Raw | msgspec.UnsetType
"""In a :func:`wire_variant`: the field's JSON text (``msgspec.UNSET`` when it is absent)."""


def wire_variant(tp: type[msgspec.Struct], **types: Any) -> Any:
    """A Struct (decode only) that reads the JSON ``tp`` reads: the same wire names, tag and defaults, the named
    fields typed as given (:data:`RAW`: their JSON text), and no ``__post_init__``."""
    fields = msgspec.structs.fields(tp)
    config = tp.__struct_config__

    def default(f: msgspec.structs.FieldInfo) -> Any:
        if types.get(f.name) is RAW:
            return msgspec.UNSET
        if f.default_factory is not msgspec.NODEFAULT:
            return msgspec.field(default_factory=f.default_factory)
        return msgspec.field() if f.default is msgspec.NODEFAULT else f.default

    return msgspec.defstruct(
        f"Wire{tp.__name__}",
        [(f.name, types.get(f.name, f.type), default(f)) for f in fields],
        module=__name__,
        tag_field=config.tag_field,
        tag=config.tag,
        rename={f.name: f.encode_name for f in fields},
        forbid_unknown_fields=config.forbid_unknown_fields,
        array_like=config.array_like,
        frozen=True,
        kw_only=True,
        gc=False,
    )


# A launcher pod's three resource lists hold 25 quantities (a ``dec_hook`` call each, then the lists are shared with
# equal ones), and a VMI's kept spec is a dozen containers that are encoded again to be shared: most of decoding an
# event. Pods of one size and VMIs of one template carry them byte for byte the same. The wire variants read them as
# JSON text, and each distinct text is decoded once (bounded memos; the values are shared, read-only, as the
# snapshots' own sharing makes them). Decoding is a function of the text, so a text's value is the same every time.
_WirePod: Final = wire_variant(PodSnapshot, requests=RAW, limits=RAW, usage=RAW)
_WireVmi: Final = wire_variant(VmiSnapshot, spec=RAW)
_MEMO_ENTRIES: Final = 4096
_MEMO_TEXT_BYTES: Final = 4096
"""Longer texts are decoded every time, not remembered."""
_RESOURCES_DECODER: Final = msgspec.json.Decoder(dict[str, Quantity], dec_hook=dec_hook)
_SPEC_DECODER: Final = msgspec.json.Decoder(dict[str, Any])
_POD_LISTS: Final[Bounded[tuple[bytes, bytes, bytes], tuple[dict[str, Quantity], ...]]] = Bounded(_MEMO_ENTRIES)
_VMI_SPECS: Final[Bounded[bytes, dict[str, Any]]] = Bounded(_MEMO_ENTRIES)
_intern: Final = sys.intern
_INTERNED_VALUE_CHARS: Final = 64
"""Label and annotation values up to this long are interned (nodes, apps, versions recur); longer ones are not."""


_NO_STRINGS: Final[dict[str, str]] = Shared()
"""One empty string map for every snapshot without labels, annotations or active pods (read-only, as they are)."""


def _interned_values(values: dict[str, str]) -> dict[str, str]:
    """``values`` (a freshly decoded dict, ours to change) with its short values interned (one empty map shared)."""
    if not values:
        return _NO_STRINGS
    for k, v in values.items():
        if len(v) <= _INTERNED_VALUE_CHARS:
            values[k] = _intern(v)
    return values


def _interned_items(values: dict[str, str]) -> dict[str, str]:
    """``values`` with keys and values interned (``status.activePods``: pod uids and nodes, both recurring)."""
    if not values:
        return _NO_STRINGS
    intern = _intern
    return {intern(k): intern(v) for k, v in values.items()}


def _pod_from_wire(w: Any) -> PodSnapshot:
    unset = msgspec.UNSET  # (absent: the default, an empty list)
    r, lim, u = w.requests, w.limits, w.usage
    key = (b"{}" if r is unset else bytes(r), b"{}" if lim is unset else bytes(lim), b"{}" if u is unset else bytes(u))
    lists = _POD_LISTS.get(key)
    if lists is None:
        lists = tuple(shared_resources(_RESOURCES_DECODER.decode(text)) for text in key)
        if sum(map(len, key)) <= _MEMO_TEXT_BYTES:
            _POD_LISTS.keep(key, lists)
    requests, limits, usage = lists
    intern = _intern
    return PodSnapshot(
        schema=w.schema,
        uid=intern(w.uid),
        namespace=intern(w.namespace),
        name=w.name,  # (the pod's own: nothing to share it with)
        resource_version=w.resource_version,
        creation_timestamp=w.creation_timestamp,
        labels=_interned_values(w.labels),
        phase=intern(w.phase),
        node_name=intern(w.node_name),
        deletion_timestamp=w.deletion_timestamp,
        deletion_grace_period_seconds=w.deletion_grace_period_seconds,
        owner_vmi_name=intern(w.owner_vmi_name),
        owner_vmi_uid=intern(w.owner_vmi_uid),
        command_vmi_uid=intern(w.command_vmi_uid),
        owner_pod_uid=w.owner_pod_uid,
        requests=requests,
        limits=limits,
        usage=usage,
        memory_overhead=w.memory_overhead,
        terminating_scope=w.terminating_scope,
        best_effort=w.best_effort,
        priority_class_name=w.priority_class_name,
    )


def _vmi_from_wire(w: Any) -> VmiSnapshot:
    text = b"{}" if w.spec is msgspec.UNSET else bytes(w.spec)  # (absent: the default, no spec)
    spec = _VMI_SPECS.get(text)
    if spec is None:
        spec = compact_vmi_spec(_SPEC_DECODER.decode(text))
        if len(text) <= _MEMO_TEXT_BYTES:
            _VMI_SPECS.keep(text, spec)
    intern = _intern
    return VmiSnapshot(
        schema=w.schema,
        uid=intern(w.uid),
        namespace=intern(w.namespace),
        name=intern(w.name),
        resource_version=w.resource_version,
        creation_timestamp=w.creation_timestamp,
        annotations=_interned_values(w.annotations),
        deletion_timestamp=w.deletion_timestamp,
        phase=intern(w.phase),
        node_name=intern(w.node_name),
        vcpus=w.vcpus,
        guest_memory=w.guest_memory,
        status_vcpus=w.status_vcpus,
        status_guest_memory=w.status_guest_memory,
        memory_change=w.memory_change,
        requests=w.requests or NO_QUANTITIES,
        limits=w.limits or NO_QUANTITIES,
        memory_overhead=w.memory_overhead,
        migration=w.migration,
        active_pods=_interned_items(w.active_pods),
        unplugged_interfaces=w.unplugged_interfaces,
        pod_refused=w.pod_refused,
        refused_by=w.refused_by,
        priority_class_name=w.priority_class_name,
        hotplug_volumes=w.hotplug_volumes,
        spec=spec,
    )


_FROM_WIRE: Final[dict[type, Any]] = {_WirePod: _pod_from_wire, _WireVmi: _vmi_from_wire}

WIRE_SNAPSHOT: Final = Union[  # noqa: UP007  (a union built at run time)
    tuple(_WirePod if t is PodSnapshot else _WireVmi if t is VmiSnapshot else t for t in SNAPSHOT_TYPES.values())
]
""":data:`AnySnapshot` as the events decoder's fast path reads it (:func:`from_wire` makes the snapshot)."""


def from_wire(w: Any) -> Any:
    """The snapshot a value read as :data:`WIRE_SNAPSHOT` stands for: what decoding it as :data:`AnySnapshot`
    gives (None stays None). Raises like that decoding (``msgspec.ValidationError``) on a part it refuses."""
    make = _FROM_WIRE.get(type(w))
    return w if make is None else make(w)


_WIRE_DECODER: Final = msgspec.json.Decoder(WIRE_SNAPSHOT, dec_hook=dec_hook)
