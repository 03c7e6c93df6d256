"""What a service says when its first connection to NATS fails (``services.platform.bus``)."""

from __future__ import annotations

import nats.errors
import pytest

from services.platform.bus import _why_not_connected

REFUSED = "nats: 'Authorization Violation'"
TLS = "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate"


@pytest.mark.parametrize("after", ["nats: timeout", "nats: unexpected EOF", "[Errno 104] Connection reset by peer"])
@pytest.mark.parametrize("e", [nats.errors.NoServersError(), TimeoutError("no answer from the server")])
def test_a_refused_password_is_the_cause_whatever_the_next_try_reported(after: str, e: BaseException) -> None:
    """nats-py tries the server twice; the second try of a server that refused the password may end otherwise (a
    timeout on a loaded machine, a connection the server closed), and the line named that, as a server not reachable:
    the operator looked for a network fault."""
    event, why = _why_not_connected([REFUSED, after], [REFUSED], e)
    assert (event, why) == ("nats refused the credentials, retrying", REFUSED)


def test_a_certificate_that_did_not_verify_is_the_cause() -> None:
    event, why = _why_not_connected([TLS, "nats: timeout"], [TLS], TimeoutError("no answer from the server"))
    assert (event, why) == ("nats not reachable, retrying", TLS)


def test_without_a_decisive_error_the_last_reported_or_the_exception_is_the_cause() -> None:
    down = "[Errno 111] Connect call failed ('127.0.0.1', 4222)"
    assert _why_not_connected(["nats: timeout", down], [], nats.errors.NoServersError()) == (
        "nats not reachable, retrying",
        down,
    )
    assert _why_not_connected([], [], OSError("no route to host")) == (
        "nats not reachable, retrying",
        "no route to host",
    )
    assert _why_not_connected([], [], TimeoutError()) == ("nats not reachable, retrying", "TimeoutError")
