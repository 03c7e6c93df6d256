"""A process's configuration: the services a process can run (:data:`SERVICES`) and the flags of ``vmquota run``
(each also from an environment variable, flag wins), read once into a :class:`Config`. The flags are the contract
the deploy manifests are written from; ``docs/services.md`` lists them.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.platform.identity import naming_error
from shared import contract
from shared.errors import InvalidInput
from shared.ledger.fold import PartitionSet
from shared.quota import guard
from shared.quota.enforcement import DEFAULT_EXCLUDED_NAMESPACES

if TYPE_CHECKING:  # the clients are imported when a service runs, not when the CLI builds its parser
    from services.platform.bus import NatsOptions


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    main: str
    """``module:function`` of ``async def main(rt: Runtime) -> None``."""
    needs_cluster: bool = False
    """``--cluster`` is required (it watches or writes one cluster)."""


# The registry: adding a service is one line here.
SERVICES: dict[str, ServiceSpec] = {
    "ledger": ServiceSpec("services.ledger.main:main"),
    "enforcer": ServiceSpec("services.enforcer.main:main", needs_cluster=True),
    "watcher": ServiceSpec("services.watcher.main:main", needs_cluster=True),
}
PLANNED = ("watcher", "ledger", "enforcer")
"""Services ``all`` stands for (those registered run; the others are reported as not in this build)."""


@dataclass(frozen=True, slots=True)
class Config:
    service: str
    cluster: str | None
    nats: NatsOptions
    kubeconfig: str | None
    http_port: int
    log_level: str
    partitions: PartitionSet
    events_max_age: float
    """Seconds."""
    dry_run: bool
    leader_election: bool
    lease_namespace: str
    identity: str
    usage_history_max_age: float = 7 * contract.DAY
    """Seconds (the ledger's usage history stream)."""
    reservation_guard: bool = False
    """Enforcer: write each namespace's QuotaReservation before a raise (``deploy/components/reservation-guard``)."""
    guard_creators: tuple[str, ...] = (guard.DEFAULT_CREATOR,)
    exclude_namespaces: tuple[str, ...] = DEFAULT_EXCLUDED_NAMESPACES
    """Enforcer: namespaces (shell-style patterns) whose quotas are never written."""
    resync_interval: float = 60.0
    """Enforcer: seconds between two reads of the managed quotas from the API server (0: never)."""
    usage_refresh_interval: float = 30.0
    """Enforcer: least seconds between two writes of a quota's ``vmquota.io/usage`` summary alone."""


# ---- flags ------------------------------------------------------------------------------------------------------


def env(name: str, default: str | None = None) -> str | None:
    """The environment variable ``name``, or ``default`` when it is unset or empty."""
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _env_bool(name: str, default: bool) -> bool:
    raw = env(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise InvalidInput(f"{raw!r} is not a boolean (true/false)", name)


SIZE_FLAGS: dict[str, str] = {
    "events": "the events stream",
    "usage": "the usage stream",
    "usage_history": "the usage history stream",
    "decisions": "the decisions stream",
    "dlq": "the dead-letter stream",
    "checkpoints": "the ledger's checkpoint bucket",
}
"""``--<name>-max-bytes``: the fields of :class:`shared.contract.StreamSizes`."""


def _size_text(n: int) -> str:
    for unit, size in (("Gi", 2**30), ("Mi", 2**20)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def add_inbox_argument(p: argparse.ArgumentParser) -> None:
    """``--nats-inbox-prefix``: where the server sends this identity's replies (``services.platform.identity``)."""
    p.add_argument(
        "--nats-inbox-prefix",
        default=env("VMQUOTA_NATS_INBOX_PREFIX"),
        help="prefix of this identity's reply subjects (default: _INBOX.<user>, or _INBOX with --nats-creds) "
        "[VMQUOTA_NATS_INBOX_PREFIX]",
    )


def add_ca_argument(p: argparse.ArgumentParser) -> None:
    """``--nats-ca``: the CA bundle a ``tls://`` server's certificate is checked against."""
    p.add_argument(
        "--nats-ca",
        default=env("VMQUOTA_NATS_CA"),
        help="CA bundle (PEM) of the NATS server's certificate, for tls:// URLs; default: the system's CAs "
        "[VMQUOTA_NATS_CA]",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", metavar="SERVICE", help=f"the service to run: {', '.join(PLANNED)} or all")
    p.add_argument("--cluster", default=env("VMQUOTA_CLUSTER"), help="cluster id, a DNS label [VMQUOTA_CLUSTER]")
    p.add_argument(
        "--nats",
        default=env("VMQUOTA_NATS", "nats://127.0.0.1:4222"),
        help="NATS URL, or a comma-separated list of a cluster's servers [VMQUOTA_NATS]",
    )
    p.add_argument("--nats-creds", default=env("VMQUOTA_NATS_CREDS"), help="NATS .creds file [VMQUOTA_NATS_CREDS]")
    p.add_argument("--nats-user", default=env("VMQUOTA_NATS_USER"), help="NATS user [VMQUOTA_NATS_USER]")
    p.add_argument(
        "--nats-password", default=env("VMQUOTA_NATS_PASSWORD"), help="NATS password [VMQUOTA_NATS_PASSWORD]"
    )
    add_inbox_argument(p)
    add_ca_argument(p)
    p.add_argument(
        "--nats-consumer-check",
        default=env("VMQUOTA_NATS_CONSUMER_CHECK", "30s"),
        help="how often each service checks that its durable consumers are as it created them, and re-creates "
        "one another client changed [VMQUOTA_NATS_CONSUMER_CHECK, 30s]",
    )
    p.add_argument(
        "--kubeconfig",
        default=env("VMQUOTA_KUBECONFIG"),
        help="kubeconfig file; default: the in-cluster service account [VMQUOTA_KUBECONFIG]",
    )
    p.add_argument(
        "--http-port",
        default=env("VMQUOTA_HTTP_PORT", "8080"),
        help="port of /healthz, /readyz and /metrics; 0 picks a free one [VMQUOTA_HTTP_PORT, 8080]",
    )
    p.add_argument(
        "--log-level",
        default=env("VMQUOTA_LOG_LEVEL", "info"),
        help="debug, info, warning or error [VMQUOTA_LOG_LEVEL, info]",
    )
    p.add_argument(
        "--partitions",
        default=env("VMQUOTA_PARTITIONS", "16"),
        help="number of namespace partitions of the ledger [VMQUOTA_PARTITIONS, 16]",
    )
    p.add_argument(
        "--owned-partitions",
        default=env("VMQUOTA_OWNED_PARTITIONS", "all"),
        help="partitions this ledger instance folds, e.g. 0-7 or 0,2,4-5 [VMQUOTA_OWNED_PARTITIONS, all]",
    )
    p.add_argument(
        "--events-max-age",
        default=env("VMQUOTA_EVENTS_MAX_AGE", "30d"),
        help="how long the events stream keeps events, e.g. 30d, 12h; a minute at least, or 0 for no age limit "
        "[VMQUOTA_EVENTS_MAX_AGE, 30d]",
    )
    p.add_argument(
        "--stream-replicas",
        default=env("VMQUOTA_STREAM_REPLICAS", "1"),
        help="servers of a JetStream cluster that keep each stream and the bucket; 3 for a 3-node cluster "
        "[VMQUOTA_STREAM_REPLICAS, 1]",
    )
    p.add_argument(
        "--usage-history-max-age",
        default=env("VMQUOTA_USAGE_HISTORY_MAX_AGE", "7d"),
        help="ledger: how long the usage history stream keeps every snapshot; a minute at least, or 0 for no age "
        "limit [VMQUOTA_USAGE_HISTORY_MAX_AGE, 7d]",
    )
    defaults = contract.StreamSizes()
    for name, what in SIZE_FLAGS.items():
        flag, var = contract.StreamSizes.setting(name)
        default = _size_text(getattr(defaults, name))
        p.add_argument(
            flag,
            default=env(var, default),
            help=f"the most {what} keeps, e.g. 4Gi, 512Mi [{var}, {default}]",
        )
    p.add_argument(
        "--dry-run",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="enforcer: compute and report, never patch [VMQUOTA_DRY_RUN, false]",
    )
    p.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one active watcher/enforcer per cluster through a Lease [VMQUOTA_LEADER_ELECTION, true]",
    )
    p.add_argument(
        "--lease-namespace",
        default=env("VMQUOTA_LEASE_NAMESPACE", "vmquota-system"),
        help="namespace of the Leases [VMQUOTA_LEASE_NAMESPACE, vmquota-system]",
    )
    p.add_argument(
        "--identity",
        default=env("VMQUOTA_IDENTITY"),
        help="this process's identity in Leases [VMQUOTA_IDENTITY, the host name]",
    )
    p.add_argument(
        "--reservation-guard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="enforcer: write the QuotaReservation the reservation-guard policy reads before every raise "
        "(needs deploy/components/reservation-guard) [VMQUOTA_RESERVATION_GUARD, false]",
    )
    p.add_argument(
        "--guard-creators",
        default=env("VMQUOTA_GUARD_CREATORS", guard.DEFAULT_CREATOR),
        help="enforcer: comma-separated users that create launcher pods (KubeVirt's virt-controller) "
        f"[VMQUOTA_GUARD_CREATORS, {guard.DEFAULT_CREATOR}]",
    )
    p.add_argument(
        "--exclude-namespaces",
        default=env("VMQUOTA_EXCLUDE_NAMESPACES", ",".join(DEFAULT_EXCLUDED_NAMESPACES)),
        help="enforcer: comma-separated namespaces (shell patterns) whose quotas are never written "
        f"[VMQUOTA_EXCLUDE_NAMESPACES, {','.join(DEFAULT_EXCLUDED_NAMESPACES)}]",
    )
    p.add_argument(
        "--resync-interval",
        default=env("VMQUOTA_RESYNC_INTERVAL", "60s"),
        help="enforcer: how often the managed quotas are read from the API server, whose versions then replace "
        "the quota events' (0 never) [VMQUOTA_RESYNC_INTERVAL, 60s]",
    )
    p.add_argument(
        "--usage-refresh-interval",
        default=env("VMQUOTA_USAGE_REFRESH_INTERVAL", "30s"),
        help="enforcer: least time between two writes of a quota's vmquota.io/usage summary when spec.hard does "
        "not change (it also rides on every spec.hard write) [VMQUOTA_USAGE_REFRESH_INTERVAL, 30s]",
    )


def _int(raw: object, where: str) -> int:
    try:
        return int(str(raw).strip())
    except ValueError:
        raise InvalidInput(f"{raw!r} is not a whole number", where) from None


def service_names(service: str) -> list[str]:
    """The services ``vmquota run SERVICE`` runs: the one named, or for ``all`` every one this build has."""
    return [n for n in PLANNED if n in SERVICES] if service == "all" else [service]


def _stream_age(text: str, flag: str) -> float:
    """How long a stream keeps its messages: 0 (no age limit: its size limit only), or a minute at least (JetStream
    refuses less than 100 ms, and the service retried forever; a stream that drops what it keeps within seconds
    drops events before the ledger has read them)."""
    age = contract.parse_duration(text, flag)
    if 0 < age < 60:
        raise InvalidInput(f"{text!r} is shorter than a minute (0 keeps messages until the stream's size limit)", flag)
    return age


def config_from_args(args: argparse.Namespace) -> Config:
    """Validate the flags; :class:`InvalidInput` names the flag."""
    service = args.service
    if service != "all" and service not in SERVICES:
        if service in PLANNED:
            raise InvalidInput(f"service {service!r} is not available in this build yet", "SERVICE")
        raise InvalidInput(f"unknown service {service!r} (expected one of {', '.join(PLANNED)}, all)", "SERVICE")
    names = service_names(service)
    cluster = args.cluster
    if cluster is None and any(SERVICES[n].needs_cluster for n in names):
        raise InvalidInput(f"--cluster (VMQUOTA_CLUSTER) is required for {service}", "--cluster")
    if cluster is not None:
        try:
            contract.check_cluster(cluster)
        except InvalidInput as e:
            raise InvalidInput(e.message, "--cluster") from None
    http_port = _int(args.http_port, "--http-port (VMQUOTA_HTTP_PORT)")
    if http_port < 0 or http_port > 65535:
        raise InvalidInput(f"{http_port} is not a port number", "--http-port (VMQUOTA_HTTP_PORT)")
    total = _int(args.partitions, "--partitions (VMQUOTA_PARTITIONS)")
    try:
        partitions = PartitionSet.parse(args.owned_partitions, total)
    except InvalidInput as e:
        flag = "--partitions" if e.where == "partitions" else "--owned-partitions"
        raise InvalidInput(e.message, flag) from None
    from services.platform.bus import NatsOptions

    max_age = _stream_age(args.events_max_age, "--events-max-age")
    history_age = _stream_age(args.usage_history_max_age, "--usage-history-max-age")
    sizes = contract.StreamSizes(
        **{
            name: contract.parse_size(getattr(args, f"{name}_max_bytes"), contract.StreamSizes.setting(name)[0])
            for name in SIZE_FLAGS
        }
    )
    replicas = _int(args.stream_replicas, "--stream-replicas (VMQUOTA_STREAM_REPLICAS)")
    if not 1 <= replicas <= 5:
        raise InvalidInput(f"must be 1 to 5 (JetStream's limit), got {replicas}", "--stream-replicas")
    consumer_check = contract.parse_duration(args.nats_consumer_check, "--nats-consumer-check")
    if consumer_check <= 0:
        raise InvalidInput("the consumer check interval must be positive", "--nats-consumer-check")
    if args.nats_user and args.nats_creds:
        raise InvalidInput("give either --nats-creds or --nats-user/--nats-password, not both", "--nats-creds")
    from services.platform.bus import check_nats_options
    from services.platform.logs import check_level

    check_nats_options(str(args.nats), args.nats_creds, args.nats_ca)
    check_level(args.log_level, "--log-level (VMQUOTA_LOG_LEVEL)")
    if (naming := naming_error(args.nats_user, args.nats_inbox_prefix)) is not None:
        raise InvalidInput(naming[1], naming[0])
    dry_run = args.dry_run if args.dry_run is not None else _env_bool("VMQUOTA_DRY_RUN", False)
    leader = args.leader_election if args.leader_election is not None else _env_bool("VMQUOTA_LEADER_ELECTION", True)
    guard = (
        args.reservation_guard if args.reservation_guard is not None else _env_bool("VMQUOTA_RESERVATION_GUARD", False)
    )
    if leader and {"watcher", "enforcer"} & set(names):  # (the services that take a Lease, for leader election)
        contract.check_namespace(args.lease_namespace, "--lease-namespace (VMQUOTA_LEASE_NAMESPACE)")
    creators = tuple(c.strip() for c in str(args.guard_creators).split(",") if c.strip())
    if guard and not creators:
        raise InvalidInput("--guard-creators (VMQUOTA_GUARD_CREATORS) names nobody", "--guard-creators")
    excluded = tuple(n.strip() for n in str(args.exclude_namespaces).split(",") if n.strip())
    resync = contract.parse_duration(args.resync_interval, "--resync-interval (VMQUOTA_RESYNC_INTERVAL)")
    refresh = contract.parse_duration(
        args.usage_refresh_interval, "--usage-refresh-interval (VMQUOTA_USAGE_REFRESH_INTERVAL)"
    )
    return Config(
        service=service,
        cluster=cluster,
        nats=NatsOptions(
            url=args.nats,
            creds=args.nats_creds,
            user=args.nats_user,
            password=args.nats_password,
            inbox_prefix=args.nats_inbox_prefix or None,
            ca=args.nats_ca,
            consumer_check=consumer_check,
            stream_sizes=sizes,
            stream_replicas=replicas,
        ),
        kubeconfig=args.kubeconfig,
        http_port=http_port,
        log_level=args.log_level,
        partitions=partitions,
        events_max_age=max_age,
        usage_history_max_age=history_age,
        dry_run=dry_run,
        leader_election=leader,
        lease_namespace=args.lease_namespace,
        identity=args.identity or socket.gethostname(),
        reservation_guard=guard,
        guard_creators=creators,
        exclude_namespaces=excluded,
        resync_interval=resync,
        usage_refresh_interval=refresh,
    )
