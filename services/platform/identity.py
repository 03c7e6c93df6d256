"""What a NATS identity's own credentials give it on the bus, beside the server's permissions.

* **Its inbox**, ``_INBOX.<user>``: the replies to its requests, JetStream's answers and its pull consumers'
  messages come there, and the shipped server configuration lets each user subscribe to its own inbox only. With
  ``_INBOX.>`` open to every user, any identity heard every other's replies and deliveries (another cluster's events
  through a ledger's pulls, the checkpoints a ledger reads back).
* **Its message ids**: a stream drops a message whose ``Nats-Msg-Id`` it stored within its duplicate window,
  whoever published the first, so an identity allowed to publish into a stream could suppress another's message by
  publishing its id first (another cluster's object events in the two-cluster layout, another service's dead
  letters). An id goes out with a tag only the identity's own secret gives (:func:`keyed`): the same for every
  replica and restart of that identity, whose repeats are still dropped, and not to be guessed by another.

A ``.creds`` identity (JWT) has no user name here: it gets ``--nats-inbox-prefix`` (``VMQUOTA_NATS_INBOX_PREFIX``),
which its JWT's permissions must let it subscribe under, or the default ``_INBOX``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Final

DEFAULT_INBOX: Final = "_INBOX"
_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]+")


def user_error(user: str) -> str | None:
    """Why ``user`` cannot name its inbox, or None."""
    if _TOKEN.fullmatch(user):
        return None
    return f"a NATS user name names its inbox ({DEFAULT_INBOX}.<user>): letters, digits, '-' and '_' only, got {user!r}"


def prefix_error(prefix: str) -> str | None:
    """Why ``prefix`` cannot be an inbox prefix (subject tokens, no wildcards), or None."""
    if all(_TOKEN.fullmatch(token) for token in prefix.split(".")):
        return None
    return f"an inbox prefix is subject tokens of letters, digits, '-' and '_' joined by '.', got {prefix!r}"


def naming_error(user: str | None, prefix: str | None) -> tuple[str, str] | None:
    """The flag and why, when ``--nats-user`` cannot name an inbox or ``--nats-inbox-prefix`` is not one; else None."""
    if user and (why := user_error(user)) is not None:
        return "--nats-user (VMQUOTA_NATS_USER)", why
    if prefix and (why := prefix_error(prefix)) is not None:
        return "--nats-inbox-prefix (VMQUOTA_NATS_INBOX_PREFIX)", why
    return None


def inbox_prefix(user: str | None, given: str | None = None) -> str:
    """The prefix of the identity's reply subjects: ``given``, else ``_INBOX.<user>``, else ``_INBOX``."""
    if given:
        return given
    return f"{DEFAULT_INBOX}.{user}" if user else DEFAULT_INBOX


def id_key(*, password: str | None, creds: str | None) -> bytes | None:
    """The key of the identity's message-id tags: from its password or the content of its ``.creds`` file (None:
    no secret, a bus without authentication, where ids go out as they are). ``OSError`` when the file is
    unreadable (the connection would fail on it too)."""
    secret = Path(creds).read_bytes() if creds else password.encode() if password else b""
    if not secret:
        return None
    return hashlib.sha256(b"vmquota Nats-Msg-Id tag\0" + secret).digest()


def keyed(msg_id: str, key: bytes | None) -> str:
    """``msg_id`` as the identity of ``key`` publishes it: ``<msg_id>/<tag>``, 16 hex digits of a keyed hash of the
    id (unchanged without a key)."""
    if key is None:
        return msg_id
    return f"{msg_id}/{hashlib.blake2b(msg_id.encode(), key=key, digest_size=8).hexdigest()}"
