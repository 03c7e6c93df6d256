"""The ledger's periodic check of the streams (``LedgerService._keep_streams``) while it runs."""

from __future__ import annotations

from types import SimpleNamespace

from services.ledger.service import LedgerService
from shared.errors import InvalidInput


async def test_a_stream_the_server_refuses_while_the_ledger_runs_is_said_and_tried_again() -> None:
    """A stream an operator deleted that the server has no room to make again: the refusal, one line naming the flag,
    stops a ledger at its start; a running ledger stopped with it too (a crash loop, folding nothing), where it should
    say so and try again, folding meanwhile, as through a NATS outage."""
    ledger = LedgerService.__new__(LedgerService)
    tries: list[float] = []

    async def refused(deadline: float) -> None:
        tries.append(deadline)
        raise InvalidInput("NATS has no room for the stream VMQUOTA_DLQ", "--dlq-max-bytes (VMQUOTA_DLQ_MAX_BYTES)")

    ledger.bus = SimpleNamespace(epoch=1, consumer_check=30.0)  # type: ignore[assignment]
    ledger._streams_at = (0, 0.0)
    ledger._streams_failing = ""
    ledger._ensure_streams = refused  # type: ignore[method-assign,assignment]
    await ledger._keep_streams(100.0)
    assert tries == [0.0] and ledger._streams_failing
    await ledger._keep_streams(100.5)  # (within the second: not yet)
    await ledger._keep_streams(101.0)
    assert len(tries) == 2, "tried again a second later"


async def test_a_refusal_after_an_outage_is_said_too() -> None:
    """A server back from an outage with its store lost, with no room to make a stream again: the outage was said,
    the refusal (the line naming the flag) never, however long it lasted."""
    import nats.errors
    from structlog.testing import capture_logs

    ledger = LedgerService.__new__(LedgerService)
    answers: list[Exception] = [
        nats.errors.TimeoutError(),
        InvalidInput("NATS has no room for the stream VMQUOTA_EVENTS", "--events-max-bytes (VMQUOTA_EVENTS_MAX_BYTES)"),
    ]

    async def ensure(deadline: float) -> None:
        raise answers.pop(0) if len(answers) > 1 else answers[0]

    ledger.bus = SimpleNamespace(epoch=1, consumer_check=30.0)  # type: ignore[assignment]
    ledger._streams_at = (0, 0.0)
    ledger._streams_failing = ""
    ledger._ensure_streams = ensure  # type: ignore[method-assign,assignment]
    with capture_logs() as logs:
        for t in range(100, 110):
            await ledger._keep_streams(float(t))
    said = [e for e in logs if "streams not checked" in e["event"]]
    assert len(said) == 2 and "VMQUOTA_EVENTS_MAX_BYTES" in str(said[1].get("error")), said
