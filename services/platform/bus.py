"""Async NATS JetStream helpers shared by the services: connect, streams, publish, pull consumers, dead letters.

* :func:`connect` reconnects forever (nats-py gives up after about two minutes by default) and reports
  disconnects, reconnects and errors through structlog and a callback instead of stdlib tracebacks.
* :meth:`Bus.ensure_streams` creates or updates the streams of ``shared.contract.streams()`` idempotently (the
  streams' keeper, the ledger, does); :meth:`Bus.wait_for_streams` waits for them (the other services).
* :meth:`Bus.publish` sets ``Nats-Msg-Id`` (tagged with the identity's key: ``services.platform.identity``) and
  retries while JetStream is unavailable (a retry is safe: the server drops the repeat within the duplicate window);
  ``services.platform.publisher`` keeps a window of acks in flight. A connection's replies come to its user's own
  inbox, ``_INBOX.<user>``.
* ``services.platform.consumer.PullConsumer`` reads a stream in order from a start sequence. It uses a durable
  pull consumer with ``AckPolicy.NONE`` (the reader keeps its own position, in its checkpoints) and re-creates it
  from the next sequence it needs after a reconnect, a gap in the consumer sequence, an API error, or when the
  consumer has vanished (nats-py pull subscriptions do not always resume after a server restart). It also checks
  its durable every ``check_interval`` seconds (``NatsOptions.consumer_check``): a durable another client deleted
  and re-created, or updated (another filter, deliver or ack policy), is logged as an error with the differences
  and re-created.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, NamedTuple, TypeVar

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)
from nats.js.kv import KeyValue

from services.platform.identity import id_key, inbox_prefix, keyed
from shared import contract
from shared.backoff import Backoff
from shared.errors import InvalidInput

log = structlog.get_logger("vmquota.bus")
T = TypeVar("T")

_CONNECT_BACKOFF: Final = Backoff(initial=0.2, maximum=5.0, jitter=0.2)
"""Between attempts to reach NATS at start."""


CALL_BACKOFF: Final = Backoff(initial=0.1, maximum=2.0, jitter=0.2)
"""Between retries of a JetStream call, and re-creations of a failing consumer."""

WAIT_LOG_INTERVAL: Final = 60.0
"""Seconds between two log lines of a service waiting for a stream."""
WAIT_WARN_AFTER: Final = 10.0
"""Seconds a service waits for a stream before it says so as a warning: services started together wait for the
ledger a moment, which is no trouble (an info line says so at once)."""

STREAM_NAME_IN_USE: Final = 10058
"""JetStream's error code for a create of a stream that exists with another configuration."""

# Errors after which a publish or fetch is worth retrying (the server restarts, JetStream is not yet ready).
TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
    TimeoutError,
    ConnectionError,
)


class ConnectStopped(Exception):
    """The service was asked to stop while it was still connecting to NATS (nothing to drain)."""


class LogThrottle:
    """Admit a repeating message once, then at most every ``every`` seconds with how often it came meanwhile."""

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._seen: dict[str, tuple[float, int]] = {}

    def admit(self, key: str) -> int | None:
        """None: do not log. 0: the first time. N: logged again, N repeats since the last line."""
        now = self.clock()
        last = self._seen.get(key)
        if last is None:
            self._seen[key] = (now, 0)
            return 0
        at, count = last
        if now - at >= self.every:
            self._seen[key] = (now, 0)
            return count + 1
        self._seen[key] = (at, count + 1)
        return None

    def reset(self) -> None:
        self._seen.clear()


