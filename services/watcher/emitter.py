"""From raw Kubernetes objects to bus messages (:class:`Emitter`): each object normalised to its snapshot and queued on
the publisher as an upsert, a deletion or a sync marker; an object that cannot be read goes to the dead-letter
subject with the reason (the raw object, capped)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from services.platform.publisher import Item, Publisher
from services.watcher.kube import Obj
from services.watcher.metrics import SERVICE, WatcherMetrics
from shared import contract, text
from shared.errors import InvalidInput
from shared.normalize import normalize

_encode_raw: Final = msgspec.json.Encoder().encode


class Ident:
    """uid, namespace, name and resourceVersion of a raw object; InvalidInput when they cannot be read."""

    __slots__ = ("name", "namespace", "rv", "rv_text", "uid")

    def __init__(self, obj: Obj) -> None:
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            raise InvalidInput("missing", "metadata")
        uid, ns, name, rv = meta.get("uid"), meta.get("namespace") or "", meta.get("name"), meta.get("resourceVersion")
        if not isinstance(uid, str) or not uid:
            raise InvalidInput("missing", "metadata.uid")
        if not isinstance(name, str) or not name:
            raise InvalidInput("missing", "metadata.name")
        if not isinstance(ns, str):
            raise InvalidInput("expected a string", "metadata.namespace")
        self.uid: str = uid
        self.namespace: str = ns
        self.name: str = name
        self.rv: int = contract.resource_version(rv, "metadata.resourceVersion")
        self.rv_text: str = str(rv)


def where(kind: str, obj: Obj) -> str:
    """How a message names an object: its kind and namespace/name (an Event's name may hold spaces and any letter:
    those are escaped, :func:`shared.text.name`)."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return kind
    ns, name = text.name(str(meta.get("namespace"))), text.name(str(meta.get("name")))
    return f"{kind} {ns}/{name}" if meta.get("namespace") else f"{kind} {name}"


def _msg_id(event_id: str, again: str) -> str:
    """The ``Nats-Msg-Id`` of an event: its id, or, published again by a relist a consumer asked for (``again``, the
    round's name), an id of that round (the stream may have dropped the first within its duplicate window)."""
    return f"{event_id}/{again}" if again else event_id


