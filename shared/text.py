"""Text that others wrote, made safe to show: a tenant chooses an Event's name (spaces and any letter are allowed
in it) and message, and both reach an operator's terminal, a NATS header and a log line."""

from __future__ import annotations

import string
from typing import Final


def printable(text: str) -> str:
    """``text`` for a terminal: every character that is not printable (escape sequences, newlines) written as its
    Python escape. What the commands print can come from a tenant (an Event's message, an object's name): it must
    not move the cursor, recolour or rewrite what an operator reads, nor split one line into several."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def clipped(text: str, limit: int = 64) -> str:
    """``text`` cut after ``limit`` characters, ``...`` marking the cut: what an error line quotes of a value that
    may be as long as an object (a 200 KB quantity, a parser's message quoting its input)."""
    return text if len(text) <= limit else text[:limit] + "..."


_NAME_CHARACTERS: Final = frozenset(string.ascii_letters + string.digits + ".-_:")


def name(text: str) -> str:
    """An object's name as a message shows it: the characters a DNS name (and a resource or kind name) is made of as
    they are, any other (a space, a letter that looks like one, a backslash) as its escape. Most kinds' names are DNS
    names and read as before; an Event's name may hold spaces and any letter, and shown as it is it could pad a line
    until text of the tenant's own reads as a line of the command's."""
    if all(c in _NAME_CHARACTERS for c in text):
        return text
    return "".join(c if c in _NAME_CHARACTERS else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
