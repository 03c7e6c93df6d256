"""What an operator reads: one row per managed quota, from the ledger's usage and the enforcer's decisions, as a
table or as JSON (pure; ``vmquota status`` and ``vmquota replay`` print it).

Quantities are shown in one readable form per resource (:func:`readable`): memory-like resources in binary units
(``16Gi``, ``1.5Gi``), everything else as Kubernetes writes it (``2``, ``1500m``). The JSON keeps Kubernetes
quantity strings.

The JSON form is a contract (other tools parse it)::

    {"quotas": [{"cluster", "namespace", "name", "mode", "budget": {RES: QTY}, "used": {...}, "pods": {...},
                 "reserved": {...}, "hard": {...}, "raisedFor": [NAME, ...], "vms": {"running", "admitted",
                 "refused"}, "status": "..."}]}

``used`` is U (the mode's terms), ``pods`` P (what native quota charges the namespace's pods), ``reserved`` S.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from typing import Any, Final

from shared.contract import Decision, UsageSnapshot, error_count
from shared.errors import InvalidInput
from shared.kinds import QUOTA_KIND
from shared.quantity import NANO, Quantity
from shared.quota.modes import VM_TERM_MODES
from shared.resources import is_byte_resource
from shared.text import printable
from shared.times import parse_rfc3339

_BINARY_UNITS: Final = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def readable(q: Quantity, resource: str) -> str:
    """A short, readable amount: bytes in the largest binary unit with at most one decimal (``17405661185`` →
    ``16.2Gi``), everything else as Kubernetes writes it (``1500m``, ``2``)."""
    if not is_byte_resource(resource):
        return q.canonical()
    value = Fraction(abs(q.nanos), NANO)
    sign = "-" if q.nanos < 0 else ""
    for suffix, exp in _BINARY_UNITS:
        unit = 2**exp
        if value >= unit:
            tenths = round(value * 10 / unit)
            whole, frac = divmod(tenths, 10)
            return f"{sign}{whole}{'.' + str(frac) if frac else ''}{suffix}"
    return q.canonical()


_RESOURCE: Final = r"[A-Za-z0-9./_-]+"
_QUANTITY: Final = r"[0-9][0-9.]*[A-Za-z]*"
_AMOUNT: Final = re.compile(rf"({_RESOURCE})=({_QUANTITY})")


def readable_amounts(text: str) -> str:
    """``text`` (a message Kubernetes wrote: ``requested: limits.memory=35032106752``) with every ``name=amount``
    readable (``limits.memory=32.6Gi``); what does not read as a quantity is left as it is."""

    def one(m: re.Match[str]) -> str:
        try:
            return f"{m[1]}={readable(Quantity.parse(m[2]), m[1])}"
        except InvalidInput:
            return m[0]

    return _AMOUNT.sub(one, text)


_ITEM: Final = f"{_RESOURCE}={_QUANTITY}"
_REFUSAL_PART: Final = re.compile(rf"\b(requested|used|limited): ({_ITEM}(?:,{_ITEM})*)")
REFUSAL_ITEMS_SHOWN: Final = 8
"""The most amounts a refusal's summary shows of each part (quota admission names only the resources a quota
limits; the rest of a longer list is counted)."""


def refusal_amounts(message: str) -> str:
    """What a quota refusal's message (``exceeded quota: rq, requested: limits.memory=35032106752, used: ...,
    limited: ...``) says it requested, used and limited, readable (``requested limits.memory=32.6Gi; used ...``);
    nothing else of it. The message is anyone's to write in the namespace (an Event): shown whole, a tenant padded
    it until text of its own read as a line of the command's, whereas a resource name and an amount hold no space."""
    parts: dict[str, str] = {}
    for m in _REFUSAL_PART.finditer(message):
        if m[1] in parts:
            continue
        items = m[2].split(",")
        more = f" (and {len(items) - REFUSAL_ITEMS_SHOWN} more)" if len(items) > REFUSAL_ITEMS_SHOWN else ""
        parts[m[1]] = readable_amounts(",".join(items[:REFUSAL_ITEMS_SHOWN])) + more
    if not parts:
        return "no amounts it names can be read"
    return "; ".join(f"{k} {parts[k]}" for k in ("requested", "used", "limited") if k in parts)


