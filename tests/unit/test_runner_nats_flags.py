"""The NATS settings of ``vmquota run``: the CA for TLS, the consumer check period and the stream sizes, from flags
and environment variables, validated at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.platform import identity, runner
from services.platform.config import Config, config_from_args
from services.platform.http import Health, Metrics
from shared import contract
from shared.errors import InvalidInput
from tests.certs import write_certificates

CREDS = """-----BEGIN NATS USER JWT-----
eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.c2ln
------END NATS USER JWT------

-----BEGIN USER NKEY SEED-----
SUAEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLE
------END USER NKEY SEED------
"""
"""The shape of a ``.creds`` file as ``nsc`` writes it (not a working identity)."""


def config(*args: str) -> Config:
    return config_from_args(build_parser().parse_args(["run", "ledger", *args]))


def test_defaults_are_the_contracts() -> None:
    c = config()
    assert c.nats.stream_sizes == contract.StreamSizes()
    assert c.nats.consumer_check == 30.0 and c.nats.ca is None


def test_sizes_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMQUOTA_CHECKPOINTS_MAX_BYTES", "256Mi")
    c = config("--events-max-bytes", "2Gi", "--dlq-max-bytes", "100M")
    assert c.nats.stream_sizes is not None
    assert c.nats.stream_sizes.events == 2 * 2**30
    assert c.nats.stream_sizes.dlq == 100 * 10**6
    assert c.nats.stream_sizes.checkpoints == 256 * 2**20
    assert c.nats.stream_sizes.usage == contract.StreamSizes().usage
    largest = config("--events-max-bytes", str(2**63 - 1)).nats.stream_sizes
    assert largest is not None and largest.events == 2**63 - 1


@pytest.mark.parametrize(
    "bad", ["lots", "1.5Gi", "-1", "100", "4Gb", "99999999Ti", str(2**63), "9" * 5000, "8388608Ti"]
)
def test_bad_sizes_name_the_flag(bad: str) -> None:
    """Past an int64 of bytes too: JetStream refused the stream as the ledger made it, which exited with a stack
    trace naming no flag."""
    with pytest.raises(InvalidInput) as e:
        config("--events-max-bytes", bad)
    assert e.value.where == "--events-max-bytes"


def test_consumer_check_and_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_certificates(tmp_path)
    ca = tmp_path / "ca.crt"
    monkeypatch.setenv("VMQUOTA_NATS_CA", str(ca))
    c = config("--nats-consumer-check", "1m")
    assert c.nats.consumer_check == 60.0 and c.nats.ca == str(ca)
    rt = runner.Runtime(name="ledger", config=c, metrics=Metrics(), health=Health())
    opts = rt.nats_options()
    assert (opts.ca, opts.consumer_check, opts.stream_sizes, opts.name) == (
        str(ca),
        60.0,
        c.nats.stream_sizes,
        "vmquota-ledger",
    )
    with pytest.raises(InvalidInput, match="positive"):
        config("--nats-consumer-check", "0")


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "two words", "ünï"])
def test_a_user_name_that_cannot_name_its_inbox_is_refused_at_start(bad: str) -> None:
    """A connection's replies come to ``_INBOX.<user>`` (the server lets each user hear its own inbox only): a user
    name that is not one subject token is refused at start, naming the flag."""
    with pytest.raises(InvalidInput, match="names its inbox") as e:
        config("--nats-user", bad)
    assert e.value.where == "--nats-user (VMQUOTA_NATS_USER)"
    assert config("--nats-user", "watcher-cluster-a").nats.user == "watcher-cluster-a"


def test_message_ids_carry_a_tag_only_the_identitys_secret_gives(tmp_path: Path) -> None:
    """The same id and secret give the same tagged id (a replica's or a restart's repeat is still dropped); another
    secret gives another; no secret (a bus without authentication) leaves the id as it is."""
    key = identity.id_key(password="pw-of-b", creds=None)
    mid = "cluster-b/VirtualMachineInstance/u1/7/upserted"
    tagged = identity.keyed(mid, key)
    assert tagged.startswith(mid + "/") and len(tagged) == len(mid) + 17
    assert tagged == identity.keyed(mid, identity.id_key(password="pw-of-b", creds=None))
    assert tagged != identity.keyed(mid, identity.id_key(password="pw-of-a", creds=None))
    assert tagged != identity.keyed(mid.replace("/7/", "/8/"), key)
    assert identity.keyed(mid, identity.id_key(password=None, creds=None)) == mid
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\nx\n")
    assert identity.keyed(mid, identity.id_key(password=None, creds=str(creds))) not in (mid, tagged)
    assert (identity.inbox_prefix("ledger"), identity.inbox_prefix(None)) == ("_INBOX.ledger", "_INBOX")


def test_an_inbox_prefix_can_be_given_for_a_creds_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``.creds`` identity has no user name to name its inbox by: its operator gives the prefix its JWT allows."""
    monkeypatch.setenv("VMQUOTA_NATS_INBOX_PREFIX", "_INBOX.ledger-jwt")
    creds = tmp_path / "ledger.creds"
    creds.write_text(CREDS)
    c = config("--nats-creds", str(creds))
    assert c.nats.inbox_prefix == "_INBOX.ledger-jwt"
    assert identity.inbox_prefix(c.nats.user, c.nats.inbox_prefix) == "_INBOX.ledger-jwt"
    assert identity.inbox_prefix(None, None) == "_INBOX" and identity.inbox_prefix("ledger", None) == "_INBOX.ledger"
    for bad in ("_INBOX.>", "_INBOX.*", "_INBOX..x", "a b"):
        with pytest.raises(InvalidInput, match="inbox prefix") as e:
            config("--nats-inbox-prefix", bad)
        assert e.value.where == "--nats-inbox-prefix (VMQUOTA_NATS_INBOX_PREFIX)"


