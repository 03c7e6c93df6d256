"""``vmquota simulate``: run a simulated KubeVirt cluster (API server, quota, KubeVirt controllers) until interrupted.

Prints one JSON line on stdout with the server URL and the kubeconfig path, e.g.
``{"url": "https://127.0.0.1:41234", "kubeconfig": "./simcluster.kubeconfig"}``; then ``kubectl
--kubeconfig <path> get vmis -A`` works against it. Bad input (seed file, options) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

from services.devtools.simcluster.cluster import DEFAULT_KUBEVIRT_VERSION, SimCluster, load_seed_file
from services.devtools.simcluster.kubeconfig import check_kubeconfig_out
from services.devtools.speed import check_speed
from services.platform.logs import check_level, configure, get_logger
from shared.errors import InvalidInput
from shared.kubevirt.config import profile
from shared.quantity import Quantity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free port)")
    parser.add_argument("--kubeconfig-out", metavar="PATH", help="write the kubeconfig here (default: a temp file)")
    parser.add_argument(
        "--speed", type=float, default=1.0, help="multiply every controller delay by this (0.1: ten times faster)"
    )
    parser.add_argument("--seed-file", metavar="PATH", action="append", default=[], help="YAML objects to preload")
    parser.add_argument(
        "--example", action="store_true", help="preload the example tenant of vmquota up --example (tenant-a)"
    )
    parser.add_argument("--kubevirt-version", default=DEFAULT_KUBEVIRT_VERSION, help="status.observedKubeVirtVersion")
    parser.add_argument("--cpu-allocation-ratio", type=float, help="developerConfiguration.cpuAllocationRatio")
    parser.add_argument("--memory-overcommit", type=int, help="developerConfiguration.memoryOvercommit (percent)")
    parser.add_argument("--nodes", default="node01,node02,node03", help="comma-separated simulated node names")
    parser.add_argument(
        "--extra-memory-overhead",
        metavar="QUANTITY",
        help="memory every launcher pod gets on top of the rendered overhead (simulates drift), e.g. 64Mi",
    )
    parser.add_argument("--token", help="bearer token clients must send (default: random)")
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error (default info)")


def _options(args: argparse.Namespace) -> dict[str, object]:
    check_speed(args.speed)
    check_level(args.log_level)
    try:
        profile(args.kubevirt_version)  # (the simulated KubeVirt renders its pods as that release does)
    except InvalidInput as e:
        raise InvalidInput(e.message, "--kubevirt-version") from None
    if not 0 <= args.port <= 65535:
        raise InvalidInput(f"must be a port number, got {args.port}", "--port")
    nodes = [n.strip() for n in str(args.nodes).split(",") if n.strip()]
    if not nodes:
        raise InvalidInput("needs at least one node name", "--nodes")
    dev: dict[str, object] = {}
    if args.cpu_allocation_ratio is not None:
        if args.cpu_allocation_ratio <= 0:
            raise InvalidInput(f"must be greater than 0, got {args.cpu_allocation_ratio}", "--cpu-allocation-ratio")
        ratio = args.cpu_allocation_ratio
        dev["cpuAllocationRatio"] = int(ratio) if float(ratio).is_integer() else ratio
    if args.memory_overcommit is not None:
        if args.memory_overcommit <= 0:
            raise InvalidInput(f"must be greater than 0, got {args.memory_overcommit}", "--memory-overcommit")
        dev["memoryOvercommit"] = args.memory_overcommit
    kubeconfig = None
    if args.kubeconfig_out:
        kubeconfig = Path(args.kubeconfig_out).resolve()
        check_kubeconfig_out(kubeconfig)
    extra = None
    if args.extra_memory_overhead is not None:
        try:
            extra = Quantity.parse(args.extra_memory_overhead)
        except InvalidInput as e:
            raise e.at("--extra-memory-overhead") from None
    return {
        "speed": args.speed,
        "host": args.host,
        "port": args.port,
        "token": args.token,
        "kubeconfig_path": kubeconfig,
        "kubevirt_version": args.kubevirt_version,
        "developer_configuration": dev or None,
        "nodes": nodes,
        "extra_memory_overhead": extra,
    }


async def _serve(args: argparse.Namespace) -> int:
    options = _options(args)
    seeds = [doc for path in args.seed_file for doc in load_seed_file(path)]
    if args.example:
        from services.devtools.demo.example import example_documents

        seeds = example_documents() + seeds
    sim = SimCluster(**options)  # type: ignore[arg-type]
    try:
        await sim.start()
    except OSError as e:
        raise InvalidInput(f"cannot listen on {args.host}:{args.port}: {e.strerror}", "--host/--port") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if seeds:
            await sim.seed(seeds)
        print(json.dumps({"url": sim.url, "kubeconfig": str(sim.kubeconfig_path)}), flush=True)
        get_logger(component="simulate").info("serving", url=sim.url, speed=sim.speed)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await sim.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    configure(args.log_level)
    try:
        return asyncio.run(_serve(args))
    except InvalidInput as e:
        print(f"vmquota simulate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        return 130
