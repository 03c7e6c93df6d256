"""``services.platform.bus.position``: a JetStream message's sequences read from its reply subject, as nats-py's
``msg.metadata`` reads them, for both forms of the subject."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from services.platform.bus import Position, position

_SEQ = st.integers(0, 2**63 - 1)
_TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEF0123456789_-", min_size=1, max_size=12)


def _msg(reply: str) -> Msg:
    return Msg(_client=None, subject="vmquota.ev.c1.a.pod", reply=reply, data=b"{}")  # type: ignore[arg-type]


@given(_TOKEN, _TOKEN, _SEQ, _SEQ, _SEQ, _SEQ, _SEQ, st.booleans(), _TOKEN, _TOKEN, st.booleans())
def test_position_is_what_the_metadata_says(
    stream: str,
    consumer: str,
    delivered: int,
    sseq: int,
    cseq: int,
    pending: int,
    ts: int,
    with_domain: bool,
    domain: str,
    account: str,
    with_token: bool,
) -> None:
    tail = f"{stream}.{consumer}.{delivered}.{sseq}.{cseq}.{ts}.{pending}"
    reply = f"$JS.ACK.{domain}.{account}.{tail}" + (".x1y2" if with_token else "") if with_domain else f"$JS.ACK.{tail}"
    md = _msg(reply).metadata
    got = position(_msg(reply))
    assert got[:3] == (md.sequence.stream, md.sequence.consumer, md.num_pending) == (sseq, cseq, pending)
    assert got.time_ns == ts
    assert abs(md.timestamp.timestamp() - ts / 1e9) <= max(1e-6, ts / 1e9 * 1e-15)  # (what nats-py makes of it)


def test_a_message_read_again_is_read_once_and_others_afresh() -> None:
    a, b = _msg("$JS.ACK.S.c.1.10.7.1700000000000000000.3"), _msg("$JS.ACK.S.c.1.11.8.1700000000000000000.2")
    stamp = 1700000000000000000
    assert position(a) is position(a) == Position(10, 7, 3, stamp)
    assert position(b) == Position(11, 8, 2, stamp) and position(a) == Position(10, 7, 3, stamp)
    assert position(_msg(str(a.reply))) == Position(10, 7, 3, stamp)


@pytest.mark.parametrize("reply", ["", "_INBOX.abc", "$JS.ACK.too.short", "$JS.NAK.s.c.1.2.3.4.5"])
def test_a_message_that_is_not_a_jetstream_delivery_is_refused_as_nats_py_does(reply: str) -> None:
    with pytest.raises(NotJSMessageError):
        position(_msg(reply))
