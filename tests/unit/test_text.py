"""``shared.text``: what others wrote, made safe to show."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.cli import tail
from shared import contract, text
from shared.snapshot import EventSnapshot

DNS = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,40}[a-z0-9])?", fullmatch=True)


def test_what_a_tenant_wrote_cannot_drive_the_operators_terminal() -> None:
    assert text.printable("vm1 refused: limits.memory 16Gi") == "vm1 refused: limits.memory 16Gi"
    assert text.printable("a\x1b[2Jb\nc\td") == "a\\x1b[2Jb\\nc\\td"


@given(DNS)
def test_a_dns_name_is_shown_as_it_is(name: str) -> None:
    assert text.name(name) == name


@given(st.text(max_size=80))
def test_a_shown_name_holds_no_space_nor_anything_a_terminal_acts_on_and_tells_names_apart(name: str) -> None:
    shown = text.name(name)
    assert shown.isascii() and shown.isprintable() and " " not in shown
    assert all(c.isalnum() or c in ".-_:\\" for c in shown)
    other = name + "\\"
    assert text.name(other) != shown, "a backslash is escaped too, so no two names show the same"


def test_an_events_name_with_spaces_and_lookalikes_cannot_pose_as_a_line_of_tail() -> None:
    """An Event's name may hold spaces and any letter (the API server checks only '/', '%', '.' and '..'): shown as
    it is, a name padded to the terminal's width began a row with text of the tenant's own."""
    name = "x" + " " * 60 + "2026-12-01T10:00:03Z c1 deleted Pod tenant-a/web rv 9\u3164\u202e"
    snap = EventSnapshot(uid="u", namespace="tenant-a", name=name, reason="FailedCreate", involved_kind="Pod")
    ev = contract.object_event(
        "upserted", cluster="c1", kind="Event", namespace="tenant-a", name=name, uid="u", rv="5", snapshot=snap
    )
    shown = tail.line("events", contract.event_subject("c1", "Event", "tenant-a"), contract.encode(ev))
    assert " " not in shown.split("tenant-a/", 1)[1].split(" rv ")[0], shown
    assert "\\x20" in shown and "\\u3164" in shown and "\\u202e" in shown