def test_the_bus_options_are_checked_before_anything_connects(tmp_path: Path) -> None:
    """A NATS URL, a credentials file and a CA bundle that cannot be what they say are one line naming the flag at
    start: before, a bad URL or CA crashed the service once it tried to connect (a JSON dump of the exception), and
    a missing credentials file made it wait for a bus that was there."""
    write_certificates(tmp_path)
    junk = tmp_path / "junk"
    junk.write_text("just: text\n")
    cases = [
        (("--nats", "notaurl::"), "--nats (VMQUOTA_NATS)", "is not a NATS URL"),
        (("--nats", "http://nats:4222"), "--nats (VMQUOTA_NATS)", "is not a NATS URL"),
        (("--nats", " , "), "--nats (VMQUOTA_NATS)", "names no server"),
        (("--nats-ca", str(tmp_path / "none")), "--nats-ca (VMQUOTA_NATS_CA)", "no such file"),
        (("--nats-ca", str(junk)), "--nats-ca (VMQUOTA_NATS_CA)", "is not a PEM CA bundle"),
        (("--nats-ca", str(tmp_path)), "--nats-ca (VMQUOTA_NATS_CA)", "is a directory"),
        (("--nats-creds", str(junk)), "--nats-creds (VMQUOTA_NATS_CREDS)", "is not a NATS credentials file"),
        (("--log-level", "chatty"), "--log-level (VMQUOTA_LOG_LEVEL)", "is not a log level"),
        (("--events-max-age", "1e400"), "--events-max-age", "longer than 100 years"),
    ]
    for args, where, what in cases:
        with pytest.raises(InvalidInput, match=what) as e:
            config(*args)
        assert e.value.where == where, (args, e.value)
    good = config(
        "--nats", "tls://a:4222, b:4222,nats://c", "--nats-ca", str(tmp_path / "ca.crt"), "--log-level", "DEBUG"
    )
    assert good.nats.servers == ["tls://a:4222", "b:4222", "nats://c"]
    for level in ("warn", "WARNING", "critical", "error", "debug"):  # (the names the logging module knows)
        assert config("--log-level", level).log_level == level


@pytest.mark.parametrize("bad", ["", "Bad NS", "x-", "a" * 64])
def test_a_lease_namespace_that_is_no_namespace_name_is_refused_at_start(bad: str) -> None:
    """Accepted, it had the watcher and the enforcer run unready for ever, their Lease never taken."""
    args = build_parser().parse_args(["run", "watcher", "--cluster", "c1", "--lease-namespace", bad])
    with pytest.raises(InvalidInput) as e:
        config_from_args(args)
    assert e.value.where == "--lease-namespace (VMQUOTA_LEASE_NAMESPACE)"
    unused = ["run", "watcher", "--cluster", "c1", "--no-leader-election", "--lease-namespace", bad]
    assert config_from_args(build_parser().parse_args(unused)).lease_namespace == bad
    assert config("--lease-namespace", bad).lease_namespace == bad  # (the ledger takes no Lease)
