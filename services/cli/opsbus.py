"""Read-only access to the bus for the operator commands (``vmquota status``, ``tail``, ``replay``): the same
connection flags as ``vmquota run``, ordered (ephemeral) consumers only, and one clear line for every way the
connection can fail. Nothing here writes to the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import ssl
import sys
from collections import deque
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

import msgspec
from nats.aio.msg import Msg

from services.platform.bus import Client, NatsOptions, check_nats_options, wants_tls
from services.platform.config import add_ca_argument, add_inbox_argument, env
from services.platform.identity import inbox_prefix, naming_error
from shared import contract
from shared.errors import InvalidInput

T = TypeVar("T")


def add_bus_arguments(p: argparse.ArgumentParser, *, namespace: bool = True) -> None:
    """``--nats``, ``--nats-creds``/``--nats-user``/``--nats-password``, ``--nats-ca`` (as ``vmquota run``),
    ``--cluster`` and ``-n/--namespace`` filters."""
    p.add_argument(
        "--nats",
        default=env("VMQUOTA_NATS", "nats://127.0.0.1:4222"),
        help="NATS URL, or a comma-separated list [VMQUOTA_NATS]",
    )
    p.add_argument("--nats-creds", default=env("VMQUOTA_NATS_CREDS"), help="NATS .creds file [VMQUOTA_NATS_CREDS]")
    p.add_argument(
        "--nats-user",
        default=env("VMQUOTA_NATS_USER"),
        help="NATS user: replay (read-only, may create the ordered consumers these commands read with) "
        "[VMQUOTA_NATS_USER]",
    )
    p.add_argument(
        "--nats-password", default=env("VMQUOTA_NATS_PASSWORD"), help="NATS password [VMQUOTA_NATS_PASSWORD]"
    )
    add_inbox_argument(p)
    add_ca_argument(p)
    p.add_argument("--cluster", default=None, help="only this cluster (default: every cluster on the bus)")
    if namespace:
        p.add_argument("-n", "--namespace", default=None, help="only this namespace (default: all)")


@dataclass(frozen=True, slots=True)
class Filter:
    cluster: str | None = None
    namespace: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Filter:
        return cls.checked(args.cluster, getattr(args, "namespace", None))

    @classmethod
    def checked(cls, cluster: str | None, namespace: str | None) -> Filter:
        """A filter of ``--cluster`` and ``--namespace``, each a name the bus's subjects can hold."""
        if cluster is not None:
            try:
                contract.check_cluster(cluster)
            except InvalidInput as e:
                raise InvalidInput(e.message, "--cluster") from None
        if namespace is not None:
            contract.check_namespace(namespace, "--namespace")
        return cls(cluster, namespace)

    def subject(self, kind: str) -> str:
        """``vmquota.<kind>.<cluster|*>.<namespace|*>`` (``kind``: ``usage``, ``quota``); events: ``ev`` with
        any kind token after."""
        c, n = self.cluster or "*", self.namespace or "*"
        return f"{contract.PREFIX}.{kind}.{c}.{n}" + (".*" if kind == "ev" else "")


def parse_since(text: str | None, now: datetime, where: str = "--since") -> datetime | None:
    """``10m``, ``2h``, ``1d`` (before now) or an RFC 3339 time; None when not given."""
    if text is None:
        return None
    try:
        return now - timedelta(seconds=contract.parse_duration(text, where))
    except InvalidInput:
        return parse_time(text, where)