def readable_list(rl: Mapping[str, str]) -> dict[str, str]:
    """A wire resource list (canonical strings) in readable form; an unreadable value is shown as it is."""
    out: dict[str, str] = {}
    for r in sorted(rl):
        try:
            out[r] = readable(Quantity.parse(rl[r], allow_negative=True), r)
        except InvalidInput:
            out[r] = rl[r]
    return out


SCALE_NOTE: Final = (
    "hard = pods + reserved + k * budget - taken - overlap (docs/accounting.md, the quota equation): k is what a "
    "launcher pod is charged per unit the mode counts (requests.cpu = vCPUs / ratio: k < 1), so in a scaled mode "
    "hard is in pod terms and differs from the budget by more than the pods and reservations"
)


@dataclass(frozen=True, slots=True)
class QuotaRow:
    cluster: str
    namespace: str
    name: str
    mode: str
    budget: dict[str, str]
    used: dict[str, str]
    pods: dict[str, str]
    reserved: dict[str, str]
    hard: dict[str, str]
    raised_for: list[str] = field(default_factory=list)
    vms: dict[str, int] = field(default_factory=dict)
    status: str = ""
    time: str = ""
    """When the usage it shows was published."""

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "namespace": self.namespace,
            "name": self.name,
            "mode": self.mode,
            "budget": self.budget,
            "used": self.used,
            "pods": self.pods,
            "reserved": self.reserved,
            "hard": self.hard,
            "raisedFor": self.raised_for,
            "vms": self.vms,
            "status": self.status,
            "time": self.time,
        }


def nonzero(rl: Mapping[str, str]) -> bool:
    """A wire resource list that holds something (a migration that reserves, a quota with reservations)."""
    return any(v not in ("", "0") for v in rl.values())


def names_list(names: Sequence[str], most: int = 5) -> str:
    """``a, b, c`` — at most ``most`` names, then ``and N more``: names come from tenants' objects, and a line
    that lists them must stay short whatever a tenant creates."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def quota_rows(usage: Iterable[UsageSnapshot], decisions: Iterable[Decision] = ()) -> list[QuotaRow]:
    """One row per managed quota of each namespace's latest usage snapshot; ``hard`` is what the enforcer last
    wrote (its latest non-dry-run decision for the quota), else what the ledger's equation gives. Sorted by
    cluster, namespace, name."""
    written: dict[tuple[str, str, str], Decision] = {}
    for dec in decisions:
        if not dec.dry_run:
            written[(dec.cluster, dec.namespace, dec.quota)] = dec  # (in stream order: the latest wins)
    rows: list[QuotaRow] = []
    for u in usage:
        vms = {"running": 0, "admitted": 0, "refused": 0}
        for v in u.vms:
            if v.state in vms:
                vms[v.state] += 1
        raised = sorted({m.name for m in u.migrations if nonzero(m.reserved)})
        for name, t in sorted(u.quotas.items()):
            d = written.get((u.cluster, u.namespace, name))
            hard = dict(d.hard_after) if d is not None else dict(t.hard)
            rows.append(
                QuotaRow(
                    cluster=u.cluster,
                    namespace=u.namespace,
                    name=name,
                    mode=t.mode,
                    budget=dict(t.budget),
                    used=dict(t.used),
                    pods=dict(t.pods),
                    reserved=dict(t.reserved),
                    hard=hard,
                    raised_for=raised if nonzero(t.reserved) else [],
                    vms=dict(vms),
                    status=_status(u, t.over_budget, raised if nonzero(t.reserved) else [], vms),
                    time=u.time,
                )
            )
    rows.sort(key=lambda r: (r.cluster, r.namespace, r.name))
    return rows


def refused_quotas(errors: Iterable[str]) -> list[str]:
    """The lines of usage snapshots' ``errors`` that say a quota is not managed (the ledger's own, about a
    ResourceQuota: a tenant cannot make one, while its objects' lines may quote what it wrote), for a terminal."""
    prefix = f"{QUOTA_KIND} "
    return [printable(e) for e in errors if e.startswith(prefix) and ": not managed: " in e]


