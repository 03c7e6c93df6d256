"""TLS of the NATS component (deploy/components/nats/nats-server-tls.conf) against a real nats-server: the
services connect with ``tls://`` and ``--nats-ca``; a client that does not trust the CA, or will not use TLS, is
refused. The certificate is made here (the cluster gets it from the Secret vmquota-nats-tls)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import ssl
import sys
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest

from services.devtools.natsserver import NatsServer
from services.platform.bus import Bus, NatsOptions
from shared import contract
from tests.certs import write_certificates
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

COMPONENT = Path(__file__).resolve().parents[2] / "deploy" / "components" / "nats"
MOUNT = "/etc/nats/tls/"
"""Where the StatefulSet mounts the Secret vmquota-nats-tls (the TLS configuration's paths)."""
USERS = ("watcher", "ledger", "enforcer", "subscriber", "replay", "listener")


@dataclass
class TlsServer:
    url: str
    ca: Path
    passwords: dict[str, str]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsServer]:
    """nats-server with the component's TLS configuration, as the StatefulSet runs it (its ConfigMap's files side by
    side), the certificate paths pointed at a temporary directory instead of the Secret's mount."""
    certs = tmp_path / "tls"
    certs.mkdir()
    write_certificates(certs)
    conf = tmp_path / "conf"
    conf.mkdir()
    shutil.copy(COMPONENT / "nats-server.conf", conf / "nats-server.conf")
    text = (COMPONENT / "nats-server-tls.conf").read_text()
    assert MOUNT in text
    (conf / "nats-server-tls.conf").write_text(text.replace(MOUNT, f"{certs}/"))
    passwords = {u: secrets.token_hex(16) for u in USERS}
    env = {f"VMQUOTA_NATS_{u.upper()}_PASSWORD": pw for u, pw in passwords.items()}
    server = NatsServer(tmp_path, config_file=conf / "nats-server-tls.conf", env=env)
    try:
        server.start()
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield TlsServer(server.url.replace("nats://", "tls://"), certs / "ca.crt", passwords)
    finally:
        server.stop()


async def test_services_connect_with_tls_and_the_ca(tls_server: TlsServer) -> None:
    def options(user: str) -> NatsOptions:
        return NatsOptions(url=tls_server.url, user=user, password=tls_server.passwords[user], ca=str(tls_server.ca))

    keeper = await Bus.connect(options("ledger"), connect_timeout=5)
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=contract.StreamSizes(*(16 * 2**20,) * 6)))
    finally:
        await keeper.close()
    b = await Bus.connect(options("watcher"), connect_timeout=5)
    try:
        await b.wait_for_streams(contract.STREAMS_USED["watcher"])
        ack = await b.publish("vmquota.ev.c1.ns.pod", b"{}")
        assert ack.stream == contract.EVENTS_STREAM
        assert b.nc.connected_url is not None and b.nc.connected_url.scheme == "tls"
    finally:
        await b.close()


async def test_a_client_without_the_ca_or_without_tls_is_refused(tls_server: TlsServer) -> None:
    password = tls_server.passwords["watcher"]
    with pytest.raises((ssl.SSLCertVerificationError, nats.errors.NoServersError, OSError)):
        await nats.connect(tls_server.url, user="watcher", password=password, allow_reconnect=False)
    plain = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts nothing
    with pytest.raises((ssl.SSLError, nats.errors.NoServersError, OSError)):
        await nats.connect(tls_server.url, user="watcher", password=password, tls=plain, allow_reconnect=False)
    assert "tls" in (COMPONENT / "nats-server-tls.conf").read_text()


