"""Every entry point, given input a person got wrong, says so in one line on stderr (which flag, what to do) and
exits non-zero: 2 for a bad input, 1 for something unreachable. Never a traceback, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

UNREACHABLE_NATS = "nats://127.0.0.1:1"


def _files(tmp: Path) -> dict[str, str]:
    (tmp / "bad_yaml").write_text("garbage: [\n")
    (tmp / "not-a-kubeconfig").write_text("just: text\n")
    (tmp / "no-context").write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\n")
    (tmp / "theirs").write_text("apiVersion: v1\nkind: Config\ncurrent-context: prod\nclusters: []\n")
    (tmp / "deep").write_text("[" * 100_000 + "]" * 100_000)  # (past any parser's recursion)
    (tmp / "junk").write_bytes(bytes(range(256)))
    (tmp / "empty").write_text("")
    (tmp / "listed-metadata").write_text("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: [1]\n")
    (tmp / "long-number").write_text("memory: " + "1" * 5000 + "\n")
    (tmp / "long-number-json").write_text('{"memory": ' + "1" * 5000 + "}\n")
    (tmp / "long-hex").write_text("metadata: {name: ns1, labels: {a: 0x" + "f" * 4000 + "}}\nkind: Namespace\n")
    (tmp / "bad-tag").write_text("kind: Namespace\nmetadata: {name: ns1, annotations: {a: !!timestamp 2024-02-30}}\n")
    (tmp / "bad-int").write_text("kind: Namespace\nmetadata: {name: ns1, annotations: {a: !!int abc}}\n")
    (tmp / "bad-bool").write_text("kind: Namespace\nmetadata: {name: ns1, annotations: {a: !!bool abc}}\n")
    (tmp / "bad-stamp").write_text('{"kind": "Namespace", a: !!timestamp abc}\n')
    (tmp / "kc-float").write_text("clusters: !!float abc\n")
    (tmp / "kc-long").write_text("x: " + "1" * 5000 + "\n")
    (tmp / "listed-items").write_text("kind: PodList\nitems: [5]\n")
    (tmp / "odd-names").write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: 5, namespace: [x]}\n")
    names = ["bad_yaml", "not-a-kubeconfig", "no-context", "theirs", "deep", "junk", "empty", "listed-metadata"]
    names += [
        "odd-names",
        "listed-items",
        "long-number",
        "long-number-json",
        "long-hex",
        "bad-tag",
        "bad-int",
        "bad-bool",
        "bad-stamp",
    ]
    names += ["kc-float", "kc-long"]
    return {k: str(tmp / k) for k in names}


# (argv with {file} placeholders, exit code, a phrase the line must hold)
CASES: list[tuple[list[str], int, str]] = [
    (["run", "watcher", "--cluster", "c1", "--kubeconfig", "{bad_yaml}"], 2, "bad_yaml: invalid YAML (line 2)"),
    (["run", "watcher", "--cluster", "c1", "--kubeconfig", "{missing}"], 2, "no such file"),
    (["run", "enforcer", "--cluster", "c1", "--kubeconfig", "{not-a-kubeconfig}"], 2, "is not a kubeconfig"),
    (["run", "all", "--cluster", "c1", "--kubeconfig", "{no-context}"], 2, "current-context"),
    (["run", "enforcer", "--cluster", "c1"], 2, "give a kubeconfig file"),
    (["run", "watcher", "--kubeconfig", "{no-context}"], 2, "--cluster (VMQUOTA_CLUSTER) is required"),
    (["run", "ledger", "--http-port", "70000"], 2, "is not a port number"),
    (["run", "ledger", "--partitions", "many"], 2, "--partitions"),
    (["run", "ledger", "--events-max-age", "forever"], 2, "--events-max-age"),
    (["run", "ledger", "--events-max-age", "50ms"], 2, "--events-max-age: '50ms' is shorter than a minute"),
    (["run", "ledger", "--usage-history-max-age", "30s"], 2, "'30s' is shorter than a minute"),
    (["run", "nothing"], 2, "unknown service 'nothing'"),
    (["run", "ledger", "--owned-partitions", "9-3"], 2, "partition range '9-3' runs backwards (e.g. 3-9)"),
    (["render", "-f", "x", "--mode", "y"], 2, "vmquota render: unrecognized arguments: --mode y (see vmquota render"),
    (["demo", "--speed", "0"], 2, "--speed: must be between"),
    (["demo", "--scenario-file", "{missing}"], 2, "missing"),
    (["demo", "--scenario-file", "{bad_yaml}"], 2, "bad_yaml"),
    (["simulate", "--speed", "0"], 2, "--speed: must be between"),
    (["simulate", "--speed", "1e400"], 2, "--speed: must be between"),
    (["simulate", "--kubevirt-version", "v9"], 2, "--kubevirt-version: unsupported KubeVirt version 'v9'"),
    (["simulate", "--seed-file", "{junk}"], 2, "is not UTF-8 text"),
    (["simulate", "--seed-file", "{deep}"], 2, "nested too deeply"),
    (["demo", "--scenario-file", "{junk}"], 2, "is not UTF-8 text"),
    (["demo", "--scenario-file", "{deep}"], 2, "nested too deeply"),
    (["demo", "--scenario-file", "{empty}"], 2, "the file is empty"),
    (["demo", "--log-level", "trace"], 2, "vmquota demo: --log-level: 'trace' is not a log level"),
    (["simulate", "--log-level", "error", "--seed-file", "{listed-metadata}"], 2, "metadata: Invalid value"),
    (["simulate", "--log-level", "error", "--seed-file", "{odd-names}"], 2, "metadata.name: Invalid"),
    (["simulate", "--log-level", "error", "--seed-file", "{listed-items}"], 2, "an item of a PodList is not"),
    (["run", "ledger", "--events-max-bytes", "99999999Ti"], 2, "is more than a stream's limit holds"),
    (["run", "watcher", "--cluster", "c1", "--lease-namespace", "Bad NS"], 2, "namespace 'Bad NS' is not a DNS label"),
    (["render", "-f", "{deep}"], 2, "nested too deeply"),
    (["render", "-f", "{empty}"], 2, "nothing to render"),
    (["render", "-f", "{bad-bool}"], 2, "invalid YAML: 'abc'"),
    (["render", "-f", "{bad-stamp}"], 2, "document 1: invalid JSON"),
    (["run", "watcher", "--cluster", "c1", "--kubeconfig", "{kc-float}"], 2, "could not convert string to float"),
    (["run", "watcher", "--cluster", "c1", "--kubeconfig", "{kc-long}"], 2, "a number of more than 4,300 digits"),
    (["render", "-f", "{bad-tag}"], 2, "invalid YAML: day is out of range for month"),
    (["simulate", "--log-level", "error", "--seed-file", "{bad-int}"], 2, "(line 2): not an integer: 'abc'"),
    (["render", "-f", "{long-number}"], 2, "invalid YAML (line 1): a number of more than 4,300 digits (quote it)"),
    (["simulate", "--log-level", "error", "--seed-file", "{long-hex}"], 2, "(line 1): a number of more than 4,300 dig"),
    (["usage", "-f", "{long-number-json}"], 2, "invalid JSON: a number of more than 4,300 digits (quote it)"),
    (["render", "-f", "{empty}", "--quota-has", "limits.memroy"], 2, "--quota-has: 'limits.memroy' is not a resource"),
    (["usage", "-f", "{deep}"], 2, "nested too deeply"),
    (["render", "-f", "-", "--cpu-allocation-ratio", "1e400"], 2, "must be between 0.001 and 1000, got '1e400'"),
    (["render", "-f", "-", "--cpu-allocation-ratio", "1e-400"], 2, "must be between 0.001 and 1000"),
    (["run", "ledger", "--nats", "notaurl::"], 2, "'notaurl::' is not a NATS URL"),
    (["run", "ledger", "--nats-ca", "{missing}"], 2, "--nats-ca (VMQUOTA_NATS_CA): no such file"),
    (["run", "ledger", "--nats-ca", "{bad_yaml}"], 2, "is not a PEM CA bundle"),
    (["run", "ledger", "--nats-creds", "{missing}"], 2, "--nats-creds (VMQUOTA_NATS_CREDS): no such file"),
    (["run", "ledger", "--nats-creds", "{bad_yaml}"], 2, "is not a NATS credentials file"),
    (["run", "ledger", "--log-level", "chatty"], 2, "'chatty' is not a log level"),
    (["run", "ledger", "--events-max-age", "1e400"], 2, "longer than 100 years"),
    (["status", "--nats", "notaurl::"], 2, "is not a NATS URL"),
    (["status", "--cluster", "BAD_", "--nats", UNREACHABLE_NATS], 2, "vmquota status: --cluster: cluster id 'BAD_'"),
    (["run", "watcher", "--cluster", "c1", "--kubeconfig", "{junk}"], 2, "junk is not UTF-8 text (not a kubeconfig)"),
    (["status", "--nats-creds", "{missing}", "--nats", UNREACHABLE_NATS], 2, "no such file"),
    (["tail", "--no-follow", "--since", "1e400", "--nats", UNREACHABLE_NATS], 2, "--since"),
    (["replay", "--at", "1e400", "--nats", UNREACHABLE_NATS], 2, "--at"),
    (["up", "--nats-port", "0", "--speed", "1e400"], 2, "--speed"),
    (["up", "--nats-port", "0", "--log-level", "chatty"], 2, "is not a log level"),
    (["simulate", "--seed-file", "{missing}"], 2, "missing"),
    (["simulate", "--port", "70000"], 2, "--port"),
    (["usage", "--mode", "Bogus", "-f", "{bad_yaml}"], 2, "Bogus"),
    (["usage", "--mode", "VirtualResourcesWithCPUAllocationRatio", "--cpu-allocation-ratio", "0", "-f", "-"], 2,
     "--cpu-allocation-ratio: must be greater than 0"),
    (["render", "-f", "{missing}"], 2, "missing"),
    (["status", "--nats", UNREACHABLE_NATS], 1, "check --nats (VMQUOTA_NATS)"),
    (["tail", "--since", "yesterday-ish", "--nats", UNREACHABLE_NATS], 2, "--since"),
    (["replay", "--at", "noon-ish", "--nats", UNREACHABLE_NATS], 2, "--at"),
    (["explain", "migration", "no-slash", "--nats", UNREACHABLE_NATS], 2, "expected NAMESPACE/NAME"),
    (["explain", "vm", "tenant-a/vm1", "--nats", UNREACHABLE_NATS], 1, "check --nats (VMQUOTA_NATS)"),
    (["explain", "vm", "a/v", "--cluster", "BAD_"], 2, "vmquota explain: --cluster: cluster id 'BAD_' is not"),
    (["replay", "--at", "9999-12-31", "--nats", UNREACHABLE_NATS], 2, "--at: '9999-12-31' is in the future"),
    (["usage", "-f", "{missing}", "-n", "Bad_NS"], 2, "-n/--namespace: namespace 'Bad_NS' is not a DNS label"),
    (["up", "--nats-port", "70000"], 2, "--nats-port: must be a port number"),
    (["up", "--nats-port", "0", "--kubeconfig-out", "{theirs}"], 2, "is not a kubeconfig vmquota wrote"),
    (["up", "--nats-port", "0", "--speed", "0"], 2, "--speed"),
    (["render", "-f", "/dev/zero"], 2, "/dev/zero: is larger than 256 MiB"),  # (read to a bound, not to the end)
    (["run", "watcher", "--cluster", "c1", "--kubeconfig", "/dev/zero"], 2, "/dev/zero is larger than 16 MiB"),
    (["run", "ledger", "--nats-creds", "/dev/zero"], 2, "/dev/zero is larger than 16 MiB"),
    (["simulate", "--kubeconfig-out", "{theirs}"], 2, "is not a kubeconfig vmquota wrote"),
    (["simulate", "--kubeconfig-out", "{missing}/kc"], 2, "--kubeconfig-out: the folder"),
    (["status", "--nats-ca", "{missing}", "--nats", UNREACHABLE_NATS], 2, "--nats-ca (VMQUOTA_NATS_CA): no such file"),
    (["simulate", "--memory-overcommit", "nan"], 2, "invalid int value: 'nan' (see vmquota simulate --help)"),
    (["render", "--arch"], 2, "vmquota render: argument --arch: expected one argument"),
    ([], 2, "the following arguments are required: COMMAND"),
]  # fmt: skip


def _run(argv: list[str], cwd: Path, *, entry: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command line ``argv`` as a person runs it (``entry``: how the program is started, ``vmquota`` by
    default), without the environment's vmquota settings; no input."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VMQUOTA_", "KUBERNETES_"))}
    start = entry or ["-m", "services.cli.main"]
    return subprocess.run(
        [sys.executable, *start, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        cwd=cwd,
        input="",
    )


@pytest.mark.parametrize(("argv", "code", "phrase"), CASES, ids=[" ".join(c[0][:3]) or "(none)" for c in CASES])
def test_a_bad_input_is_one_line_and_an_exit_code(tmp_path: Path, argv: list[str], code: int, phrase: str) -> None:
    files = {**_files(tmp_path), "missing": str(tmp_path / "missing")}
    args = [a.format(**files) if a.startswith("{") else a for a in argv]
    proc = _run(args, tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == code, f"exit {proc.returncode}, stderr: {err[-2000:]}"
    assert "Traceback" not in err and len(err.splitlines()) == 1, f"not one line:\n{err[-2000:]}"
    assert phrase in err, err
    assert not proc.stdout.strip() or proc.returncode == 0, proc.stdout[-500:]


@pytest.mark.parametrize("argv", [["demo"], ["simulate"], ["up", "--nats-port", "0"]], ids=lambda a: a[0])
def test_a_missing_extra_is_one_line_with_the_install_line(tmp_path: Path, argv: list[str]) -> None:
    """The plain install (no ``sim`` extra) runs the commands that need the simulated cluster only far enough to
    say which install line adds what they need."""
    proc = without(
        "cryptography",
        [*argv, *(["--kubeconfig-out", str(tmp_path / "kc")] if argv[0] == "up" else [])],
        tmp_path,
    )
    err = proc.stderr.strip()
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert err.startswith(f"vmquota {argv[0]}: ") and "pip install 'vmquota[sim]'" in err, err


def without(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``vmquota ARGV`` in a process where ``module`` cannot be imported: a plain install without the ``sim`` extra
    (``cryptography``), or the production image (``services.devtools``)."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; from services.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, check=False, cwd=cwd
    )


@pytest.mark.parametrize("argv", [["demo"], ["simulate"], ["up", "--example"]], ids=lambda a: a[0])
def test_without_the_devtools_a_development_command_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    proc = without("services.devtools", argv, tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert err.startswith(f"vmquota {argv[0]}: is a development tool"), err


def test_without_the_devtools_the_product_commands_and_the_help_work(tmp_path: Path) -> None:
    for argv, phrase in ((["--help"], "usage: vmquota"), (["run", "--help"], "usage: vmquota run")):
        proc = without("services.devtools", argv, tmp_path)
        assert proc.returncode == 0 and phrase in proc.stdout, proc.stderr[-2000:]


def test_the_version_is_the_packages() -> None:
    """An operator upgrading needs to know which release runs: ``vmquota --version`` says the installed one."""
    from importlib.metadata import version

    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"vmquota {version('vmquota')}", proc


def test_an_http_port_in_use_is_one_line(tmp_path: Path) -> None:
    """`vmquota run watcher` and `vmquota run ledger` both default to port 8080: the second one started on a host
    printed an `OSError` traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _run(["run", "ledger", "--nats", UNREACHABLE_NATS, "--http-port", str(port)], tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert err.startswith(f"vmquota run: --http-port (VMQUOTA_HTTP_PORT): cannot listen on 0.0.0.0:{port} ("), err


def test_ctrl_c_while_the_modules_load_is_exit_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the first moments, while a command's modules were still being imported, printed a
    KeyboardInterrupt traceback: only the command's run caught it."""
    from services.cli import main as cli

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["status"])
    except KeyboardInterrupt:  # (caught here: one escaping would stop the test session)
        pytest.fail("KeyboardInterrupt escaped main()")
    assert code == 130


def test_a_command_run_as_kubectl_vmquota_says_so_in_its_errors(tmp_path: Path) -> None:
    """kubectl runs ``kubectl-vmquota`` for ``kubectl vmquota``: the bus commands' errors began ``vmquota status:``."""
    kubectl = ["-c", "import sys; from services.cli.main import kubectl_main; sys.exit(kubectl_main())"]
    proc = _run(["status", "--nats", UNREACHABLE_NATS], tmp_path, entry=kubectl)
    assert proc.returncode == 1 and proc.stderr.startswith("kubectl vmquota status: cannot reach NATS"), proc.stderr
