"""TLS of the NATS component (deploy/components/nats/nats-server-tls.conf) against a real nats-server: the
services connect with ``tls://`` and ``--nats-ca``; a client that does not trust the CA, or will not use TLS, is
refused. The certificate is made here (the cluster gets it from the Secret vmquota-nats-tls)."""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import shutil
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.devtools.natsserver import NatsServer
from services.platform.bus import Bus, NatsOptions
from shared import contract

pytestmark = pytest.mark.integration

COMPONENT = Path(__file__).resolve().parents[2] / "deploy" / "components" / "nats"
MOUNT = "/etc/nats/tls/"
"""Where the StatefulSet mounts the Secret vmquota-nats-tls (the TLS configuration's paths)."""
USERS = ("watcher", "ledger", "enforcer", "subscriber", "replay")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def write_certificates(into: Path) -> None:
    """``ca.crt``, and ``tls.crt``/``tls.key`` for 127.0.0.1 signed by it: the keys of a cert-manager Secret."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("vmquota test CA"))
        .issuer_name(_name("vmquota test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("vmquota-nats"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (into / "ca.crt").write_bytes(ca.public_bytes(pem))
    (into / "tls.crt").write_bytes(cert.public_bytes(pem))
    (into / "tls.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


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
