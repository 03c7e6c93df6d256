"""A kubeconfig for clients of the simulated API server (kubectl, kubernetes-asyncio): one cluster, one user with
a bearer token, one context."""

from __future__ import annotations

import base64
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from shared.errors import InvalidInput


def kubeconfig(
    server: str, token: str, *, ca_pem: bytes | None = None, name: str = "simcluster", namespace: str | None = None
) -> dict[str, Any]:
    """The kubeconfig document for ``server`` (``https://127.0.0.1:PORT``), ``token`` and the server's certificate
    authority ``ca_pem`` (for HTTPS)."""
    cluster: dict[str, Any] = {"server": server}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    context: dict[str, Any] = {"cluster": name, "user": name}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": context}],
        "current-context": name,
        "preferences": {},
    }


def write_kubeconfig(
    path: str | os.PathLike[str],
    server: str,
    token: str,
    *,
    ca_pem: bytes | None = None,
    name: str = "simcluster",
    namespace: str | None = None,
) -> Path:
    """Write the kubeconfig (mode 0600: it holds the token) and return its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(kubeconfig(server, token, ca_pem=ca_pem, name=name, namespace=namespace), sort_keys=False)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    return out


def check_kubeconfig_out(out: Path, flag: str = "--kubeconfig-out") -> None:
    """Refuse to write a kubeconfig where the folder does not exist, or over a file that is not a kubeconfig an
    earlier ``vmquota up`` or ``vmquota simulate`` wrote: ``--kubeconfig-out ~/.kube/config`` must not cost anyone
    their credentials."""
    from services.platform.inputs import load_yaml, read_setting_file

    if not out.parent.is_dir():
        raise InvalidInput(f"the folder {str(out.parent)!r} does not exist", flag)
    if not out.exists():
        return
    try:
        existing = load_yaml(read_setting_file(str(out), flag))
    except InvalidInput:
        existing = None
    if not _ours(existing):
        raise InvalidInput(
            f"{str(out)!r} exists and is not a kubeconfig vmquota wrote: remove it or choose another path", flag
        )
    server = _server(existing)
    if server is not None and _answers(server):  # (written over, the running one's kubectl would reach this one)
        raise InvalidInput(
            f"{str(out)!r} is the kubeconfig of a simulated cluster still serving at {server} (another vmquota up "
            "or simulate): stop it or choose another path",
            flag,
        )


def _ours(doc: object) -> bool:
    """Whether ``doc`` is a kubeconfig as :func:`kubeconfig` writes it: one cluster, one user (with a token and
    nothing else) and one context, all named ``simcluster``, whatever the server's address (``--host``)."""
    if not isinstance(doc, dict) or doc.get("current-context") != "simcluster":
        return False
    named = [doc.get(k) for k in ("clusters", "users", "contexts")]
    if not all(isinstance(items, list) and len(items) == 1 and isinstance(items[0], dict) for items in named):
        return False
    cluster, user, context = (items[0] for items in named)  # type: ignore[index]
    return (
        all(item.get("name") == "simcluster" for item in (cluster, user, context))
        and isinstance(user.get("user"), dict)
        and set(user["user"]) == {"token"}
    )


def _server(doc: Any) -> str | None:
    """The server address of a kubeconfig :func:`_ours` accepted."""
    cluster = doc["clusters"][0].get("cluster")
    server = cluster.get("server") if isinstance(cluster, dict) else None
    return server if isinstance(server, str) else None


def _answers(server: str) -> bool:
    """Whether something accepts connections at ``server``'s host and port, where that is an address, or
    ``localhost`` (a simulated cluster's kubeconfig names the address it serves at, the loopback one for ``0.0.0.0``
    and ``::``): no other name is looked up."""
    url = urlsplit(server)
    try:
        port = url.port
        if url.hostname != "localhost":
            ipaddress.ip_address(url.hostname or "")
    except ValueError:
        return False
    if port is None:
        return False
    try:
        with socket.create_connection((url.hostname, port), timeout=0.5):
            return True
    except OSError:
        return False