class Emitter:
    """Turns raw objects into bus messages and queues them on the publisher (synchronously: see Publisher)."""

    def __init__(self, cluster: str, publisher: Publisher, metrics: WatcherMetrics | None, log: Any) -> None:
        self.cluster = cluster
        self.publisher = publisher
        self.metrics = metrics
        self.log = log
        self._subjects: dict[tuple[str, str], str] = {}

    def subject(self, kind: str, namespace: str) -> str:
        """The event subject (validated once per kind and namespace)."""
        key = (kind, namespace)
        subject = self._subjects.get(key)
        if subject is None:
            subject = self._subjects[key] = contract.event_subject(self.cluster, kind, namespace)
        return subject

    def upsert(self, kind: str, obj: Obj, ident: Ident, *, again: str = "") -> bool:
        """Queue an ``Upserted`` (or, when the object cannot be normalised, a dead letter); False for the latter.
        ``again``: a relist a consumer asked for, which publishes the version again under a message id of its own
        (the stream may have dropped the first within its duplicate window: a flood of it does)."""
        try:
            snap = normalize(obj)
            ev = contract.object_event(
                "upserted",
                cluster=self.cluster,
                kind=kind,
                namespace=ident.namespace,
                name=ident.name,
                uid=ident.uid,
                rv=ident.rv_text,
                snapshot=snap,
            )
            subject = self.subject(kind, ident.namespace)
        except InvalidInput as e:
            self.dead_letter(kind, obj, str(e), ident)
            return False
        except Exception as e:  # a bug in normalisation must not stop the watcher: report the object instead
            self.log.error("normalising failed", kind=kind, namespace=ident.namespace, name=ident.name, error=repr(e))
            self.dead_letter(kind, obj, f"internal error normalising {where(kind, obj)}: {e!r}", ident)
            return False
        data = contract.encode(ev)
        if len(data) > self.publisher.max_payload - 1024:  # room for the headers
            self.dead_letter(kind, obj, f"its event is {len(data)} bytes, over the bus's maximum message size", ident)
            return False
        self.publisher.enqueue(Item(subject, data, _msg_id(ev.id, again), label=f"{kind}|upserted"))
        return True

    def delete(
        self, kind: str, ident: Ident | None, *, uid: str, namespace: str, name: str, rv: str, obj: Obj | None
    ) -> None:
        """Queue a ``Deleted`` with the last state when it can be read (a deletion is never lost to a bad field)."""
        snap = None
        if obj is not None:
            with contextlib.suppress(Exception):
                snap = normalize(obj)
        try:
            ev = contract.object_event(
                "deleted",
                cluster=self.cluster,
                kind=kind,
                namespace=namespace,
                name=name,
                uid=uid,
                rv=rv,
                snapshot=snap,
            )
            subject = self.subject(kind, namespace)
            data = contract.encode(ev)
            if snap is not None and len(data) > self.publisher.max_payload - 1024:
                data = contract.encode(msgspec.structs.replace(ev, snapshot=None))  # the deletion without its state
        except InvalidInput as e:
            if obj is not None and ident is not None:
                self.dead_letter(kind, obj, str(e), ident)
            else:
                self.log.error("cannot publish a deletion", kind=kind, namespace=namespace, name=name, error=str(e))
            return
        self.publisher.enqueue(Item(subject, data, ev.id, label=f"{kind}|deleted"))

    def sync(
        self, kind: str, namespace: str, rv: str, present: list[str], *, answers: Sequence[str] = (), again: str = ""
    ) -> None:
        """Queue a sync marker (``again``: of a relist a consumer asked for, under a message id of its round)."""
        ev = contract.sync_event(
            cluster=self.cluster, kind=kind, namespace=namespace, rv=rv, present=present, answers=answers
        )
        subject = contract.event_subject(self.cluster, kind, namespace or contract.CLUSTER_TOKEN)
        self.publisher.enqueue(Item(subject, contract.encode(ev), _msg_id(ev.id, again), label=f"{kind}|sync"))

    def dead_letter(self, kind: str, obj: Obj, reason: str, ident: Ident | None) -> None:
        """Queue a :class:`shared.contract.DeadLetter` with the raw object, deduplicated per object version."""
        payload = _encode_raw(obj)
        reason = contract.short_reason(reason)  # (it may quote the tenant's text: logged and published once, short)
        raw_meta = obj.get("metadata")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        ns = ident.namespace if ident is not None else str(meta.get("namespace") or "")
        name = ident.name if ident is not None else str(meta.get("name") or "")
        try:
            original = contract.event_subject(self.cluster, kind, ns)
        except InvalidInput:
            original = ""
        dlq = contract.dlq_subject(SERVICE, self.cluster, contract.namespace_token(kind, ns))
        mid = f"dlq/{SERVICE}/{self.cluster}/{kind}/{ident.uid}/{ident.rv_text}" if ident is not None else None
        letter, headers = contract.dead_letter(
            SERVICE,
            reason,
            cluster=self.cluster,
            subject=f"{ns}/{text.name(name)}" if ns else text.name(name),
            original_subject=original,
            payload=payload,
            msg_id=mid,
            limit=self.publisher.max_payload // 2,
        )
        reason = letter.reason
        self.log.warning("object sent to the dead-letter subject", kind=kind, namespace=ns, name=name, reason=reason)
        if self.metrics is not None:
            self.metrics.errors.labels(self.cluster, kind, "dlq").inc()
        self.publisher.enqueue(Item(dlq, contract.encode(letter), mid, headers, label=f"{kind}|deadletter"))
