"""Where messages go, and the names in them: subjects per cluster, namespace and kind, their validation (cluster ids
and namespaces are DNS labels, safe as subject tokens), and message ids (the deduplication key)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from shared.errors import InvalidInput
from shared.kinds import (
    CLUSTER_SCOPED_KINDS,
    EVENT_KIND,
    KUBEVIRT_KIND,
    NAMESPACE_KIND,
    POD_KIND,
    QUOTA_KIND,
    VM_KIND,
    VMI_KIND,
    VMIM_KIND,
)

PREFIX: Final = "vmquota"
CLUSTER_TOKEN: Final = "_cluster"
"""Namespace token of cluster-scoped objects in event subjects."""

# ---- kinds ------------------------------------------------------------------------------------------------------

KIND_TOKENS: Final[dict[str, str]] = {
    VMI_KIND: "vmi",
    VM_KIND: "vm",
    VMIM_KIND: "vmim",
    POD_KIND: "pod",
    QUOTA_KIND: "resourcequota",
    NAMESPACE_KIND: "namespace",
    KUBEVIRT_KIND: "kubevirt",
    EVENT_KIND: "event",
}
"""Kubernetes kind → subject token of every object kind published on the bus."""

TOKEN_KINDS: Final[dict[str, str]] = {v: k for k, v in KIND_TOKENS.items()}


def subject_kind(subject: str) -> str | None:
    """The kind an event subject names (its last token, as :func:`parse_event_subject` reads it, unchecked: a
    reader's shortcut to skip kinds it does not fold), None for a subject that names none."""
    return TOKEN_KINDS.get(subject.rpartition(".")[2])


# ---- event types ------------------------------------------------------------------------------------------------

UPSERTED: Final = "io.vmquota.event.upserted"
DELETED: Final = "io.vmquota.event.deleted"
SYNC: Final = "io.vmquota.event.sync"
USAGE: Final = "io.vmquota.usage"
DECISION: Final = "io.vmquota.decision"
DEAD_LETTER: Final = "io.vmquota.deadletter"

_SHORT_TYPE: Final = {UPSERTED: "upserted", DELETED: "deleted", SYNC: "sync"}

# ---- names and validation ---------------------------------------------------------------------------------------

_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_RV: Final = re.compile(r"^[0-9]{1,19}\Z")


def check_cluster(cluster: object) -> str:
    """A cluster id must be a DNS label (it is a subject token and part of every message id)."""
    if not isinstance(cluster, str) or not _DNS_LABEL.match(cluster):
        raise InvalidInput(
            f"cluster id {cluster!r} is not a DNS label (lower-case letters, digits and '-', 1-63 characters, "
            "starting and ending with a letter or digit)",
            "cluster",
        )
    return cluster


def check_namespace(namespace: object, where: str = "namespace") -> str:
    """A namespace name (a DNS label, so it is safe as a subject token)."""
    if not isinstance(namespace, str) or not _DNS_LABEL.match(namespace):
        raise InvalidInput(f"namespace {namespace!r} is not a DNS label", where)
    return namespace


def check_kind(kind: object) -> str:
    if not isinstance(kind, str) or kind not in KIND_TOKENS:
        raise InvalidInput(f"unknown kind {kind!r} (known: {', '.join(sorted(KIND_TOKENS))})", "kind")
    return kind


def resource_version(rv: object, where: str = "resourceVersion") -> int:
    """The resourceVersion as an integer for ordering (Kubernetes and the simulated cluster use etcd revisions)."""
    if not isinstance(rv, str) or not _RV.match(rv):
        raise InvalidInput(f"resourceVersion {rv!r} is not a decimal number", where)
    return int(rv)


def namespace_token(kind: str, namespace: str) -> str:
    """The namespace token of an object's event subject: ``_cluster`` for cluster-scoped kinds."""
    return CLUSTER_TOKEN if kind in CLUSTER_SCOPED_KINDS else namespace


def event_subject(cluster: str, kind: str, namespace: str) -> str:
    """``vmquota.ev.<cluster>.<namespace or _cluster>.<kind token>``."""
    check_cluster(cluster)
    check_kind(kind)
    token = namespace_token(kind, namespace)
    if token != CLUSTER_TOKEN:
        check_namespace(namespace)
    return event_subject_of(cluster, token, kind)


def event_subject_of(cluster: str, token: str, kind: str) -> str:
    """:func:`event_subject` of names already checked, with the namespace token (a decoded event's, every event)."""
    return f"{PREFIX}.ev.{cluster}.{token}.{KIND_TOKENS[kind]}"


def events_filter(cluster: str | None = None) -> str:
    """Subject filter of every event (of one cluster, or of all clusters)."""
    return f"{PREFIX}.ev.{check_cluster(cluster)}.>" if cluster is not None else f"{PREFIX}.ev.>"


def usage_subject(cluster: str, namespace: str) -> str:
    return f"{PREFIX}.usage.{check_cluster(cluster)}.{check_namespace(namespace)}"


def decision_subject(cluster: str, namespace: str) -> str:
    return f"{PREFIX}.quota.{check_cluster(cluster)}.{check_namespace(namespace)}"


def relist_subject(cluster: str) -> str:
    """``vmquota.relist.<cluster>``: where a consumer that lost events of a cluster asks its watcher to publish
    everything again (core NATS, not a stream)."""
    return f"{PREFIX}.relist.{check_cluster(cluster)}"


UNKNOWN_TOKEN: Final = "_"
"""Cluster or namespace token of a dead letter whose input names none that can be read."""


def dlq_subject(service: str, cluster: str = "", namespace: str = "") -> str:
    """``vmquota.dlq.<service>.<cluster>.<namespace>``: a dead letter's subject names the cluster and namespace of
    what could not be used (``_cluster`` for a cluster-scoped object, ``_`` where none can be read), so that the
    dead-letter stream's per-subject limit (:data:`shared.contract.streams.DLQ_PER_SUBJECT`) bounds what one
    namespace's objects, which its tenant writes, can take of it."""
    if not _DNS_LABEL.match(service):
        raise InvalidInput(f"service name {service!r} is not a DNS label", "service")
    c = cluster if _DNS_LABEL.match(cluster) else UNKNOWN_TOKEN
    n = namespace if namespace == CLUSTER_TOKEN or _DNS_LABEL.match(namespace) else UNKNOWN_TOKEN
    return f"{PREFIX}.dlq.{service}.{c}.{n}"


def subject_scope(subject: str) -> tuple[str, str]:
    """The cluster and namespace tokens of an event or usage subject (``vmquota.ev.<cluster>.<namespace>.<kind>``,
    ``vmquota.usage.<cluster>.<namespace>``), unchecked; empty for a subject of another shape."""
    parts = subject.split(".")
    if len(parts) >= 4 and parts[0] == PREFIX and parts[1] in ("ev", "usage"):
        return parts[2], parts[3]
    return "", ""


@dataclass(frozen=True, slots=True)
class EventSubject:
    cluster: str
    namespace: str
    """A namespace name, or ``_cluster``."""
    kind: str


def parse_event_subject(subject: str) -> EventSubject:
    """Split and validate ``vmquota.ev.<cluster>.<namespace>.<kind token>``."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[1] != "ev":
        raise InvalidInput(f"{subject!r} is not an event subject (vmquota.ev.<cluster>.<namespace>.<kind>)", "subject")
    cluster = check_cluster(parts[2])
    kind = TOKEN_KINDS.get(parts[4])
    if kind is None:
        raise InvalidInput(f"unknown kind token {parts[4]!r}", "subject")
    if parts[3] != CLUSTER_TOKEN:
        check_namespace(parts[3], "subject")
    return EventSubject(cluster, parts[3], kind)


# ---- message ids ------------------------------------------------------------------------------------------------


def msg_id(cluster: str, kind: str, uid: str, rv: str, type_: str) -> str:
    """``Nats-Msg-Id`` of an object event: ``cluster/kind/uid/resourceVersion/type`` (type: upserted, deleted,
    sync). The server drops a repeat within the stream's duplicate window, so relists and a second watcher during
    a leader hand-over do not store the same version twice."""
    return f"{cluster}/{kind}/{uid}/{rv}/{_SHORT_TYPE.get(type_, type_)}"


def sync_uid(namespace: str) -> str:
    """The ``uid`` slot of a sync marker's message id: ``ns=<namespace or _cluster>`` (never a real UID)."""
    return f"ns={namespace}"
