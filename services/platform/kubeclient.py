"""Access to the Kubernetes API: the check that a process can reach it (a kubeconfig that is there, is YAML and names
its context, or the in-cluster service account) before anything connects, and the kubernetes-asyncio client.
The client is imported when a service runs, not when the command line builds its parser."""

from __future__ import annotations

import os
import ssl
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

from shared.errors import InvalidInput

if TYPE_CHECKING:  # the clients are imported when a service runs, not when the CLI builds its parser
    pass


# ---- Kubernetes and leader election -----------------------------------------------------------------------------


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def check_kube_access(kubeconfig: str | None) -> None:
    """Before anything connects: the kubeconfig is a readable kubeconfig whose current context exists, or, without
    one, this process runs in a pod with a service account. :class:`InvalidInput` says what to do."""
    flag = "--kubeconfig (VMQUOTA_KUBECONFIG)"
    if not kubeconfig:
        if not os.environ.get("KUBERNETES_SERVICE_HOST") or not os.path.exists(SERVICE_ACCOUNT_TOKEN):
            raise InvalidInput("not running in a Kubernetes pod (no service account): give a kubeconfig file", flag)
        return
    from services.platform.inputs import load_yaml, read_setting_file

    text = read_setting_file(os.path.expanduser(kubeconfig), flag, shown=kubeconfig, kind="a kubeconfig")
    try:
        doc = load_yaml(text)
    except InvalidInput as e:
        raise InvalidInput(f"{kubeconfig}: {e.message}", flag) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("clusters"), list):
        raise InvalidInput(f"{kubeconfig} is not a kubeconfig (no clusters list)", flag)
    contexts = {c.get("name") for c in doc.get("contexts") or [] if isinstance(c, dict)}
    current = doc.get("current-context")
    if not current or current not in contexts:
        have = ", ".join(sorted(str(c) for c in contexts)) or "none"
        raise InvalidInput(f"{kubeconfig}: current-context {current!r} is not among its contexts ({have})", flag)


async def kube_client(kubeconfig: str | None) -> Any:
    """A kubernetes-asyncio ``ApiClient`` from a kubeconfig file (``--kubeconfig``) or, without one, the in-cluster
    service account."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig

    cfg = client.Configuration()
    try:
        if kubeconfig:
            await kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            kconfig.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (kconfig.ConfigException, OSError, ValueError) as e:
        raise InvalidInput(f"cannot use it: {e}", "--kubeconfig (VMQUOTA_KUBECONFIG)") from None
    try:
        host = urllib.parse.urlsplit(cfg.host or "")
        usable = host.scheme in ("http", "https") and bool(host.hostname)
    except ValueError:
        usable = False
    if not usable:  # (else every request fails, retried forever)
        raise InvalidInput(
            f"cannot use it: its cluster's server {cfg.host or ''!r} is not an http(s) URL",
            "--kubeconfig (VMQUOTA_KUBECONFIG)",
        )
    if not cfg.proxy:
        cfg.proxy = env_proxy(cfg.host or "")
    try:  # (the TLS context is made here: a CA or client certificate that is not one fails now)
        api = client.ApiClient(configuration=cfg)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise InvalidInput(f"cannot use it: {e}", "--kubeconfig (VMQUOTA_KUBECONFIG)") from None
    _resolve_env_once(api)
    return api


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``/``HTTP_PROXY`` by scheme, either case), or
    None when there is none or ``NO_PROXY`` exempts the host: the standard library's reading of the variables, as
    aiohttp's. Unlike aiohttp per request, it reads no proxy credentials from ``~/.netrc`` (credentials go in the
    proxy URL)."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    return proxies.get(parts.scheme) or None


def _resolve_env_once(api: Any) -> None:
    """kubernetes-asyncio's HTTP session trusts the environment, so aiohttp reads the proxy variables and
    ``~/.netrc`` again on every request, each time in a worker thread: two thread hand-offs per API call, the
    enforcer's largest cost after the call itself. The proxy is resolved once instead (:func:`env_proxy`, into the
    configuration), and the session is replaced by one that does not look again. ``~/.netrc`` is not read: the
    client authenticates with the kubeconfig's or the service account's credentials."""
    import aiohttp

    rest = api.rest_client
    old: aiohttp.ClientSession = rest.pool_manager
    if not old.trust_env:
        return
    rest.pool_manager = aiohttp.ClientSession(
        connector=old.connector,
        trust_env=False,
        read_bufsize=2**21,  # as kubernetes-asyncio sets it: large objects in one watch line
    )
    old.detach()  # the connector now belongs to the new session