async def _unless_stopped(
    aw: Awaitable[T], stop: asyncio.Event | None, *, on_stop: Callable[[], Awaitable[Any]] | None = None
) -> T:
    """``await aw``, unless ``stop`` is set first: then it is cancelled (and ``on_stop`` awaited) and
    :class:`ConnectStopped` raised."""
    if stop is None:
        return await aw
    work = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([work, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if on_stop is not None:
            with contextlib.suppress(Exception):
                await on_stop()
        raise ConnectStopped("stopped while connecting to NATS")
    return work.result()


_ATTEMPT_LIMIT: Final = 15.0
"""How long one try of the first connection may take (nats-py's: two tries of 5 s and a wait between)."""

_AFTER_ERROR: Final = 2.0
"""How long a try of the first connection may go on once the client reported a TLS or credentials error: nats-py 2.16
reports a failed TLS handshake (a certificate that does not verify) and then never returns, and the service said
nothing. (Another error, a node of several that is down, leaves the client to try the next.)"""

_AUTH_REFUSED: Final = "Authorization Violation"
"""What the server answers to a user or password it does not know."""


def _why_not_connected(reported: list[str], decisive: list[str], e: BaseException) -> tuple[str, str]:
    """The retry line of a first connection that failed with ``e``: the event and the cause it names. The client
    ``reported`` these errors, of which the ``decisive`` ones (a refused password, a TLS error) end the try. The first
    decisive error is the cause whatever the client reported after it (its second try of the same server may end in a
    timeout or a closed connection instead); else the last error reported, for a try that ended without its own
    reason; else ``e``."""
    if decisive:
        why = decisive[0]
    elif reported and isinstance(e, (nats.errors.NoServersError, TimeoutError)):
        why = reported[-1]
    else:
        why = str(e)
    why = why or type(e).__name__
    refused = _AUTH_REFUSED in why
    return ("nats refused the credentials, retrying" if refused else "nats not reachable, retrying"), why


async def _connect_once(nc: Client, kwargs: dict[str, Any], reported: asyncio.Event) -> None:
    """``nc.connect(**kwargs)``, given up with a TimeoutError after :data:`_ATTEMPT_LIMIT`, or :data:`_AFTER_ERROR`
    after the client ``reported`` an error (its error callback sets it)."""
    work = asyncio.ensure_future(nc.connect(**kwargs))
    said = asyncio.ensure_future(reported.wait())
    try:
        done, _ = await asyncio.wait({work, said}, timeout=_ATTEMPT_LIMIT, return_when=asyncio.FIRST_COMPLETED)
        if work not in done and said in done:
            done, _ = await asyncio.wait({work}, timeout=_AFTER_ERROR)
        if work not in done:
            raise TimeoutError("no answer from the server")
        work.result()
    finally:
        said.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            with contextlib.suppress(Exception):
                await nc.close()


class Position(NamedTuple):
    """Where a JetStream message is (what nats-py's ``msg.metadata`` gives of it)."""

    stream: int
    """Its stream sequence."""
    consumer: int
    """Its consumer sequence."""
    pending: int
    """Messages left for the consumer after it."""
    time_ns: int = 0
    """When the server stored it, in nanoseconds since the epoch."""


_tuple_new: Final = tuple.__new__
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)
_last_read: tuple[object, Position] = (object(), Position(0, 0, 0))
"""The reply subject :func:`position` read last, and what it read (the same string object: the same message)."""


def position(msg: Msg) -> Position:
    """A JetStream message's :class:`Position`, read from its reply subject:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``, or with a domain and
    an account hash before the stream (11 tokens or more). nats-py's ``msg.metadata`` builds a timestamp and three
    objects for it, ten times the cost, on the path of every event a ledger folds. Anything else falls back to it
    (which raises ``NotJSMessageError`` for a message that is not a JetStream delivery)."""
    global _last_read
    reply = msg.reply
    if reply is _last_read[0]:  # the same message again (a reader and its caller both ask): read once
        return _last_read[1]
    tokens = reply.split(".") if reply else []
    n = len(tokens)
    if (n == 9 or n >= 11) and tokens[0] == "$JS" and tokens[1] == "ACK":
        s, c, t, p = (5, 6, 7, 8) if n == 9 else (7, 8, 9, 10)
        at = _tuple_new(Position, (int(tokens[s]), int(tokens[c]), int(tokens[p]), int(tokens[t])))  # (no __new__)
        _last_read = (reply, at)
        return at
    md = msg.metadata
    return Position(md.sequence.stream, md.sequence.consumer, md.num_pending, nanos(md.timestamp))


def nanos(t: datetime) -> int:
    """``t`` in nanoseconds since the epoch, exactly (a float would round); a naive ``t`` is UTC."""
    return ((t if t.tzinfo is not None else t.replace(tzinfo=UTC)) - _EPOCH) // _MICROSECOND * 1000


@dataclass(frozen=True, slots=True)
class NatsOptions:
    url: str = "nats://127.0.0.1:4222"
    creds: str | None = None
    """Path to a ``.creds`` file (JWT + nkey)."""
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    name: str = "vmquota"
    inbox_prefix: str | None = None
    """The prefix of this identity's reply subjects (None: ``_INBOX.<user>``, or ``_INBOX`` without a user name;
    ``services.platform.identity``)."""
    ca: str | None = None
    """CA bundle (PEM) that signed the server's certificate, for ``tls://`` (default: the system's CAs)."""
    consumer_check: float = 30.0
    """Seconds between two checks of a :class:`PullConsumer`'s durable against the configuration it created, and
    between two of the ledger's checks of the streams (``LedgerService._keep_streams``)."""
    stream_sizes: contract.StreamSizes | None = None
    """The sizes :meth:`Bus.ensure_streams` and :meth:`Bus.ensure_kv` give the streams and the bucket (None: those
    of the stream specs, and the default for the bucket)."""
    stream_replicas: int = 1
    """How many servers of a JetStream cluster keep each stream and the bucket (1: a single server)."""

    @property
    def servers(self) -> list[str]:
        """``url`` is one URL or a comma-separated list (the servers of a cluster; the client also learns the
        others from the one it reaches)."""
        return [u.strip() for u in self.url.split(",") if u.strip()]


_NATS_SCHEMES: Final = ("nats", "tls", "ws", "wss")


def check_nats_options(url: str, creds: str | None = None, ca: str | None = None) -> None:
    """Before anything connects: ``url`` is one NATS URL or a comma-separated list of them, and the credentials
    file and CA bundle, when given, are readable files of their kind. :class:`InvalidInput` names the flag (a bad
    argument is the operator's to fix, not a bus to wait for)."""
    from urllib.parse import urlsplit

    flag = "--nats (VMQUOTA_NATS)"
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise InvalidInput("names no server", flag)
    for server in servers:
        try:
            parts = urlsplit(server if "://" in server else f"nats://{server}")
            port = parts.port
        except ValueError:
            parts, port = None, None
        if parts is None or parts.scheme not in _NATS_SCHEMES or not parts.hostname or (port is not None and port <= 0):
            raise InvalidInput(
                f"{server!r} is not a NATS URL (e.g. nats://nats:4222, tls://nats:4222, or host:port)", flag
            )
    from services.platform.inputs import read_setting_file

    if creds:
        text = read_setting_file(creds, "--nats-creds (VMQUOTA_NATS_CREDS)", lenient=True)
        if "BEGIN NATS USER JWT" not in text or "BEGIN USER NKEY SEED" not in text:
            raise InvalidInput(
                f"{creds} is not a NATS credentials file (a user JWT and an NKEY seed, as `nsc` writes it)",
                "--nats-creds (VMQUOTA_NATS_CREDS)",
            )
    if ca:
        read_setting_file(ca, "--nats-ca (VMQUOTA_NATS_CA)", lenient=True)
        try:
            ssl.create_default_context(cafile=ca)
        except (ssl.SSLError, ValueError) as e:
            raise InvalidInput(f"{ca} is not a PEM CA bundle ({e})", "--nats-ca (VMQUOTA_NATS_CA)") from None


class TlsRequired(nats.errors.Error):
    """TLS was asked for, and the server did not offer it: nothing was sent."""

    def __str__(self) -> str:
        return "nats: secure connection required, and the server did not offer TLS (nothing was sent to it)"


class Client(NATS):
    """nats-py's client, refusing to send its ``CONNECT`` (the credentials) in plaintext where TLS was asked for: a
    ``tls://`` URL or a CA bundle. nats-py 2.16 upgrades a connection only when the server's first ``INFO`` says
    ``tls_required``, so a server without TLS, or anyone between that takes the flag out, was sent the password
    in the clear; nats.go refuses such a server (``checkForSecure``), and so does this. Every connection, a
    reconnect's too, is checked."""

    def __init__(self, *, wants_tls: bool) -> None:
        super().__init__()
        self.wants_tls = wants_tls

    def _connect_command(self) -> bytes:
        server = self._current_server
        scheme = server.uri.scheme if server is not None else ""
        upgraded = self.options.get("tls_handshake_first") or (
            bool(self._server_info.get("tls_required")) and scheme != "ws"
        )
        if self.wants_tls and scheme != "wss" and not upgraded:
            raise TlsRequired()
        return bytes(super()._connect_command())


def wants_tls(servers: list[str], ca: str | None) -> bool:
    """Whether TLS was asked for: a ``tls://`` URL among ``servers``, or a CA bundle."""
    return bool(ca) or any(s.strip().lower().startswith("tls://") for s in servers)


class Bus:
    """A connection to NATS with JetStream, counting reconnects (``epoch``) so consumers can re-create themselves."""

    def __init__(self, nc: NATS, on_reconnect: Callable[[], None] | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.epoch = 0
        """Incremented on every reconnect."""
        self._on_reconnect = on_reconnect
        self.consumer_check = 30.0
        """Default ``check_interval`` of the :class:`PullConsumer` s on this bus, and the ledger's interval between two
        checks of the streams (``NatsOptions.consumer_check``)."""
        self.stream_sizes: contract.StreamSizes | None = None
        """``NatsOptions.stream_sizes``."""
        self.stream_replicas = 1
        """``NatsOptions.stream_replicas``."""
        self.closing = False
        """:meth:`close` was called (a disconnect from then on is expected)."""
        self.id_key: bytes | None = None
        """The key of this identity's message-id tags (:func:`~services.platform.identity.id_key`; None: untagged)."""

    def keyed(self, msg_id: str) -> str:
        """``msg_id`` as this identity publishes it (:func:`~services.platform.identity.keyed`)."""
        return keyed(msg_id, self.id_key)

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (bytes, headers included: its ``max_payload``)."""
        return int(self.nc.max_payload)

    # ---- connection --------------------------------------------------------------------------------------------
    @classmethod
    async def connect(
        cls,
        opts: NatsOptions,
        *,
        on_reconnect: Callable[[], None] | None = None,
        connect_timeout: float = 0.0,
        stop: asyncio.Event | None = None,
    ) -> Bus:
        """Connect, retrying the first connection for ``connect_timeout`` seconds (0: forever) with backoff
        (0.2 s doubling to 5 s), one log line per attempt. ``stop`` set meanwhile ends the attempts at once with
        :class:`ConnectStopped`. Once connected, a lost connection is retried every 0.5 s forever (recovery within
        a second), and the client's errors are logged once per cause, then at most every 30 s with a count."""
        holder: list[Bus] = []
        errors = LogThrottle(30.0)
        first: list[str] = []
        decisive: list[str] = []
        reported = asyncio.Event()

        async def error_cb(e: Exception) -> None:
            why = str(e) or type(e).__name__
            if not holder:
                first.append(why)  # (the first connection: the retry loop below says why, with its backoff)
                if isinstance(e, ssl.SSLError) or _AUTH_REFUSED in why:  # (not a node that is down: the next may do)
                    decisive.append(why)
                    reported.set()
                return
            repeated = errors.admit(why)
            if repeated is not None:
                log.warning("nats error", error=why, **({"repeated": repeated} if repeated else {}))

        async def disconnected_cb() -> None:
            if holder and not holder[0].closing:  # (our own close is no news)
                log.warning("nats disconnected")

        async def reconnected_cb() -> None:
            errors.reset()
            if holder:
                holder[0]._reconnected()
            log.info("nats reconnected", url=str(nc.connected_url.geturl() if nc.connected_url else ""))

        async def closed_cb() -> None:
            if holder:
                log.info("nats connection closed")

        kwargs: dict[str, Any] = {
            "servers": opts.servers,
            "name": opts.name,
            "allow_reconnect": True,
            # the first connection: two tries, then this loop's backoff; after it, forever (set below)
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": 5,
            "inbox_prefix": inbox_prefix(opts.user, opts.inbox_prefix),
            "ping_interval": 10,
            "max_outstanding_pings": 3,
            "error_cb": error_cb,
            "disconnected_cb": disconnected_cb,
            "reconnected_cb": reconnected_cb,
            "closed_cb": closed_cb,
        }
        if opts.ca:
            kwargs["tls"] = ssl.create_default_context(cafile=opts.ca)
        if opts.creds:
            kwargs["user_credentials"] = opts.creds
        if opts.user:
            kwargs["user"] = opts.user
            kwargs["password"] = opts.password or ""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout if connect_timeout > 0 else None
        attempt = 0
        while True:
            nc = Client(wants_tls=wants_tls(opts.servers, opts.ca))
            reported.clear()
            try:
                await _unless_stopped(_connect_once(nc, kwargs, reported), stop, on_stop=nc.close)
                break
            except (TimeoutError, nats.errors.NoServersError, OSError) as e:
                delay = _CONNECT_BACKOFF.delay(attempt)
                if deadline is not None and loop.time() + delay > deadline:
                    raise
                event, why = _why_not_connected(first, decisive, e)
                first.clear()
                decisive.clear()
                log.warning(event, url=opts.url, error=why, retry_in=round(delay, 2))
                await _unless_stopped(asyncio.sleep(delay), stop)
                attempt += 1
        nc.options["max_reconnect_attempts"] = -1  # (nats-py reads it on every reconnect)
        bus = cls(nc, on_reconnect)
        bus.id_key = id_key(password=opts.password if opts.user else None, creds=opts.creds)
        bus.consumer_check = opts.consumer_check
        bus.stream_sizes = opts.stream_sizes
        bus.stream_replicas = opts.stream_replicas
        holder.append(bus)
        return bus

    def _reconnected(self) -> None:
        self.epoch += 1
        if self._on_reconnect is not None:
            self._on_reconnect()

    async def close(self) -> None:
        self.closing = True
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # draining a broken connection: closing is all that is left
                await self.nc.close()

    # ---- streams and buckets -----------------------------------------------------------------------------------
    async def ensure_streams(self, specs: Iterable[contract.StreamSpec], *, deadline: float = 60.0) -> None:
        """Create each stream, or update it to the given limits when it exists (idempotent): what the streams'
        keeper does (:data:`shared.contract.STREAM_KEEPER`, the one identity the NATS configurations let create or
        update a stream; the others :meth:`wait_for_streams`). The bus's ``stream_sizes``, when set, give the
        streams' sizes.

        No message of a stream may be deleted or purged (``deny_delete``, ``deny_purge``: the server refuses to
        cancel either) and no roll-up header is taken (``allow_rollup_hdrs`` off). Limits that differ are put back
        (:meth:`_ensure_stream`). A transient error is retried for ``deadline`` seconds, then raised."""
        for spec in specs:
            max_bytes = self.stream_sizes.of(spec.name) if self.stream_sizes is not None else spec.max_bytes
            cfg = StreamConfig(
                name=spec.name,
                subjects=list(spec.subjects),
                sources=[StreamSource(name=name) for name in spec.sources] or None,
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=spec.max_age,
                max_msgs_per_subject=spec.max_msgs_per_subject,
                duplicate_window=spec.duplicate_window,
                max_bytes=max_bytes,
                num_replicas=self.stream_replicas,
                max_msgs=-1,
                max_msg_size=-1,
                discard=DiscardPolicy.OLD,
                deny_delete=True,
                deny_purge=True,
                allow_rollup_hdrs=False,
            )
            await _retry(functools.partial(self._ensure_stream, cfg), what=f"stream {spec.name}", deadline=deadline)

    async def wait_for_streams(self, names: Iterable[str]) -> None:
        """Until every stream named exists: a service that does not keep the streams waits for the keeper, the ledger,
        to create them (at its start, after a reconnect, and after a server that lost its store came back). It says
        so at once as information, then as a warning after :data:`WAIT_WARN_AFTER` seconds and about once a minute,
        with what to check."""
        loop = asyncio.get_running_loop()
        for name in sorted(names):
            attempt, since, told, warned = 0, loop.time(), -1.0, False
            while True:
                try:
                    await self.js.stream_info(name)
                    break
                except nats.js.errors.NotFoundError:
                    why = "the ledger creates it: is the ledger running?"
                except TRANSIENT as e:
                    why = (
                        f"no answer ({str(e) or type(e).__name__}): is NATS up, and does its configuration let this "
                        f"user look the stream up ($JS.API.STREAM.INFO.{name})?"
                    )
                now = loop.time()
                waited = round(now - since, 1)
                if told < 0:  # (at once, as information: services started together wait for the ledger a moment)
                    log.info("waiting for a stream", stream=name, waited_s=waited, why=why)
                    told = now
                elif waited >= WAIT_WARN_AFTER and (not warned or now - told >= WAIT_LOG_INTERVAL):
                    log.warning("waiting for a stream", stream=name, waited_s=waited, why=why)
                    told, warned = now, True
                await asyncio.sleep(CALL_BACKOFF.delay(attempt))
                attempt += 1
            if told >= 0:
                log.info("stream is there", stream=name, waited_s=round(loop.time() - since, 1))

    async def _ensure_stream(self, cfg: StreamConfig) -> None:
        assert cfg.name is not None
        try:
            info = await self.js.stream_info(cfg.name)
        except nats.js.errors.NotFoundError:
            try:
                await _refused_as_set(self.js.add_stream(cfg), cfg)
            except nats.js.errors.BadRequestError as e:
                if e.err_code != STREAM_NAME_IN_USE:
                    raise
                info = await self.js.stream_info(cfg.name)  # (another client created it meanwhile, otherwise)
            else:
                log.info("stream created", stream=cfg.name)
                return
        have = info.config
        if have.sealed:
            # (no update unseals a stream: nothing more is stored in it until it is deleted and created again)
            log.error(
                "stream sealed: it stores nothing more until an operator deletes it (the ledger then creates it "
                "again within --nats-consumer-check)",
                stream=cfg.name,
            )
            return
        if (
            list(have.subjects or []) != cfg.subjects
            or float(have.max_age or 0) != float(cfg.max_age or 0)
            or have.max_msgs_per_subject != cfg.max_msgs_per_subject
            or float(have.duplicate_window or 0) != float(cfg.duplicate_window)
            or (have.max_bytes or -1) != (cfg.max_bytes or -1)
            or sorted(src.name for src in have.sources or []) != sorted(src.name for src in cfg.sources or [])
            or (have.num_replicas or 1) != (cfg.num_replicas or 1)
            or (have.max_msgs or -1, have.max_msg_size or -1) != (cfg.max_msgs, cfg.max_msg_size)
            or (have.discard or DiscardPolicy.OLD) != cfg.discard
            or (bool(have.deny_delete), bool(have.deny_purge), bool(have.allow_rollup_hdrs)) != (True, True, False)
        ):
            await _refused_as_set(self.js.update_stream(cfg), cfg)
            # (a warning: limits someone changed, or ledger instances given different stream flags, which then
            # put their own back in turn every check)
            log.warning("stream limits differed from this ledger's: put back", stream=cfg.name)

    async def ensure_kv(self, bucket: str, *, history: int = 1, deadline: float = 60.0) -> KeyValue:
        """Open the key-value bucket, creating it when missing, at its size (the bus's ``stream_sizes``, or the
        default); an existing bucket of another size is updated to it."""
        sizes = self.stream_sizes or contract.StreamSizes()
        max_bytes = sizes.of(bucket) if bucket == contract.LEDGER_BUCKET else -1

        async def once() -> KeyValue:
            try:
                kv = await self.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                config = KeyValueConfig(
                    bucket=bucket, history=history, max_bytes=max_bytes, replicas=self.stream_replicas
                )
                wanted = StreamConfig(name=f"KV_{bucket}", max_bytes=max_bytes, num_replicas=self.stream_replicas)
                return await _refused_as_set(self.js.create_key_value(config), wanted)
            info = await self.js.stream_info(f"KV_{bucket}")
            have = (info.config.max_bytes or -1, info.config.num_replicas or 1)
            if have != (max_bytes, self.stream_replicas):
                wanted = dataclasses.replace(info.config, max_bytes=max_bytes, num_replicas=self.stream_replicas)
                await _refused_as_set(self.js.update_stream(wanted), wanted)
                log.info("bucket updated", bucket=bucket, max_bytes=max_bytes, replicas=self.stream_replicas)
            return kv

        return await _retry(once, what=f"bucket {bucket}", deadline=deadline)

    # ---- publishing --------------------------------------------------------------------------------------------
    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        ack_timeout: float = 5.0,
        deadline: float = 60.0,
    ) -> PubAck:
        """Publish to JetStream and wait for the ack, retrying transient failures for up to ``deadline`` s."""
        return (await self._publish(subject, data, msg_id, headers, ack_timeout, deadline))[0]

    async def _publish(
        self,
        subject: str,
        data: bytes,
        msg_id: str | None,
        headers: dict[str, str] | None,
        ack_timeout: float,
        deadline: float,
    ) -> tuple[PubAck, bool]:
        """:meth:`publish`, and whether a try before the one answered timed out waiting for its ack (then a repeat
        may be that try's message, stored; a try refused outright, with no responders say, stored nothing)."""
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = self.keyed(msg_id)
        unanswered = False

        async def once() -> PubAck:
            nonlocal unanswered
            try:
                return await self.js.publish(subject, data, timeout=ack_timeout, headers=hdrs or None)
            except TimeoutError:  # (nats-py's is one too)
                unanswered = True
                raise

        return await _retry(once, what=f"publish {subject}", deadline=deadline), unanswered

    async def publish_dead_letter(
        self,
        service: str,
        reason: str,
        *,
        cluster: str = "",
        original_subject: str = "",
        stream: str = "",
        stream_seq: int = 0,
        payload: bytes = b"",
    ) -> bool:
        """Publish a :class:`shared.contract.DeadLetter` on ``vmquota.dlq.<service>.<cluster>.<namespace>`` (the
        namespace of ``original_subject``; deduplicated per original stream sequence within the stream's duplicate
        window, so a replay after a restart does not repeat it). False: the server dropped it as a repeat of a
        letter an earlier call stored (count it no more); a repeat after one of this call's tries went unanswered
        is taken for that try's letter (counted: one stored and never counted would go unseen)."""
        mid = f"dlq/{service}/{stream}/{stream_seq}" if stream_seq else None
        letter, headers = contract.dead_letter(
            service,
            reason,
            cluster=cluster,
            original_subject=original_subject,
            stream=stream,
            stream_seq=stream_seq,
            payload=payload,
            msg_id=mid,
            limit=self.max_payload // 2,
        )
        from_cluster, namespace = contract.subject_scope(original_subject)
        subject = contract.dlq_subject(service, cluster or from_cluster, namespace)
        ack, unanswered = await self._publish(subject, contract.encode(letter), mid, headers, 5.0, 60.0)
        return not ack.duplicate or unanswered

    async def record_dead_letter(
        self,
        count: Callable[[], None],
        service: str,
        reason: str,
        *,
        cluster: str,
        original_subject: str,
        stream: str,
        stream_seq: int,
        payload: bytes,
    ) -> None:
        """A service's reject: :meth:`publish_dead_letter`, and ``count()`` for the reject, but for a repeat the
        server dropped (a message read again after a restart). A letter the bus refuses is logged, not raised: the
        reject was logged by the service, and a broken bus must not stop it (counted all the same)."""
        try:
            stored = await self.publish_dead_letter(
                service,
                reason,
                cluster=cluster,
                original_subject=original_subject,
                stream=stream,
                stream_seq=stream_seq,
                payload=payload,
            )
        except Exception as e:
            log.error("dead letter not published", error=str(e) or type(e).__name__)
            stored = True
        if stored:
            count()


NO_ROOM: Final = frozenset({10023, 10047})
"""JetStream's answers to a stream larger than the server (or cluster) has room for: insufficient resources, and
storage resources exceeded."""
REPLICAS_NOT_SUPPORTED: Final = 10074
"""JetStream's answer to replicas asked of a server that is not clustered."""
NO_PEERS: Final = 10005
"""A JetStream cluster's answer to a stream no set of its nodes can place: too many replicas, or (its description
says ``insufficient storage``) too large."""


async def _refused_as_set(call: Awaitable[T], cfg: StreamConfig) -> T:
    """``call``, a create or update of the stream ``cfg``; a refusal of its size or replicas, which no retry mends, as
    :class:`InvalidInput` naming the flag to change (the service then stops, one line, no traceback)."""
    try:
        return await call
    except nats.js.errors.APIError as e:
        why = e.description or str(e)
        clustered = e.err_code == NO_PEERS  # (a cluster: no node with the room, or not as many nodes as replicas)
        if (e.err_code in NO_ROOM or (clustered and "storage" in why)) and cfg.name is not None:
            flag, var = contract.StreamSizes.setting(contract.StreamSizes.field(cfg.name))
            raise InvalidInput(
                f"NATS has no room for the stream {cfg.name} of {cfg.max_bytes} bytes ({why}): lower it, or give "
                "the server more JetStream storage",
                f"{flag} ({var})",
            ) from None
        if e.err_code == REPLICAS_NOT_SUPPORTED or clustered:
            raise InvalidInput(
                f"NATS refused {cfg.num_replicas} replicas of the stream {cfg.name} ({why}): a server that is not "
                "clustered keeps one, a cluster at most as many as it has nodes",
                "--stream-replicas (VMQUOTA_STREAM_REPLICAS)",
            ) from None
        raise


async def _retry(fn: Callable[[], Awaitable[T]], *, what: str, deadline: float = 60.0) -> T:
    """Await ``fn()`` until it succeeds, retrying TRANSIENT errors with jittered backoff for ``deadline`` s."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    attempt = 0
    while True:
        try:
            return await fn()
        except TRANSIENT as e:
            delay = CALL_BACKOFF.delay(attempt)
            if loop.time() + delay > end:
                raise
            log.warning("nats call failed, retrying", what=what, error=str(e) or type(e).__name__)
            await asyncio.sleep(delay)
            attempt += 1