@pytest.mark.parametrize("how", ["flag", "environment"])
async def test_the_operator_commands_trust_the_bus_by_its_ca(tls_server: TlsServer, how: str) -> None:
    """``vmquota status`` (as ``tail``, ``replay`` and ``explain``) reads the component's TLS bus with ``--nats-ca``
    or ``VMQUOTA_NATS_CA``, as the services do; before, they had neither, and failed to verify its certificate."""
    keeper = await Bus.connect(
        NatsOptions(url=tls_server.url, user="ledger", password=tls_server.passwords["ledger"], ca=str(tls_server.ca)),
        connect_timeout=5,
    )
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=contract.StreamSizes(*(16 * 2**20,) * 6)))
    finally:
        await keeper.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMQUOTA_")}
    args = [sys.executable, "-m", "services.cli.main", "status", "--nats", tls_server.url, "--nats-user", "replay"]
    args += ["--nats-password", tls_server.passwords["replay"]]
    if how == "flag":
        args += ["--nats-ca", str(tls_server.ca)]
    else:
        env["VMQUOTA_NATS_CA"] = str(tls_server.ca)
    done = await asyncio.create_subprocess_exec(
        *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(done.communicate(), 60)
    assert done.returncode == 0 and not err.strip(), (done.returncode, err.decode())
    assert b"no managed quota" in out, out


class _Recorder:
    """A TCP relay in front of a real nats-server without TLS, keeping what the client sent: a server that does not
    offer TLS, or anyone between the client and the server that takes the offer out of its first ``INFO``."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("nats://").rpartition(":")
        self.upstream = (host, int(port))
        self.sent = bytearray()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tls://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bool) -> None:
            while data := await src.read(65536):
                if keep:
                    self.sent += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False), return_exceptions=True)


async def test_a_tls_url_served_without_tls_is_sent_no_credentials(nats_url: str) -> None:
    """A ``tls://`` URL whose server does not offer TLS: nats-py upgrades only when the server's first ``INFO`` asks
    for it, and sent its ``CONNECT``, the password in it, in the clear. The services' client and the operator
    commands' refuse such a server before sending anything."""
    recorder = _Recorder(nats_url)
    async with recorder as url:
        with pytest.raises(nats.errors.NoServersError):
            await Bus.connect(NatsOptions(url=url, user="ledger", password="s3cret-ledger"), connect_timeout=0.5)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VMQUOTA_")}
        args = [sys.executable, "-m", "services.cli.main", "status", "--nats", url, "--nats-user", "replay"]
        done = await asyncio.create_subprocess_exec(
            *args,
            "--nats-password",
            "s3cret-replay",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(done.communicate(), 60)
        assert done.returncode == 1 and "did not offer TLS" in err.decode(), err.decode()
        assert len(err.decode().strip().splitlines()) == 1, err.decode()
    assert recorder.sent == b"", bytes(recorder.sent)


@pytest.mark.parametrize(
    "mistake", ["a CA that did not sign the server's certificate", "a password the server refuses"]
)
async def test_a_service_says_why_its_first_connection_fails(
    tls_server: TlsServer, tmp_path: Path, mistake: str
) -> None:
    """A service pointed at a server whose certificate its CA does not verify (a wrong ``ca.crt`` in the Secret, a
    certificate whose names miss the address dialled) hung in its first connection forever, not one line logged:
    nats-py reports the failed handshake and never returns. And a refused password was logged as a server not
    reachable. Each try now ends, and says why."""
    from structlog.testing import capture_logs

    if mistake.startswith("a CA"):
        other = tmp_path / "other"
        other.mkdir()
        write_certificates(other)
        opts = NatsOptions(
            url=tls_server.url, ca=str(other / "ca.crt"), user="ledger", password=tls_server.passwords["ledger"]
        )
        event, cause = "nats not reachable, retrying", "CERTIFICATE_VERIFY_FAILED"
    else:
        opts = NatsOptions(url=tls_server.url, ca=str(tls_server.ca), user="ledger", password="not-the-password")
        event, cause = "nats refused the credentials, retrying", "Authorization Violation"
    with capture_logs() as logs:
        task = asyncio.create_task(Bus.connect(opts))

        def said() -> list[MutableMapping[str, Any]]:
            return [e for e in logs if e["event"] == event and cause in str(e.get("error"))]

        try:
            # (any try may say it: a first one that timed out on a loaded machine says only that)
            await wait_until(lambda: task.done() or bool(said()), within=60, what=f"{event} ({cause})")
            assert not task.done(), task.exception()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert said()
