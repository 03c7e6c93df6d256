"""Resource lists: ``{resource name: Quantity}``, with the few operations accounting needs.

Functions return new dicts; inputs are never mutated. A resource that is absent counts as zero.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Final

from shared.errors import InvalidInput
from shared.quantity import MAX_NANOS, ZERO, Format, Quantity

ResourceList = dict[str, Quantity]

# Resource names whose natural display is binary (bytes).
_BYTE_SUFFIXES = ("memory", "ephemeral-storage", "storage")


def is_byte_resource(name: str) -> bool:
    base = name.split("/", 1)[0]
    return (
        base.endswith(_BYTE_SUFFIXES)
        or base.startswith(("hugepages-", "requests.hugepages-"))
        or ("/" in name and name.split("/", 1)[1].startswith("memory"))
    )


QUALIFIED_NAME_RE: Final = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
"""The name part of a qualified name (a label key's, a resource's), without its length bound (63)."""
DNS1123_SUBDOMAIN_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
"""An RFC 1123 subdomain, without its length bound (253)."""
DNS1123_LABEL_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
"""An RFC 1123 label, without its length bound (63)."""


def is_dns_subdomain(value: str) -> bool:
    """``validation.IsDNS1123Subdomain``: what most kinds' object names must be (a VM's, a quota's)."""
    return 0 < len(value) <= 253 and DNS1123_SUBDOMAIN_RE.match(value) is not None


def is_qualified_name(value: str) -> bool:
    """``validation.IsQualifiedName``: an optional DNS-1123 subdomain prefix and ``/``, then a name of at most 63
    characters of ``[-A-Za-z0-9_.]`` that starts and ends alphanumeric."""
    parts = value.split("/")
    if len(parts) == 2:
        prefix, name = parts
        if not prefix or len(prefix) > 253 or not DNS1123_SUBDOMAIN_RE.match(prefix):
            return False
    elif len(parts) == 1:
        name = parts[0]
    else:
        return False
    return 0 < len(name) <= 63 and QUALIFIED_NAME_RE.match(name) is not None


STANDARD_QUOTA_RESOURCES: Final = frozenset(
    {
        "cpu",
        "memory",
        "ephemeral-storage",
        "requests.cpu",
        "requests.memory",
        "requests.storage",
        "requests.ephemeral-storage",
        "limits.cpu",
        "limits.memory",
        "limits.ephemeral-storage",
        "pods",
        "resourcequotas",
        "services",
        "replicationcontrollers",
        "secrets",
        "persistentvolumeclaims",
        "configmaps",
        "services.nodeports",
        "services.loadbalancers",
    }
)
"""``helper.standardQuotaResources`` (Kubernetes 1.33): the names without a ``/`` a ResourceQuota may hold."""


def is_quota_resource_name(name: str) -> bool:
    """``ValidateResourceQuotaResourceName``: a qualified name; without a ``/``, a standard quota resource or a
    hugepages one (``hugepages-<size>``, ``requests.hugepages-<size>``). ``limits.memroy`` is not one."""
    if not is_qualified_name(name):
        return False
    if "/" in name:
        return True
    return name in STANDARD_QUOTA_RESOURCES or name.startswith(("hugepages-", "requests.hugepages-"))


def charged_alike(names: Iterable[str]) -> frozenset[str]:
    """``names`` with the names a quota charges the same amount under: a request and its bare name (``cpu`` and
    ``requests.cpu``, ``memory``, ``ephemeral-storage``, ``hugepages-<size>``), which a refusal may name either."""
    out: set[str] = set()
    for name in names:
        out.add(name)
        if name.startswith("requests."):
            out.add(name.removeprefix("requests."))
        elif not name.startswith("limits.") and "/" not in name:
            out.add(f"requests.{name}")
    return frozenset(out)


@functools.lru_cache(maxsize=1024)
def natural_format(name: str) -> Format:
    """The one form vmquota prints a resource's amounts in: binary units for byte resources, decimal for others
    (remembered per name: every sum's total asks it of every resource)."""
    return Format.BINARY_SI if is_byte_resource(name) else Format.DECIMAL_SI


