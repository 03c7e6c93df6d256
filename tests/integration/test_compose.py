"""compose.yaml: every service's command is a `vmquota` command line the CLI accepts, with environment variables
the runner reads and NATS credentials the NATS configuration knows; and the same stack, started as local processes
against a local nats-server (no Docker engine here), comes up healthy."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from services.cli.main import build_parser
from services.platform.bus import Bus, NatsOptions
from services.platform.config import PLANNED, SERVICES
from services.platform.identity import inbox_prefix
from shared import contract
from tests.conftest import nats_server_binary
from tests.exported import runner_env_vars

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
NATS_CONFIG = ROOT / "deploy" / "components" / "nats" / "nats-server.conf"
_DEFAULTED = re.compile(r"^\$\{(?P<var>[A-Z0-9_]+):-(?P<default>[^}]*)\}$")

Service = dict[str, Any]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def interpolate(value: object) -> str:
    """A compose value with ``${VAR:-default}`` resolved as compose would with VAR unset."""
    text = str(value)
    m = _DEFAULTED.match(text)
    if m:
        return m["default"]
    assert "${" not in text, f"only ${{VAR:-default}} interpolation is used: {text}"
    return text


def env_of(service: Service) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping"
    return {k: interpolate(v) for k, v in env.items()}


def vmquota_services() -> dict[str, Service]:
    images = ("vmquota:dev", "vmquota-devtools:dev")
    return {name: s for name, s in compose()["services"].items() if s.get("image") in images}


def test_services_and_image() -> None:
    services = compose()["services"]
    assert set(services) == {"nats", "simcluster", "watcher", "ledger", "enforcer"}
    for name, s in vmquota_services().items():
        target = "devtools" if name == "simcluster" else "product"
        assert s["build"] == {"context": ".", "target": target}, name
        assert s["read_only"] is True and "/tmp" in s["tmpfs"], name
        uid = s["user"].split(":")[0]
        dockerfile_user = next(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("USER "))
        assert dockerfile_user.split()[1].split(":")[0] == uid
    assert set(vmquota_services()) == {"simcluster", "watcher", "ledger", "enforcer"}


def test_the_product_image_is_the_default_target_and_leaves_the_development_tools_out() -> None:
    """``docker build .`` builds the last stage: the product, whose venv has no ``services/devtools``."""
    stages = [ln.split() for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("FROM ")]
    assert stages[-1][-2:] == ["AS", "product"] and ["AS", "devtools"] in [s[-2:] for s in stages]
    text = (ROOT / "Dockerfile").read_text()
    product_venv = text[text.index("AS venv-product") : text.index("AS venv-devtools")]
    assert "/devtools" in product_venv and "rm -rf" in product_venv and "[sim]" not in product_venv


def test_commands_parse_with_the_cli_and_env_is_what_the_runner_reads() -> None:
    parser = build_parser()
    known = runner_env_vars()
    for name, s in vmquota_services().items():
        args = parser.parse_args(s["command"])
        env = env_of(s)
        if name == "simcluster":
            assert args.command == "simulate"
            assert args.kubeconfig_out.startswith("/var/lib/vmquota/")
            assert not env
            continue
        assert (args.command, args.service) == ("run", name)
        assert set(env) <= known, f"{name}: variables the runner does not read: {set(env) - known}"
        if name in ("watcher", "enforcer"):
            contract.check_cluster(env["VMQUOTA_CLUSTER"])
            kubeconfig = env["VMQUOTA_KUBECONFIG"]
            sim_args = parser.parse_args(vmquota_services()["simcluster"]["command"])
            assert kubeconfig == sim_args.kubeconfig_out, "the simulator's kubeconfig"
            assert s["network_mode"] == "service:simcluster", "the kubeconfig says https://127.0.0.1:<port>"
        assert env["VMQUOTA_NATS"] == "nats://nats:4222"


def test_nats_users_passwords_and_health_checks_line_up() -> None:
    services = compose()["services"]
    nats_env = env_of(services["nats"])
    wanted = set(re.findall(r"\$(VMQUOTA_NATS_[A-Z]+_PASSWORD)", NATS_CONFIG.read_text()))
    assert set(nats_env) == wanted, "the server gets every password its configuration reads"
    assert "./deploy/components/nats/nats-server.conf:/etc/nats/nats-server.conf:ro" in services["nats"]["volumes"]
    assert services["nats"]["command"][:2] == ["-c", "/etc/nats/nats-server.conf"]
    published = {p.split(":")[0] for s in services.values() for p in s.get("ports", [])}
    http_ports = set()
    for name, s in vmquota_services().items():
        if name == "simcluster":
            continue
        env = env_of(s)
        assert env["VMQUOTA_NATS_USER"] == name
        assert env["VMQUOTA_NATS_PASSWORD"] == nats_env[f"VMQUOTA_NATS_{name.upper()}_PASSWORD"], name
        port = env["VMQUOTA_HTTP_PORT"]
        http_ports.add(port)
        assert f"http://127.0.0.1:{port}/healthz" in " ".join(s["healthcheck"]["test"]), name
        assert port in published, f"{name}'s health port is published"
        for dep in s["depends_on"]:
            assert s["depends_on"][dep]["condition"] == "service_healthy"
    assert len(http_ports) == 3, "services sharing a network namespace need distinct ports"


# ---- the stack as local processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Stack:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: dict[str, int] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            cmd, env={**os.environ, **env}, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGTERM in reverse start order (services before the bus they drain to), as compose stops them."""
        for name, proc in reversed(self.procs.items()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.stopped[name] = proc.returncode
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def wait_for(what: str, check: Any, procs: list[subprocess.Popen[bytes]], stack: Stack, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        for name, p in stack.procs.items():
            if p in procs and p.poll() is not None:
                pytest.fail(f"{name} exited with {p.returncode} while waiting for {what}:\n{stack.log(name)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def http_ok(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            body: bytes = resp.read()
            return body if resp.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


async def create_streams(url: str, user: str, password: str) -> None:
    b = await Bus.connect(NatsOptions(url=url, user=user, password=password), connect_timeout=10)
    try:
        await b.ensure_streams(contract.streams_for(user))
    finally:
        await b.close()


def test_the_compose_stack_starts_as_local_processes(stack: Stack, tmp_path: Path) -> None:
    """Each compose service as a local process with the compose command and environment; only addresses and paths
    are mapped (NATS URL, kubeconfig path, health ports), as the containers' network and volumes would."""
    services = compose()["services"]
    missing = [n for n in PLANNED if n not in SERVICES]

    # nats: the same configuration file and passwords
    ports_dir = tmp_path / "ports"
    ports_dir.mkdir()
    nats_env = env_of(services["nats"])
    nats_cmd = [
        nats_server_binary(),
        "-c",
        str(NATS_CONFIG),
        "-a",
        "127.0.0.1",
        "-p",
        "-1",
        "-sd",
        str(tmp_path / "js"),
    ]
    nats_proc = stack.start("nats", [*nats_cmd, "--ports_file_dir", str(ports_dir)], nats_env)
    ports_file = ports_dir / f"nats-server_{nats_proc.pid}.ports"

    def nats_url() -> str | None:
        try:
            url: str = json.loads(ports_file.read_text())["nats"][0]
            return url
        except (OSError, json.JSONDecodeError, KeyError, IndexError):
            return None

    url = wait_for("nats-server", nats_url, [nats_proc], stack)

    # simcluster: the compose command, with a free port and a local path for the kubeconfig
    cli = [sys.executable, "-m", "services.cli.main"]
    sim_cmd = list(services["simcluster"]["command"])
    kubeconfig = tmp_path / "state" / "kubeconfig"
    kubeconfig.parent.mkdir()  # (the volume compose mounts there)
    sim_cmd[sim_cmd.index("--port") + 1] = "0"
    assert sim_cmd[sim_cmd.index("--host") + 1] == "0.0.0.0", "the published port needs a wildcard bind"
    sim_cmd[sim_cmd.index("--host") + 1] = "127.0.0.1"
    assert "--example" in sim_cmd, "compose starts with the example tenant, as vmquota up --example"
    sim_cmd[sim_cmd.index("--kubeconfig-out") + 1] = str(kubeconfig)
    sim = stack.start("simcluster", [*cli, *sim_cmd, "--log-level", "warning"], {})
    assert sim.stdout is not None
    ready, _, _ = select.select([sim.stdout], [], [], 60)  # (a simulator that never serves fails, not hangs)
    line = sim.stdout.readline() if ready else b""  # the simulator prints one JSON line when it serves
    assert line, f"simcluster printed nothing:\n{stack.log('simcluster')}"
    assert json.loads(line)["kubeconfig"] == str(kubeconfig) and kubeconfig.stat().st_size > 0
    kc = yaml.safe_load(kubeconfig.read_text())
    assert kc["clusters"][0]["cluster"]["server"].startswith("https://127.0.0.1:")

    if "ledger" in missing:  # the ledger keeps every stream (STREAM_KEEPER); stand in for it until it lands
        asyncio.run(create_streams(url, "ledger", nats_env["VMQUOTA_NATS_LEDGER_PASSWORD"]))

    started: dict[str, int] = {}
    for name in ("watcher", "ledger", "enforcer"):
        if name in missing:
            continue
        env = env_of(services[name])
        env["VMQUOTA_NATS"] = url
        if "VMQUOTA_KUBECONFIG" in env:
            env["VMQUOTA_KUBECONFIG"] = str(kubeconfig)
        started[name] = free_port()
        env["VMQUOTA_HTTP_PORT"] = str(started[name])
        stack.start(name, [*cli, *services[name]["command"]], env)

    procs = list(stack.procs.values())
    for name, port in started.items():
        wait_for(f"{name} /healthz", lambda p=port: http_ok(f"http://127.0.0.1:{p}/healthz"), procs, stack)
        wait_for(f"{name} /readyz", lambda p=port: http_ok(f"http://127.0.0.1:{p}/readyz"), procs, stack)
        metrics = wait_for(f"{name} /metrics", lambda p=port: http_ok(f"http://127.0.0.1:{p}/metrics"), procs, stack)
        assert b"vmquota_" in metrics

    async def streams_present() -> set[str]:
        nc = await nats.connect(
            url, user="replay", password=nats_env["VMQUOTA_NATS_REPLAY_PASSWORD"], inbox_prefix=inbox_prefix("replay")
        )
        try:
            return {str(info.config.name) for info in await nc.jetstream().streams_info()}
        finally:
            await nc.close()

    # every started service connected as its own user, and the ledger created every stream
    want = set().union(*(contract.STREAM_OWNERS.get(n, frozenset()) for n in started))
    wait_for("streams", lambda: want <= asyncio.run(streams_present()), procs, stack)
    if "watcher" in started:  # the watcher lists the simulated cluster and publishes under its cluster id

        async def demo_events() -> int:
            nc = await nats.connect(
                url,
                user="replay",
                password=nats_env["VMQUOTA_NATS_REPLAY_PASSWORD"],
                inbox_prefix=inbox_prefix("replay"),
            )
            try:
                cluster = env_of(services["watcher"])["VMQUOTA_CLUSTER"]
                info = await nc.jetstream().stream_info(
                    contract.EVENTS_STREAM, subjects_filter=contract.events_filter(cluster)
                )
                return len(info.state.subjects or {})
            finally:
                await nc.close()

        wait_for("the watcher's events", lambda: asyncio.run(demo_events()) > 0, procs, stack)

    if {"watcher", "ledger", "enforcer"} <= set(started):  # the guide's `vmquota status`, as the operators' user

        def example_in_status() -> bool:
            try:
                status = subprocess.run(
                    [*cli, "status", "-o", "json", "--nats", url, "--nats-user", "replay", "--nats-password",
                     nats_env["VMQUOTA_NATS_REPLAY_PASSWORD"]],
                    capture_output=True, text=True, timeout=30, check=False,
                )  # fmt: skip
            except subprocess.TimeoutExpired:  # (a loaded machine: asked again)
                return False
            rows = json.loads(status.stdout)["quotas"] if status.returncode == 0 else []
            return any(r["namespace"] == "tenant-a" and r["name"] == "vm-size" for r in rows)

        wait_for("the example tenant in vmquota status", example_in_status, procs, stack, timeout=90)
    assert all(p.poll() is None for p in procs), "every process still runs"
    if missing:
        pytest.skip(f"started nats, simcluster and {', '.join(started)}; not yet in the runner: {', '.join(missing)}")
