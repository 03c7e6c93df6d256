"""A kubeconfig for clients of the simulated API server (kubectl, kubernetes-asyncio): one cluster, one user with
a bearer token, one context."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import yaml


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