def parse_resource_list(obj: object, where: str = "", *, allow_negative: bool = False) -> ResourceList:
    """Parse a JSON/YAML mapping of resource names to quantities; errors name the offending key."""
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"expected a map of resource names to quantities, got {type(obj).__name__}", where)
    out: ResourceList = {}
    for key, raw in obj.items():
        if not isinstance(key, str) or not key:
            raise InvalidInput(f"invalid resource name {key!r}", where)
        try:
            out[key] = Quantity.parse(raw, allow_negative=allow_negative)
        except InvalidInput as e:
            raise e.at(f"{where}.{key}" if where else key) from None
    return out


def format_resource_list(rl: Mapping[str, Quantity]) -> dict[str, str]:
    """Each amount in its own canonical form (the format it was written in), sorted by resource name: a pod's
    resources as Kubernetes would print them."""
    return {k: rl[k].canonical() for k in sorted(rl)}


def canonical_resource_list(rl: Mapping[str, Quantity]) -> dict[str, str]:
    """What vmquota publishes and writes (usage terms, decisions, ``spec.hard``): each amount in its resource's
    one form (:func:`natural_format`), whatever the formats of what was added up; sorted by resource name."""
    return {k: rl[k].with_format(natural_format(k)).canonical() for k in sorted(rl)}


def saturated(rl: Mapping[str, Quantity]) -> tuple[ResourceList, list[str]]:
    """``rl`` with every value beyond what Kubernetes can represent (an int64 of base units) cut to that limit,
    and the names cut. Sums over a namespace are exact past it; what goes on the wire must not be."""
    cut = [k for k, v in rl.items() if abs(v.nanos) > MAX_NANOS]
    if not cut:
        return dict(rl), []
    out = dict(rl)
    for k in cut:
        out[k] = Quantity(MAX_NANOS if rl[k].nanos > 0 else -MAX_NANOS, rl[k].format)
    return out, sorted(cut)


def add(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> ResourceList:
    out = dict(a)
    for k, v in b.items():
        cur = out.get(k)
        out[k] = v if cur is None else cur + v
    return out


def sub(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> ResourceList:
    """``a - b`` per resource over the union of keys (may go negative)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, ZERO) - v
    return out


def maximum(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> ResourceList:
    out = dict(a)
    for k, v in b.items():
        cur = out.get(k)
        if cur is None or v > cur:
            out[k] = v
    return out


def minimum(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> ResourceList:
    """``min(a[r], b[r])`` for every key of ``a`` (a key missing from ``b`` is zero there)."""
    out: ResourceList = {}
    for k, v in a.items():
        other = b.get(k, ZERO)
        out[k] = other if other < v else v
    return out


def second_largest(rls: Iterable[Mapping[str, Quantity]]) -> ResourceList:
    """The second largest value per resource over ``rls`` (zero entries dropped; nothing for fewer than two)."""
    top: ResourceList = {}
    second: ResourceList = {}
    for rl in rls:
        for k, v in rl.items():
            first = top.get(k)
            if first is None or v > first:
                if first is not None:
                    second[k] = first
                top[k] = v
            elif v > second.get(k, ZERO):
                second[k] = v
    return nonzero(second)


def positive_part(a: Mapping[str, Quantity]) -> ResourceList:
    """``max(a[r], 0)`` for every key."""
    return {k: v.clamp0() for k, v in a.items()}


def growth(target: Mapping[str, Quantity], source: Mapping[str, Quantity]) -> ResourceList:
    """``max(0, target - source)`` per resource of ``target`` (hotplug growth); zero entries are dropped."""
    out: ResourceList = {}
    for k, v in target.items():
        d = v - source.get(k, ZERO)
        if d.nanos > 0:
            out[k] = d
    return out


def fits(request: Mapping[str, Quantity], used: Mapping[str, Quantity], hard: Mapping[str, Quantity]) -> list[str]:
    """Resources of ``hard`` that ``used + request`` would exceed (empty: it fits)."""
    return [r for r, limit in hard.items() if r in request and used.get(r, ZERO) + request[r] > limit]


def only(rl: Mapping[str, Quantity], names: Iterable[str]) -> ResourceList:
    keep = set(names)
    return {k: v for k, v in rl.items() if k in keep}


def nonzero(rl: Mapping[str, Quantity]) -> ResourceList:
    return {k: v for k, v in rl.items() if v.nanos != 0}


def equal(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> bool:
    """Equal as resource lists: a missing key equals zero."""
    return all(a.get(k, ZERO) == b.get(k, ZERO) for k in set(a) | set(b))
