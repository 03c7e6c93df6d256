"""Where ``vmquota up`` and ``vmquota simulate`` may write their kubeconfig (``--kubeconfig-out``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from services.devtools.simcluster.kubeconfig import check_kubeconfig_out, write_kubeconfig
from shared.errors import InvalidInput


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "localhost"])
def test_a_kubeconfig_vmquota_wrote_may_be_written_again_whatever_its_host(tmp_path: Path, host: str) -> None:
    """``simulate --host ::1`` (or ``localhost``, or an address) writes its own address: the next run found that
    file "not a kubeconfig vmquota wrote" and refused to start."""
    out = write_kubeconfig(tmp_path / "kc", f"https://{host}:{_closed_port()}", "token")
    check_kubeconfig_out(out)
    check_kubeconfig_out(tmp_path / "new")


@pytest.mark.parametrize(
    "doc",
    [
        {"current-context": "prod", "clusters": [{"name": "prod", "cluster": {"server": "https://10.0.0.1:6443"}}]},
        {  # (named as vmquota names it, but with a user's client certificate: someone's own)
            "current-context": "simcluster",
            "clusters": [{"name": "simcluster", "cluster": {"server": "https://127.0.0.1:6443"}}],
            "users": [{"name": "simcluster", "user": {"client-key-data": "x", "client-certificate-data": "y"}}],
            "contexts": [{"name": "simcluster", "context": {"cluster": "simcluster", "user": "simcluster"}}],
        },
        "not a kubeconfig",
    ],
    ids=["another", "a-certificate", "text"],
)
def test_a_file_vmquota_did_not_write_is_never_overwritten(tmp_path: Path, doc: object) -> None:
    out = tmp_path / "config"
    out.write_text(yaml.safe_dump(doc))
    with pytest.raises(InvalidInput, match="is not a kubeconfig vmquota wrote"):
        check_kubeconfig_out(out)
    with pytest.raises(InvalidInput, match="does not exist"):
        check_kubeconfig_out(tmp_path / "missing" / "kc")


def test_the_kubeconfig_of_a_simulated_cluster_still_serving_is_not_written_over(tmp_path: Path) -> None:
    """A second `vmquota up` with the first's `--kubeconfig-out` wrote its own address over the running one's (its
    kubectl then reached the second, and nothing once that stopped)."""
    with socket.socket() as serving:
        serving.bind(("127.0.0.1", 0))
        serving.listen()
        server = f"https://127.0.0.1:{serving.getsockname()[1]}"
        out = write_kubeconfig(tmp_path / "kc", server, "token")
        with pytest.raises(InvalidInput, match=f"still serving at {server}"):
            check_kubeconfig_out(out)
    check_kubeconfig_out(out)  # (once it is gone, the file is written again)


def test_a_kubeconfig_whose_cluster_is_no_object_is_one_line(tmp_path: Path) -> None:
    """Named as vmquota names it, with its cluster a string: the check for a running simulated cluster raised an
    AttributeError (a traceback)."""
    out = tmp_path / "kc"
    doc = yaml.safe_load(write_kubeconfig(tmp_path / "kc", "https://127.0.0.1:1", "token").read_text())
    doc["clusters"][0]["cluster"] = "https://127.0.0.1:1"
    out.write_text(yaml.safe_dump(doc))
    check_kubeconfig_out(out)  # (no address to try: written over, as a kubeconfig vmquota wrote)


def test_a_name_other_than_localhost_is_not_looked_up(tmp_path: Path) -> None:
    """A kubeconfig vmquota wrote names an address (or ``localhost``): a name is not looked up, nor tried."""
    out = write_kubeconfig(tmp_path / "kc", "https://simulated.invalid:6443", "token")
    check_kubeconfig_out(out)