def parse_time(text: str, where: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInput(f"{text!r} is neither a duration (10m, 2h) nor an RFC 3339 time", where) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


_FRACTION = re.compile(r"[.,](\d{7,})")


def exact_nanos(text: str, t: datetime) -> int:
    """``t``, parsed from ``text``, in nanoseconds since the epoch with the digits beyond microseconds that ``text``
    gave (a time copied from the streams has nanoseconds: the message stored at that time is then included)."""
    from services.platform.bus import nanos

    ns = nanos(t)
    m = _FRACTION.search(text)
    if m is not None:
        ns += int(m[1][6:9].ljust(3, "0"))
    return ns


class BusUnavailable(Exception):
    """One line a person can act on."""


class NotFound(Exception):
    """What was asked for is not on the bus (exit 1, one line)."""


async def connect(args: argparse.Namespace) -> Any:
    """A NATS connection, or :class:`BusUnavailable` saying why not (unreachable, refused credentials)."""
    import nats
    import nats.errors

    from services.platform.logs import quiet_library_noise

    quiet_library_noise()  # (asyncio's warning at every close of a tls:// connection)
    if args.nats_creds and args.nats_user:
        raise BusUnavailable("give either --nats-creds or --nats-user/--nats-password, not both")
    check_nats_options(str(args.nats), args.nats_creds, args.nats_ca)
    servers = NatsOptions(url=str(args.nats)).servers
    kwargs: dict[str, Any] = {"servers": servers, "allow_reconnect": False, "connect_timeout": 3}
    # (a server that stops answering without closing the connection is lost after two unanswered pings: seconds,
    # where nats-py's default waits minutes)
    kwargs |= {"ping_interval": _PING_INTERVAL, "max_outstanding_pings": 2}
    if args.nats_ca:
        kwargs["tls"] = ssl.create_default_context(cafile=args.nats_ca)
    if args.nats_creds:
        kwargs["user_credentials"] = args.nats_creds
    if (naming := naming_error(args.nats_user, args.nats_inbox_prefix)) is not None:
        raise BusUnavailable(naming[1])
    if args.nats_user:
        kwargs["user"], kwargs["password"] = args.nats_user, args.nats_password or ""
    kwargs["inbox_prefix"] = inbox_prefix(args.nats_user, args.nats_inbox_prefix)
    errors: list[str] = []

    async def error_cb(e: Exception) -> None:
        errors.append(str(e) or type(e).__name__)

    try:
        # (nats-py keeps retrying a first connection that is refused: the deadline is ours)
        nc = Client(wants_tls=wants_tls(servers, args.nats_ca))
        await asyncio.wait_for(nc.connect(**kwargs, error_cb=error_cb, max_reconnect_attempts=0), 5.0)
        return nc
    except (OSError, TimeoutError, nats.errors.Error) as e:
        why = (errors[-1] if errors else "") or str(e) or type(e).__name__
        if "uthorization" in why:
            raise BusUnavailable(f"NATS at {args.nats} refused the credentials ({why.strip()})") from None
        raise BusUnavailable(f"cannot reach NATS at {args.nats} ({why.strip()}): check --nats (VMQUOTA_NATS)") from None


_PING_INTERVAL = 3.0
"""Seconds between the commands' pings of the server."""

_BUFFERED = 10_000
"""Messages :func:`messages` holds that its reader has not taken; then the subscription waits."""


def readable(
    msgs: Iterable[Msg], decode: Callable[[str, bytes], T]
) -> tuple[list[tuple[Msg, T]], list[tuple[Msg, str]]]:
    """Each message with ``decode`` of its subject and data (``contract.decode_*_on``: a body that belongs on another
    subject is refused, as the services refuse it), but those it refuses (the service that reads them dead-letters
    them: one must not hide the others), each with why it was refused."""
    out: list[tuple[Msg, T]] = []
    refused: list[tuple[Msg, str]] = []
    for m in msgs:
        try:
            out.append((m, decode(m.subject, m.data)))
        except InvalidInput as e:
            refused.append((m, str(e)))
    return out, refused


def skipped_note(refused: Sequence[tuple[Msg, str]]) -> str:
    """The note on stderr of messages :func:`readable` refused: how many, and why the first was."""
    m, why = refused[0]
    return f"note: {len(refused)} unreadable message(s) skipped, the first {m.subject}: {why}"


_AS_REPLAY: Final = "use the `replay` user (--nats-user replay)"
"""What the commands read as: the NATS user that may create their ordered consumers and get messages."""
_MAY_NOT_READ: Final = f"if the server is up, the NATS user may not read it: {_AS_REPLAY}"


async def stream_info(js: Any, stream: str, subject: str | None = None) -> Any:
    """The state of ``stream`` (with ``subject``, how many messages it holds on each subject the filter matches), or
    :class:`BusUnavailable` saying why not (it does not exist; the credentials may not read it; the server does not
    answer)."""
    from nats.js.errors import NotFoundError

    try:
        return await js.stream_info(stream, subjects_filter=subject)
    except NotFoundError:
        raise BusUnavailable(f"the stream {stream} does not exist on this server: is vmquota running?") from None
    except Exception as e:  # permissions (a request refused gets no answer: a timeout), timeouts
        raise BusUnavailable(f"cannot read the stream {stream} ({e or type(e).__name__}): {_MAY_NOT_READ}") from None


async def read(nc: Any, stream: str, subject: str, *, since: datetime | None = None) -> list[Msg]:
    """Every message of ``stream`` on ``subject`` stored now (from ``since``, when given), in stream order,
    through an ordered consumer of the connection ``nc``."""
    return [m async for m in messages(nc, stream, subject, since=since, follow=False)]


_LOST_CHECK = 1.0
"""Seconds a reader waits for a message before it looks whether the connection is still there."""


_STALL_MAX = 30.0
"""Seconds a read waits for the messages the server said it still had to deliver before it says the bus stopped."""


async def _state(nc: Any, js: Any, stream: str, subject: str | None = None) -> Any:
    """:func:`stream_info` on the connection ``nc``: a connection closed meanwhile is said as lost."""
    try:
        return await stream_info(js, stream, subject)
    except BusUnavailable:
        if nc.is_closed:
            raise _lost(nc) from None
        raise


_NO_MESSAGE: Final = 10037
"""JetStream's error code for a message get that found none."""

_GO_NANOS_MAX: Final = 2**63 - 1
"""The latest time the server's times hold, in nanoseconds since the epoch (Go's ``UnixNano``: an int64)."""

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


async def next_stored(nc: Any, stream: str, subject: str, *, since: datetime | None = None, seq: int = 1) -> int | None:
    """The sequence of the first message of ``stream`` on ``subject`` stored now at ``since`` or after (a message get
    by start time, NATS >= 2.11), or else at the sequence ``seq`` or after; None: none. :class:`BusUnavailable`
    when the server does not tell."""
    from nats.js.api import DEFAULT_PREFIX

    from services.platform.bus import nanos

    ask: dict[str, Any] = {"seq": seq, "next_by_subj": subject}
    where = f"from sequence {seq}"
    if since is not None:
        if nanos(since) > _GO_NANOS_MAX:
            return None  # (nothing is stored after the year 2262; NATS' nanoseconds would wrap and find the first)
        since = max(since, _EPOCH)  # (the same messages; before 1678 NATS' nanoseconds would wrap the other way)
        ask = {"start_time": since.isoformat(), "next_by_subj": subject}
        where = f"from {since.isoformat()}"
    try:
        reply = await nc.request(f"{DEFAULT_PREFIX}.STREAM.MSG.GET.{stream}", msgspec.json.encode(ask), timeout=5.0)
        answer = msgspec.json.decode(reply.data, type=_MsgGetAnswer)
    except Exception as e:  # permissions (a request refused gets no answer: a timeout), timeouts, a server too old
        if nc.is_closed:
            raise _lost(nc) from None
        raise BusUnavailable(
            f"cannot look up the stream {stream} {where} ({e or type(e).__name__}): {_MAY_NOT_READ}"
        ) from None
    if answer.error is not None:
        if answer.error.err_code == _NO_MESSAGE:
            return None
        raise BusUnavailable(f"cannot look up the stream {stream} {where}: NATS answered {answer.error.description!r}")
    if answer.message is None:
        raise BusUnavailable(f"cannot look up the stream {stream} {where}: NATS answered no message")
    return answer.message.seq


class _MsgGetError(msgspec.Struct):
    err_code: int = 0
    description: str = ""


class _MsgGetMessage(msgspec.Struct):
    seq: int


class _MsgGetAnswer(msgspec.Struct):
    """The part of JetStream's answer to a message get that is read here."""

    message: _MsgGetMessage | None = None
    error: _MsgGetError | None = None


async def _rest_gone(nc: Any, stream: str, subject: str, after: int) -> bool:
    """Nothing is stored on ``subject`` after the sequence ``after``, by the server's lookup: a read waiting for the
    messages its consumer said were to come ends (they expired, or were purged, before they were sent). False where
    the server does not tell (the read waits on, to its stall bound)."""
    try:
        return await next_stored(nc, stream, subject, seq=after + 1) is None
    except BusUnavailable:
        if nc.is_closed:
            raise
        return False


def _lost(nc: Any) -> BusUnavailable:
    why = nc.last_error
    return BusUnavailable(
        f"lost the connection to NATS{f' ({why})' if why else ''}: what was shown before this line is all that was read"
    )


async def messages(
    nc: Any,
    stream: str,
    subject: str,
    *,
    since: datetime | None = None,
    follow: bool = False,
    new_only: bool = False,
) -> AsyncGenerator[Msg, None]:
    """The messages of ``stream`` on ``subject`` (from ``since``; with ``new_only`` none stored before) in stream
    order, through an ordered consumer of the connection ``nc``; with ``follow``, then every new one as it is
    stored, until cancelled. A connection lost on the way is :class:`BusUnavailable` (the commands' connections do
    not reconnect): a stream read only in part, or followed no longer, is never shown as complete or as quiet."""
    from nats.js.api import DeliverPolicy

    js = nc.jetstream()
    info = await _state(nc, js, stream)
    nothing = info.state.messages == 0  # (nothing to read: a read that does not follow ends at once)
    start = 1  # (the first sequence the read shows)
    if new_only:
        start = info.state.last_seq + 1
    elif since is not None:
        # From the sequence of the first message at ``since`` on the subject, not from a time: a read then knows
        # messages are on their way, and an ordered consumer that resets goes on from a sequence (one reset with a
        # start time too is refused by the server, and the read lost). None since then: from what comes next.
        first = await next_stored(nc, stream, subject, since=since)
        nothing = first is None
        start = info.state.last_seq + 1 if first is None else first
    opts: dict[str, Any] = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": start}
    if start == 1:
        opts = {"deliver_policy": DeliverPolicy.ALL}
    # A stream that keeps a number of messages per subject replaces them: one stored past ``last`` during the read
    # may be the only one left of its subject, and is read too. The read ends where the consumer has none left, or
    # once it has read as many again as the stream held when it began (a publisher faster than the reader): there,
    # every subject the stream holds must have been shown, or the read is said to be incomplete.
    replaces = (info.config.max_msgs_per_subject or -1) > 0
    beyond = info.state.last_seq + info.state.messages
    shown: set[str] = set()  # (the subjects shown, on such a stream)
    from nats.js.api import ConsumerConfig

    from services.platform.bus import position

    # Messages arrive by the subscription's callback and wait in ``arrived`` for the reader (a replay reads millions:
    # a deque, and an event only when one side waits for the other, cost a third of an asyncio.Queue's put and get).
    arrived: deque[Msg] = deque()
    came, room = asyncio.Event(), asyncio.Event()  # (a message for the waiting reader; room for the waiting callback)
    reader_waits = callback_waits = False

    async def on_msg(m: Msg) -> None:
        nonlocal callback_waits
        if len(arrived) >= _BUFFERED:
            callback_waits = True
            room.clear()
            await room.wait()  # (full: the client stops answering the server's flow control, which then waits)
        arrived.append(m)
        if reader_waits:
            came.set()

    try:
        sub = await js.subscribe(
            subject,
            stream=stream,
            ordered_consumer=True,
            config=ConsumerConfig(**opts),
            cb=on_msg,
        )
    except Exception as e:  # a refused consumer create gets no answer: a timeout
        if nc.is_closed:
            raise _lost(nc) from None
        raise BusUnavailable(
            f"cannot read the stream {stream} ({e or type(e).__name__}): the commands read with ordered consumers, "
            f"which the NATS user must be allowed to create: {_AS_REPLAY}, not `subscriber`"
        ) from None
    try:
        if not follow and nothing:  # (its consumer made all the same: a user that may not is told)
            return
        last = info.state.last_seq
        got = False  # (a message came: each says how many the consumer still has to deliver after it)
        loop = asyncio.get_running_loop()
        heard = loop.time()  # (when the quiet began: the last message came, or the read began)
        fresh = False  # (a message came since ``heard`` was set: no clock read per message, a replay reads millions)
        after = 0  # (the stream sequence of the last message read)
        while True:
            if not arrived:  # (no timer per message while they are there: a replay reads millions)
                came.clear()
                reader_waits = True
                try:
                    await asyncio.wait_for(came.wait(), _LOST_CHECK)
                except TimeoutError:
                    if nc.is_closed:
                        raise _lost(nc) from None
                    if not follow and not got:
                        # Nothing on this subject, by the server's count (the server answers, or the read fails).
                        # Else its first message is slow: waited for.
                        held = (await _state(nc, js, stream, subject)).state.subjects  # (None: none)
                        if not arrived and not held:
                            return
                    elif not follow and not arrived and await _rest_gone(nc, stream, subject, after):
                        if not arrived:  # (what came while the server was asked is read first)
                            return  # (what was to come expired, or was purged, before it was sent)
                        continue
                    if not follow and not arrived:  # (messages are known to be on their way: the server stalls)
                        if fresh:  # (the quiet began within the second waited)
                            heard, fresh = loop.time() - _LOST_CHECK, False
                        quiet = loop.time() - heard
                        if quiet >= _STALL_MAX:
                            raise BusUnavailable(
                                f"NATS stopped sending the stream {stream} for {quiet:.0f}s with messages left: what "
                                "was shown before this line is not all of it"
                            ) from None
                finally:
                    reader_waits = False
                continue
            got = fresh = True
            m = arrived.popleft()
            if callback_waits and len(arrived) <= _BUFFERED // 2:
                callback_waits = False
                room.set()
            at = position(m)
            if at.stream < start:
                # (an ordered consumer reset before its first message starts again from sequence 1: what comes
                # before the read's start is not shown)
                continue
            yield m
            after = at.stream
            if follow:
                continue
            if at.pending == 0 or (at.stream >= last and not replaces):
                return
            if replaces:
                shown.add(m.subject)
                if at.stream >= beyond:
                    held = (await _state(nc, js, stream, subject)).state.subjects or {}
                    if missing := len(set(held) - shown):
                        raise BusUnavailable(
                            f"NATS replaced the messages of {stream} faster than they were read: {missing} subject(s) "
                            "not shown; what was shown before this line is not all of it (read again)"
                        )
                    return
    finally:  # (a reader that stops early closes this generator: ``contextlib.aclosing``, as ``replay`` does)
        with contextlib.suppress(Exception):  # (the connection may be closing: nothing left to tell the server)
            await sub.unsubscribe()


def command_name(args: argparse.Namespace) -> str:
    """How the command was called, for its messages: ``vmquota status``, or ``kubectl vmquota status``."""
    return f"{getattr(args, '_prog', 'vmquota')} {args.command}"


def run_command(args: argparse.Namespace, main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run an operator command: its exit code; a bad input or an unavailable bus is one line on stderr, exit 2
    (1 for a bus that cannot be used)."""
    try:
        return asyncio.run(main())
    except InvalidInput as e:
        print(f"{command_name(args)}: {e}", file=sys.stderr)
        return 2
    except (BusUnavailable, NotFound) as e:
        print(f"{command_name(args)}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
