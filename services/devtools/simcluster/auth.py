"""Who is asking: identities for the simulated API server and its own controllers, and what a tenant may do.

Every request the server takes runs as the user its bearer token names; the simulator's controllers (KubeVirt's
virt-controller, the quota controller, the garbage collector) act as their own service accounts. The identity of
the current call travels in a context variable (:func:`acting_as`, :func:`current_user`), so admission — the
ValidatingAdmissionPolicy evaluation in :mod:`services.devtools.simcluster.policy` — sees ``request.userInfo`` as a real
API server fills it.

Authorization is deliberately small: the cluster administrator (the token every kubeconfig of the simulator holds
by default) may do anything; a *tenant* (:meth:`Users.add_tenant`) has what Kubernetes' aggregated ``edit`` role
plus KubeVirt's ``kubevirt.io:edit`` give in its own namespaces — and the power to create Events, as the
threat model assumes — and nothing else: no ``status`` subresource of any object, no ResourceQuota writes, no
``vmquota.io`` objects, nothing outside its namespaces, nothing cluster-scoped. A refusal is the API server's 403
with its message (``pods is forbidden: User "alice" cannot create resource "pods" in API group "" in the
namespace "t1"``).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Final

from services.devtools.simcluster.store_api import ApiError, Resource


@dataclass(frozen=True, slots=True)
class UserInfo:
    """``request.userInfo`` of an API request."""

    username: str
    groups: tuple[str, ...] = ("system:authenticated",)
    uid: str = ""
    tenant_of: frozenset[str] | None = None
    """The namespaces a tenant may write in; None for an identity authorization does not restrict."""

    def as_request(self) -> dict[str, object]:
        return {"username": self.username, "uid": self.uid, "groups": list(self.groups)}


ADMIN: Final = UserInfo("kubernetes-admin", ("system:masters", "system:authenticated"))
KUBEVIRT_CONTROLLER: Final = UserInfo(
    "system:serviceaccount:kubevirt:kubevirt-controller",
    ("system:serviceaccounts", "system:serviceaccounts:kubevirt", "system:authenticated"),
)
"""The identity KubeVirt's virt-controller creates launcher and migration target pods with."""
CONTROLLER_MANAGER: Final = UserInfo("system:kube-controller-manager", ("system:authenticated",))
GARBAGE_COLLECTOR: Final = UserInfo(
    "system:serviceaccount:kube-system:generic-garbage-collector",
    ("system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"),
)
"""kube-controller-manager's garbage collector (with ``--use-service-account-credentials``): it takes an orphaned
owner's references off its dependents."""

_CURRENT: ContextVar[UserInfo] = ContextVar("simcluster_user", default=CONTROLLER_MANAGER)


def current_user() -> UserInfo:
    """Who the current call runs as (in-process callers that set nobody are the controller manager)."""
    return _CURRENT.get()


@contextlib.contextmanager
def acting_as(user: UserInfo) -> Iterator[None]:
    """Run the calls inside as ``user`` (tasks started inside inherit it)."""
    token = _CURRENT.set(user)
    try:
        yield
    finally:
        _CURRENT.reset(token)


_TENANT_WRITES: Final = frozenset(
    {
        ("", "pods"),
        ("", "events"),
        ("", "configmaps"),
        ("", "secrets"),
        ("", "services"),
        ("", "persistentvolumeclaims"),
        ("events.k8s.io", "events"),
        ("kubevirt.io", "virtualmachines"),
        ("kubevirt.io", "virtualmachineinstances"),
        ("kubevirt.io", "virtualmachineinstancemigrations"),
    }
)
_TENANT_READS: Final = frozenset({("", "resourcequotas"), ("", "limitranges")})
_READ_VERBS: Final = frozenset({"get", "list", "watch"})


_TENANT_SUBRESOURCES: Final = frozenset({(("", "pods"), "resize")})
"""Subresources a tenant may write: resizing its own pods in place (``pods/resize``, Kubernetes 1.33+), which
quota admission charges like a create."""


def authorize(user: UserInfo, verb: str, res: Resource, namespace: str | None, subresource: str | None) -> None:
    """Raise the API server's 403 when ``user`` may not ``verb`` the (sub)resource in ``namespace``."""
    if user.tenant_of is None:
        return
    gr = (res.group, res.plural)
    allowed = (
        namespace is not None
        and namespace in user.tenant_of
        and (subresource is None or (gr, subresource) in _TENANT_SUBRESOURCES)
        and (gr in _TENANT_WRITES or (gr in _TENANT_READS and verb in _READ_VERBS))
    )
    if allowed:
        return
    what = f"{res.plural}/{subresource}" if subresource else res.plural
    where = f' in the namespace "{namespace}"' if namespace is not None else " at the cluster scope"
    raise ApiError(
        403,
        "Forbidden",
        f'{what} is forbidden: User "{user.username}" cannot {verb} resource "{what}" in API group '
        f'"{res.group}"{where}',
        {"group": res.group, "kind": res.plural},
    )


@dataclass
class Users:
    """The server's bearer tokens and the identity each one names."""

    admin_token: str
    _by_token: dict[str, UserInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_token.setdefault(self.admin_token, ADMIN)

    def add(self, user: UserInfo, token: str | None = None) -> str:
        """Accept ``token`` (a fresh one by default) as ``user``; returns the token."""
        token = token or secrets.token_urlsafe(24)
        self._by_token[token] = user
        return token

    def add_tenant(self, name: str, namespaces: Iterable[str], token: str | None = None) -> str:
        """A tenant user who may edit its ``namespaces`` (see the module documentation); returns its token."""
        user = UserInfo(name, ("tenants", "system:authenticated"), tenant_of=frozenset(namespaces))
        return self.add(user, token)

    def authenticate(self, authorization: str | None) -> UserInfo:
        """The user of an ``Authorization: Bearer <token>`` header; 401 when it names nobody."""
        if authorization is not None and authorization.startswith("Bearer "):
            user = self._by_token.get(authorization[len("Bearer ") :])
            if user is not None:
                return user
        raise ApiError(401, "Unauthorized", "Unauthorized")
