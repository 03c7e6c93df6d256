"""`vmquota tail`'s lines for messages anyone who may publish on the bus could have written."""

from __future__ import annotations

import json

from nats.aio.msg import Msg

from services.cli import tail
from shared import contract
from tests.builders import decision


def message(subject: str, data: bytes) -> Msg:
    return Msg(_client=None, subject=subject, data=data)  # type: ignore[arg-type]


def test_a_message_that_is_not_json_is_one_line_in_either_output() -> None:
    m = message("vmquota.ev.c1.tenant.pod", b"\x1b[2J not json")
    text = tail.show("events", m, "text")
    assert (
        text.startswith("(unreadable message at vmquota.ev.c1.tenant.pod: event: not a JSON event")
        and "\x1b" not in text
    )
    line = json.loads(tail.show("events", m, "json"))
    assert line["unreadable"] == "vmquota.ev.c1.tenant.pod" and line["error"].startswith("not JSON")


def test_a_dead_letters_reason_cannot_drive_the_operators_terminal() -> None:
    letter = contract.DeadLetter(
        id="d1",
        source="vmquota/ledger/c1",
        subject="tenant/vm1",
        time="2026-12-05T12:00:00Z",
        cluster="c1",
        service="ledger",
        reason="event: invalid event: Invalid value '\x1b[2J' - at `$.type`",
        original_subject="vmquota.ev.c1.tenant.vmi",
    )
    text = tail.show("dead-letters", message("vmquota.dlq.ledger", contract.encode(letter)), "text")
    assert "\x1b" not in text and "Invalid value '\\x1b[2J'" in text, text


def test_a_decision_in_status_hard_alone_says_so() -> None:
    """Two decisions of one raise, one in ``status.hard`` alone and then one in ``spec.hard``, read the same reason:
    the line tells them apart."""
    d = decision(reason="raised limits.memory by 16Gi for the migration of vm1", status_only=True)
    text = tail.show("decisions", message("vmquota.quota.c1.tenant", contract.encode(d)), "text")
    assert "[status.hard only]: raised limits.memory by 16Gi" in text, text


def test_tail_shows_a_body_on_another_clusters_subject_as_unreadable() -> None:
    """`status`, `explain`, `replay` and the services refuse a body that belongs on another subject (another
    cluster's credential wrote it); `tail` showed it as that cluster's decision, under `--cluster` too."""
    forged = decision("victim", cluster="other")
    subject = contract.decision_subject("c1", "tenant")
    shown = tail.show("decisions", Msg(_client=None, subject=subject, data=contract.encode(forged)), "text")  # type: ignore[arg-type]
    assert shown.startswith(f"(unreadable message at {subject}: ") and "belongs on" in shown, shown
    shown = json.loads(tail.show("decisions", message(subject, contract.encode(forged)), "json"))
    assert shown["unreadable"] == subject and "belongs on" in shown["error"], shown