def refused_quota(errors: Iterable[str]) -> str | None:
    """The first of :func:`refused_quotas`."""
    return next(iter(refused_quotas(errors)), None)


def _status(u: UsageSnapshot, over: Sequence[str], raised: Sequence[str], vms: Mapping[str, int]) -> str:
    parts: list[str] = []
    if u.errors:
        parts.append(f"{error_count(u.errors)} error(s): {u.errors[0]}")
    if over:
        parts.append(f"over budget: {', '.join(over)}")
    if raised:
        parts.append(f"raised for {names_list(raised)}")
    if vms.get("refused"):
        parts.append(f"{vms['refused']} VM(s) refused")
    if vms.get("admitted"):
        parts.append(f"{vms['admitted']} VM(s) starting")
    return "; ".join(parts) or "ok"


def status_json(rows: Sequence[QuotaRow], **extra: Any) -> dict[str, Any]:
    return {**extra, "quotas": [r.to_json() for r in rows]}


def used_of_budget(used: Mapping[str, str], budget: Mapping[str, str]) -> str:
    """``limits.memory 49Gi/64Gi, requests.cpu 4/8``: readable, in budget order."""
    u, b = readable_list(used), readable_list(budget)
    return ", ".join(f"{r} {u.get(r, '0')}/{b[r]}" for r in b) or "-"


def status_table(rows: Sequence[QuotaRow], *, wide: bool = False, now: datetime | None = None) -> str:
    """Aligned columns, one row per quota; ``wide`` adds P, S and ``hard``; ``now`` adds the AGE of the usage each
    row shows. A footnote explains the scale factor when a scaled mode is shown. Every cell is :func:`printable`:
    names and states come from bus messages."""
    if not rows:
        return "no managed quotas found"
    head = ["CLUSTER", "NAMESPACE", "QUOTA", "MODE", "USED/BUDGET"]
    if wide:
        head += ["PODS", "RESERVED", "HARD"]
    head += ["VMS"]
    if now is not None:
        head += ["AGE"]
    head += ["STATUS"]
    table = [head]
    for r in rows:
        line = [r.cluster, r.namespace, r.name, r.mode, used_of_budget(r.used, r.budget)]
        if wide:
            line += [_items(r.pods), _items(r.reserved), _items(r.hard)]
        line += [f"{r.vms.get('running', 0)}/{r.vms.get('admitted', 0)}/{r.vms.get('refused', 0)}"]
        if now is not None:
            line += [age(r.time, now)]
        line += [r.status]
        table.append([printable(c) for c in line])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table)
    text += "\n(VMS: running/starting/refused)"
    if not wide:
        text += "\n(-o wide: what the pods are charged, what is reserved, and hard)"
    elif any(r.mode in VM_TERM_MODES for r in rows):  # (hard scaled by k; about the HARD column only beside it)
        text += f"\nNote: {SCALE_NOTE}."
    return text


def age(time: str, now: datetime) -> str:
    """How long before ``now`` the RFC 3339 ``time`` was, as kubectl shows an age (``45s``, ``12m``, ``5h``, ``3d``);
    ``-`` for a time that does not read (a time ahead of ``now``, from clocks apart, is ``0s``)."""
    t = parse_rfc3339(time)
    if t is None:
        return "-"
    seconds = max(0, int((now - t).total_seconds()))
    for unit, size, up_to in (("s", 1, 120), ("m", 60, 120 * 60), ("h", 3600, 48 * 3600)):
        if seconds < up_to:
            return f"{seconds // size}{unit}"
    return f"{seconds // 86400}d"


def _items(rl: Mapping[str, str]) -> str:
    return ", ".join(f"{r} {v}" for r, v in readable_list(rl).items()) or "-"
