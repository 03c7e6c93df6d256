"""The Kubernetes client the services build: proxy taken from the environment once, not looked up per request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.platform.kube import MAX_DEPTH, decode_json, shallow
from services.platform.kubeclient import env_proxy, kube_client
from shared.errors import InvalidInput

KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://api.example.test:6443", insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: not-a-secret}
contexts:
- name: c
  context: {cluster: c, user: u}
current-context: c
"""

PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_env_proxy_by_scheme(clean_env: pytest.MonkeyPatch) -> None:
    assert env_proxy("https://api.example.test:6443") is None
    clean_env.setenv("HTTPS_PROXY", "http://proxy.example.test:3128")
    assert env_proxy("https://api.example.test:6443") == "http://proxy.example.test:3128"
    assert env_proxy("http://api.example.test:8080") is None  # only HTTPS_PROXY is set


def test_env_proxy_no_proxy(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("https_proxy", "http://proxy.example.test:3128")
    clean_env.setenv("no_proxy", "localhost,.example.test")
    assert env_proxy("https://api.example.test:6443") is None
    assert env_proxy("https://api.other.test:6443") == "http://proxy.example.test:3128"


async def test_client_resolves_the_proxy_once(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    clean_env.setenv("HTTPS_PROXY", "http://proxy.example.test:3128")
    api = await kube_client(str(path))
    try:
        rest = api.rest_client
        assert rest.proxy == "http://proxy.example.test:3128"
        session = rest.pool_manager
        assert session.trust_env is False  # no per-request look-up of the environment or ~/.netrc
        assert session.connector is not None and not session.closed
    finally:
        await api.close()


async def test_client_without_proxy(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    clean_env.setenv("NO_PROXY", "api.example.test")
    clean_env.setenv("HTTPS_PROXY", "http://proxy.example.test:3128")
    api = await kube_client(str(path))
    try:
        assert api.rest_client.proxy is None
        assert api.rest_client.pool_manager.trust_env is False
    finally:
        await api.close()


@pytest.mark.parametrize(
    ("cluster", "phrase"),
    [
        ('{server: "https://api.example.test:6443", certificate-authority-data: bm90IGEgY2VydA==}', "cannot use it: "),
        ("{insecure-skip-tls-verify: true}", "is not an http(s) URL"),
        ('{server: "ht!tp://::bad", insecure-skip-tls-verify: true}', "is not an http(s) URL"),
    ],
    ids=["ca-not-a-certificate", "no-server", "not-a-url"],
)
async def test_an_unusable_kubeconfig_is_one_line_naming_the_flag(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, cluster: str, phrase: str
) -> None:
    """A kubeconfig whose CA data is not a certificate ended the watcher with an SSL traceback; one with no server,
    or one that is not a URL, had every request fail, retried forever."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        KUBECONFIG.replace('{server: "https://api.example.test:6443", insecure-skip-tls-verify: true}', cluster)
    )
    with pytest.raises(InvalidInput) as e:
        await kube_client(str(path))
    assert e.value.where == "--kubeconfig (VMQUOTA_KUBECONFIG)" and phrase in e.value.message, e.value


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}\u00e9 ', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"\\[]{', max_size=3), inner, max_size=3)
    ),
    max_leaves=25,
)


def _pruned(value: Any, depth: int, level: int = 0) -> Any:
    """What :func:`shallow` must make of ``value``: every array and object deeper than ``depth`` as None."""
    if isinstance(value, (list, dict)):
        if level >= depth:
            return None
        if isinstance(value, list):
            return [_pruned(v, depth, level + 1) for v in value]
        return {k: _pruned(v, depth, level + 1) for k, v in value.items()}
    return value


@settings(max_examples=400, deadline=None)
@given(value=_JSON, depth=st.integers(0, 4))
def test_shallow_replaces_what_is_nested_deeper_than_the_depth_and_keeps_the_rest(value: Any, depth: int) -> None:
    """Strings with brackets, quotes and escapes in them, at any depth, are kept as they are."""
    data = msgspec.json.encode(value)
    assert msgspec.json.decode(shallow(data, depth)) == _pruned(value, depth)


def test_a_document_nested_deeper_than_the_decoder_goes_is_read_with_its_deep_parts_as_null() -> None:
    """msgspec raises RecursionError (not DecodeError) past Python's recursion limit, which a tenant's VMI reaches
    through a field KubeVirt keeps unknown (``spec.domain.clock``): the watcher stopped, at every start."""
    body = (
        b'{"kind":"VirtualMachineInstance","metadata":{"name":"vm\\"1"},"spec":{"domain":{"clock":'
        + (b'{"x":' * 5000 + b"1" + b"}" * 5000)
        + b"}}}"
    )
    with pytest.raises(RecursionError):
        msgspec.json.decode(body)
    doc = decode_json(body)
    assert doc["metadata"] == {"name": 'vm"1'} and doc["kind"] == "VirtualMachineInstance"
    clock = doc["spec"]["domain"]["clock"]
    for _ in range(MAX_DEPTH - 4):  # (the clock is the document's fourth level)
        clock = clock["x"]
    assert clock == {"x": None}
