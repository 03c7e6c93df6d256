"""The operator commands (``vmquota status``, ``tail``, ``replay``) as a person runs them: separate processes
against a real nats-server after a real pipeline played seed scenario 1 (a migration at full quota)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

import nats
import nkeys  # type: ignore[import-untyped]
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from services.devtools.natsserver import NatsServer
from services.platform.bus import Bus, NatsOptions, position
from shared import contract, report
from tests import builders
from tests.integration.e2e import CLUSTER, forged_refusal, full_namespace, pipeline, rl

pytestmark = pytest.mark.integration

NS = "tenant-a"


async def vmquota(*args: str, within: float = 60.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli.main", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), within)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def stored_time(url: str, seq: int) -> str:
    """When the events stream stored message ``seq``, in RFC 3339 with nanoseconds."""
    nc = await nats.connect(url)
    try:
        sub = await nc.jetstream().subscribe(
            "vmquota.ev.>",
            stream=contract.EVENTS_STREAM,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq),
        )
        m = await sub.next_msg(timeout=10)
        await sub.unsubscribe()
    finally:
        await nc.close()
    ns = position(m).time_ns
    return datetime.fromtimestamp(ns // 10**9, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ns % 10**9:09d}Z"


async def test_status_tail_and_replay_after_a_migration_at_full_quota() -> None:
    async with pipeline() as p:
        await full_namespace(p, NS)
        url = p.stack.nats.url
        name = await p.migrate(NS, "vm1")
        await p.wait(lambda: any(d.reason.endswith("for the migration of vm1") for d in p.tap.decisions), "raise")
        raised = next(d for d in p.tap.decisions if d.reason.endswith("for the migration of vm1"))

        # status while the migration's raise may still be in place, then once it is over
        await p.wait_migrated(NS, "vm1", name)
        await p.wait_hard(NS, "compute", rl({"limits.memory": "64Gi"}), "hard back to the budget")
        await p.wait(lambda: any(d.reason.startswith("lowered") for d in p.tap.decisions), "the lowering")
        code, out, err = await vmquota("status", "--nats", url, "-o", "json")
        assert code == 0, err
        (row,) = json.loads(out)["quotas"]
        terms = p.tap.terms(NS, "compute")
        assert terms is not None
        assert (row["cluster"], row["namespace"], row["name"], row["mode"]) == (CLUSTER, NS, "compute", terms.mode)
        assert row["budget"] == {"limits.memory": "64Gi"} and row["used"] == terms.used
        assert row["pods"] == terms.pods and row["reserved"] == terms.reserved
        assert row["hard"] == {"limits.memory": "64Gi"} and row["raisedFor"] == []
        running = sum(1 for v in p.tap.usage[NS].vms if v.state == "running")
        assert running >= 3 and row["vms"] == {"running": running, "admitted": 0, "refused": 0}
        assert row["status"] == "ok"
        code, out, err = await vmquota("status", "--nats", url, "-n", "no-such-namespace")
        assert code == 1 and out == "" and err == "vmquota status: no managed quota matches */no-such-namespace\n"
        # a namespace whose only managed quota vmquota refuses has no row: the line says why
        await p.managed_quota("tenant-bogus", "vm-budget", {"limits.memory": "8Gi"}, mode="Bogus", wait=False)
        await p.wait(lambda: bool((u := p.tap.usage.get("tenant-bogus")) and u.errors), "the refused quota's usage")
        code, out, err = await vmquota("status", "--nats", url, "-n", "tenant-bogus")
        assert code == 1 and out == "" and len(err.splitlines()) == 1, err
        assert err.startswith("vmquota status: no managed quota in force in */tenant-bogus: ") and "Bogus" in err, err
        assert err.count("ResourceQuota tenant-bogus/vm-budget") == 1, f"the quota named once: {err}"
        code, out, err = await vmquota("status", "--nats", url)
        used = report.readable_list(terms.used)["limits.memory"]
        assert code == 0 and f"limits.memory {used}/64Gi" in out and "tenant-a" in out, out
        assert out.splitlines()[0].split()[-2:] == ["AGE", "STATUS"], out
        # without a filter, a quota opted in and refused has no row either: it is named on stderr, not left out
        assert err.startswith("refused: ResourceQuota tenant-bogus/vm-budget: not managed: ") and "Bogus" in err, err

        # tail: the decisions as lines, oldest first
        code, out, err = await vmquota("tail", "--nats", url, "--no-follow", "-n", NS)
        assert code == 0, err
        lines = out.splitlines()
        # dead letters: malformed events on the events stream, as the ledger rejected them; the second one's reason
        # quotes a value that would clear the operator's screen
        nc = await nats.connect(url)
        try:
            await nc.jetstream().publish(f"vmquota.ev.{CLUSTER}.{NS}.pod", b'{"type": "upserted", "kind": 5}')
            await nc.jetstream().publish(f"vmquota.ev.{CLUSTER}.{NS}.vmi", b'{"type": "\\u001b[2J"}')
        finally:
            await nc.close()
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            code, out, err = await vmquota("tail", "--nats", url, "--no-follow", "--dead-letters")
            assert code == 0, err
            if len(out.splitlines()) >= 2 or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.2)  # (polling a separate process's view, with a deadline)
        dead, hostile = out.splitlines()
        assert (
            "dead letter from the ledger: event: invalid event" in dead
            and f"(was vmquota.ev.{CLUSTER}.{NS}.pod" in dead
        )
        assert "\x1b" not in out and "Invalid value '\\x1b[2J'" in hostile, hostile
        # and into a reader that goes away early (`| head`): quiet
        command = f"{sys.executable} -m services.cli.main tail --nats {url} --no-follow --events -o json"
        proc = await asyncio.create_subprocess_shell(
            f"{command} | head -c 100 >/dev/null", stderr=asyncio.subprocess.PIPE
        )
        _, piped = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0 and piped.decode() == "", piped.decode()
        assert any(raised.reason in line for line in lines), lines
        assert all(line.split()[1] == CLUSTER and f"{NS}/compute" in line for line in lines)

        # replay: the hard the enforcer wrote, re-derived from the events alone, at every decision
        code, out, err = await vmquota("replay", "--nats", url, "--verify", "-o", "json", "-q")
        assert code == 0, out + err
        result = json.loads(out)
        assert result["verify"]["differences"] == [] and result["verify"]["decisions"] >= 2, result["verify"]
        # (the usage history misses a snapshot replaced within milliseconds, before the server copied it: at least
        # the one that raised hard and the one that lowered it are there)
        assert result["verify"]["usage"] >= 2, "every published usage snapshot re-derived from the events"
        assert result["events"] > 0 and [q["hard"] for q in result["quotas"]] == [{"limits.memory": "64Gi"}]
        # and in the middle of the migration: --until-seq the raise's usage gives the raised hard
        code, out, err = await vmquota("replay", "--nats", url, "--until-seq", str(raised.usage_seq), "-o", "json")
        assert code == 0, err
        assert [q["hard"] for q in json.loads(out)["quotas"]] == [raised.hard_after]
        at = await stored_time(url, raised.usage_seq)
        # as of the time that event was stored (it read as now); with --verify, what was computed from the events
        # up to there (every later decision and snapshot was compared with the state there: differences, exit 1)
        code, out, err = await vmquota(
            "replay", "--nats", url, "--until-seq", str(raised.usage_seq), "--verify", "-o", "json", "-q"
        )
        assert code == 0, out + err
        result = json.loads(out)
        assert result["verify"]["differences"] == [] and result["verify"]["decisions"] >= 1, result["verify"]
        assert result["at"] == at[:19] + "Z", (result["at"], at)
        code, out, err = await vmquota("replay", "--nats", url, "--until-seq", "1000000")
        assert code == 2 and out == "" and "is past the events stream's last" in err, err
        # --at the time the events stream stored that event (to the nanosecond, as `tail --events` shows it): the
        # same; the command stops reading early and says nothing on stderr
        code, out, err = await vmquota("replay", "--nats", url, "--at", at, "-o", "json", "-q")
        assert code == 0 and err == "", err
        assert [q["hard"] for q in json.loads(out)["quotas"]] == [raised.hard_after], at
        code, out, err = await vmquota("replay", "--nats", url, "--at", "2001-01-01T00:00:00Z")
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith("vmquota replay: --at: 2001-01-01T00:00:00+00:00 is before the retained history"), err

        # explain: the migration's timeline from the streams alone, in time order
        code, out, err = await vmquota("explain", "migration", f"{NS}/{name}", "--nats", url, "-o", "json")
        assert code == 0, err
        timeline = json.loads(out)
        assert (timeline["kind"], timeline["namespace"], timeline["name"]) == ("migration", NS, name)
        steps = [s["step"] for s in timeline["steps"]]
        for step in ("created", "seen", "target-refused", "raised", "target-admitted", "succeeded", "lowered"):
            assert step in steps, (step, timeline["steps"])
        assert steps.index("target-refused") < steps.index("target-admitted")
        refused = next(s for s in timeline["steps"] if s["step"] == "target-refused")
        assert "limits.memory=" in refused["detail"] and "Gi" in refused["detail"], refused  # (readable amounts)
        # (`reserved` comes from the usage history, which the server fills asynchronously: not asserted here;
        # a snapshot replaced within milliseconds can be missing from it, as docs/events.md says)
        assert steps.index("raised") < steps.index("target-admitted")
        assert steps.index("target-admitted") < steps.index("succeeded")
        # (the room is lowered once the target exists, which holds the source pod's room no more: before or after
        # KubeVirt marks the migration succeeded, whichever comes first)
        assert steps.index("target-admitted") < steps.index("lowered")
        times = [s["time"] for s in timeline["steps"]]
        assert times == sorted(times, key=lambda t: t.replace("Z", "+00:00")), times
        raise_step = next(s for s in timeline["steps"] if s["step"] == "raised")
        assert raised.reason in raise_step["detail"], raise_step
        code, out, err = await vmquota("explain", "vm", f"{NS}/vm1", "--nats", url)
        assert code == 0, err
        assert out.startswith(f"vm {NS}/vm1 (cluster {CLUSTER})") and " running " in out, out

        # a tenant's Event on its VMI, its message written to take over the operator's terminal: only the amounts
        # it names are shown
        vmi = p.sim.peek("vmi", NS, "vm2")
        assert vmi is not None
        hostile = (
            'pods "\x1b[2J\x1b[Hall is well\nvm2" is forbidden: exceeded quota: compute, requested: '
            "limits.memory=1Gi, used: limits.memory=64Gi, limited: limits.memory=64Gi"
        )
        message = hostile + "requested: limits.memory=1Gi, used: limits.memory=64Gi, limited: limits.memory=64Gi"
        await p.sim.create(forged_refusal(vmi, "vm2.hostile", message))

        async def told() -> bool:
            code, out, _ = await vmquota("explain", "vm", f"{NS}/vm2", "--nats", url)
            return code == 0 and "refused its pod: requested limits.memory=1Gi; used limits.memory=64Gi" in out

        await p.wait(told, "the hostile Event in vm2's timeline")
        code, out, err = await vmquota("explain", "vm", f"{NS}/vm2", "--nats", url)
        assert code == 0 and "\x1b" not in out and "all is well" not in out, out
        assert all(line.startswith(("vm ", "  ")) for line in out.splitlines()), "one line per step"
        code, out, err = await vmquota("explain", "migration", f"{NS}/no-such-migration", "--nats", url)
        assert code == 1 and not out and len(err.strip().splitlines()) == 1, err
        assert "no migration (VirtualMachineInstanceMigration) tenant-a/no-such-migration in the retained" in err
        # (its events may be among those refused: said on the same line; it said nothing of them)
        assert err.rstrip().endswith("unreadable message(s) skipped (vmquota tail --dead-letters)"), err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--nats", "nats://127.0.0.1:1"], "vmquota status: cannot reach NATS at nats://127.0.0.1:1"),
        (
            ["tail", "--nats", "nats://127.0.0.1:1", "--since", "soon"],
            "vmquota tail: --since: 'soon' is neither a duration",
        ),
        (["status", "--cluster", "Not_A_Label"], "vmquota status: "),
        (["replay", "--nats", "nats://127.0.0.1:1", "--at", "yesterday-ish"], "vmquota replay: --at: "),
    ],
)
async def test_bad_input_is_one_line_and_a_non_zero_exit(args: list[str], message: str) -> None:
    code, out, err = await vmquota(*args)
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith(message), err
    assert "Traceback" not in err


async def test_kubectl_finds_the_plugin() -> None:
    """Installing the package provides ``kubectl-vmquota``: ``kubectl vmquota status`` runs ``vmquota status``."""
    import os
    import shutil
    from pathlib import Path

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here")
    bindir = Path(sys.executable).parent
    assert (bindir / "kubectl-vmquota").exists(), "the package's kubectl plugin is not installed"
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = await asyncio.create_subprocess_exec(
        kubectl, "vmquota", "status", "--help", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert "usage: kubectl vmquota status" in out.decode() and "--watch" in out.decode()


def _creds_file(path: Path) -> Path:
    """A ``.creds`` file as ``nsc`` writes one (a user JWT and its nkey seed; the JWT is not signed by an
    operator this server knows)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    path.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.c2lnbmF0dXJl\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n"
    )
    return path


async def test_a_creds_file_is_read_and_a_server_that_refuses_it_is_one_line(tmp_path: Path) -> None:
    """``--nats-creds`` needs the nkeys signing the server's nonce: present, and a refusal is one line."""
    creds = _creds_file(tmp_path / "user.creds")
    with NatsServer() as open_server:  # (no authentication: the credentials are read, sent and not needed)
        code, out, err = await vmquota("status", "--nats", open_server.url, "--nats-creds", str(creds))
        assert code == 1 and err.count("\n") == 1, err  # (connected: then nothing of vmquota's on this server)
        assert "the stream VMQUOTA_USAGE does not exist on this server" in err, err
    conf = tmp_path / "auth.conf"
    conf.write_text('authorization { users = [ { user: "someone", password: "secret" } ] }\n')
    with NatsServer(config_file=conf) as server:
        code, out, err = await vmquota("status", "--nats", server.url, "--nats-creds", str(creds))
        assert code == 1 and out == "" and err.count("\n") == 1, err
        assert err.startswith(f"vmquota status: NATS at {server.url} refused the credentials"), err


async def test_replay_says_when_the_stream_dropped_its_oldest_events(nats_url: str) -> None:
    """A replay of a stream whose retention dropped its oldest events is a replay of what is left: the command says
    so, on stderr, so that an operator does not take a missing VM for a stopped one."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        spec = next(s for s in contract.streams() if s.name == contract.EVENTS_STREAM)
        await js.add_stream(name=spec.name, subjects=list(spec.subjects))
        for i in range(3):
            ev = builders.namespace_event(CLUSTER, f"ns{i}", f"u{i}", str(10 + i))
            await js.publish(contract.event_subject(CLUSTER, "Namespace", ""), contract.encode(ev))
        code, _, err = await vmquota("replay", "--nats", nats_url, "--until-seq", "3", "-o", "json")
        assert code == 0 and "note:" not in err, err
        await js.purge_stream(contract.EVENTS_STREAM, seq=2)  # (as its retention would: the oldest first)
        code, out, err = await vmquota("replay", "--nats", nats_url, "--until-seq", "3", "-o", "json")
        assert code == 0, err
        assert err.startswith("note: the events stream starts at sequence 2 (its retention dropped the older"), err
        assert json.loads(out)["events"] == 2
    finally:
        await nc.close()


async def test_replay_on_a_bus_without_the_events_stream_is_one_line(nats_url: str) -> None:
    """A bus the ledger never ran on (or credentials that may not read it): `status`, `tail` and `explain` said so in
    one line, `replay` printed a traceback."""
    code, out, err = await vmquota("replay", "--nats", nats_url)
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert (
        err
        == f"vmquota replay: the stream {contract.EVENTS_STREAM} does not exist on this server: is vmquota running?\n"
    )


@pytest.mark.parametrize(
    ("argv", "subject"),
    [(["status"], "vmquota.usage.c1.other"), (["replay", "--verify"], "vmquota.quota.c1.other")],
    ids=["status", "replay-verify"],
)
async def test_one_unreadable_message_takes_no_command_down(nats_url: str, argv: list[str], subject: str) -> None:
    """One message on the usage or decisions stream that is not what its subject says (the enforcer dead-letters
    it): `status` and `replay --verify` stopped with it, as if the operator's input were wrong, and showed no
    namespace; the usage stream keeps it for as long as its subject's last message. `status` skips it, with a note;
    `replay --verify` shows the rest and names it as a difference (one it cannot compare: it passed such a message
    over in silence, and so a decision of a newer schema than it reads)."""
    keeper = await Bus.connect(NatsOptions(url=nats_url), connect_timeout=5)
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=contract.StreamSizes(*(16 * 2**20,) * 6)))
        await keeper.js.publish(subject, b"not json")
    finally:
        await keeper.close()
    code, out, err = await vmquota(*argv, "--nats", nats_url)
    if argv == ["status"]:
        assert code == 0, err
        assert err.startswith(f"note: 1 unreadable message(s) skipped, the first {subject}: "), err
    else:
        assert code == 1 and out.startswith("as of "), out + err
        assert "1 difference(s)" in out and f"  {subject} (seq 1 of {contract.DECISIONS_STREAM}): cannot be" in out, out


@pytest.mark.parametrize("argv", [["tail"], ["status", "--watch"]], ids=["tail", "status-watch"])
async def test_a_command_that_follows_says_so_and_exits_when_the_bus_goes_away(argv: list[str]) -> None:
    """`vmquota tail` and `status --watch` follow the bus. Its server stopped, they went on, silent, showing the last
    table as if it were live; `docs/operations.md` promises one line and a non-zero exit for a bus that cannot be
    used."""
    with contextlib.ExitStack() as stack, NatsServer() as server:
        await _streams(server.url)
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "services.cli.main", *argv, "--nats", server.url),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        stack.callback(_kill, proc)
        if argv[0] == "status":  # (following once the table is shown)
            await asyncio.wait_for(proc.stdout.readline(), 60)
        else:  # (following once its consumer is on the server)
            await _consumer_made(server.url, contract.DECISIONS_STREAM)
        following = proc.returncode
        assert following is None, "following"
        server.stop()
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and err.decode().count("\n") == 1, err
    assert err.decode().startswith(f"vmquota {argv[0]}: lost the connection to NATS"), err


async def test_replay_says_what_it_skipped_and_verifies_past_a_decision_it_cannot_compare(nats_url: str) -> None:
    """`replay` left out unreadable events without a word (`status` says so); and one decision whose time did not
    read ended `replay --verify` with a line that named neither it nor its place, nothing else verified."""
    keeper = await Bus.connect(NatsOptions(url=nats_url), connect_timeout=5)
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=contract.StreamSizes(*(16 * 2**20,) * 6)))
        await keeper.js.publish(contract.event_subject(CLUSTER, "Namespace", ""), b"not json")
        odd = contract.Decision(
            id=f"{CLUSTER}/decision/odd/1",
            source=contract.source("enforcer", CLUSTER),
            subject=f"{NS}/compute",
            time="yesterday",
            cluster=CLUSTER,
            namespace=NS,
            quota="compute",
            mode="VmiPodUsage",
            usage_seq=1,
        )
        await keeper.js.publish(contract.decision_subject(CLUSTER, NS), contract.encode(odd))
    finally:
        await keeper.close()
    code, out, err = await vmquota("replay", "--nats", nats_url)
    assert code == 0, err
    assert err == "note: 1 unreadable event(s) skipped, as the ledger skips them (it dead-letters them)\n", err
    code, out, err = await vmquota("replay", "--verify", "--nats", nats_url)
    assert code == 1, err
    assert "verified 0 decisions and 0 usage snapshots: 1 difference(s)" in out, out
    assert f"{CLUSTER}/{NS} decision {odd.id}: cannot be compared: time: 'yesterday'" in out, out


async def test_replay_refuses_what_the_ledger_refuses_as_published_on_another_subject(
    nats_url: str,
) -> None:
    """A credential publishes on its own cluster's subjects only: a body of another cluster on them is a forgery, and
    the ledger dead-letters it. `replay` (over every cluster, its default) folded it all the same, so its state and
    its `--verify` disagreed with the ledger's; and a decision of another cluster on this one's subject was compared
    as if the enforcer had made it. (`explain` and `status` read through the same check.)"""
    keeper = await Bus.connect(NatsOptions(url=nats_url), connect_timeout=5)
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=contract.StreamSizes(*(16 * 2**20,) * 6)))
        for cluster in (CLUSTER, "other"):  # (the second on the first's subject)
            ev = builders.namespace_event(cluster, f"ns-{cluster}", f"u-{cluster}", "10")
            await keeper.js.publish(contract.event_subject(CLUSTER, "Namespace", ""), contract.encode(ev))
        forged = builders.decision(NS, cluster="other", usage_seq=1)
        await keeper.js.publish(contract.decision_subject(CLUSTER, NS), contract.encode(forged))
    finally:
        await keeper.close()
    code, out, err = await vmquota("replay", "--nats", nats_url, "-o", "json")
    assert code == 0, err
    assert err == "note: 1 unreadable event(s) skipped, as the ledger skips them (it dead-letters them)\n", err
    code, out, err = await vmquota("replay", "--verify", "--nats", nats_url)
    assert code == 1, err
    wrong = f"published on {contract.decision_subject(CLUSTER, NS)}, but the decision belongs on "
    assert "verified 0 decisions and 0 usage snapshots: 1 difference(s)" in out and wrong in out, out


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


async def _streams(url: str) -> None:
    keeper = await Bus.connect(NatsOptions(url=url), connect_timeout=5)
    try:
        await keeper.ensure_streams(contract.streams_for("ledger", sizes=contract.StreamSizes(*(64 * 2**20,) * 6)))
    finally:
        await keeper.close()


async def _consumer_made(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        for _ in range(600):  # (60 s)
            if (await nc.jetstream().stream_info(stream)).state.consumer_count:
                return
            await asyncio.sleep(0.1)
        pytest.fail(f"no consumer on {stream}")
    finally:
        await nc.close()


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


async def test_a_command_that_follows_says_so_when_the_server_stops_answering() -> None:
    """A server that stops answering without closing the connection (paused, or cut off by the network): `tail`
    went on, silent, for the minutes nats-py's default pings take. Two unanswered pings end it now."""
    with contextlib.ExitStack() as stack, NatsServer() as server:
        await _streams(server.url)
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "services.cli.main", "tail", "--nats", server.url),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stack.callback(_kill, proc)
        await _consumer_made(server.url, contract.DECISIONS_STREAM)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        stack.callback(_resume, server.proc.pid)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and err.decode().count("\n") == 1, err
    assert err.decode().startswith("vmquota tail: lost the connection to NATS"), err


async def test_a_read_the_server_stalls_is_never_shown_as_complete(tmp_path: Path) -> None:
    """A read that met a second's quiet ended there, as if the stream held no more: a server paused for 3 s after the
    first message of 20,000 gave a `replay` of 1,599. A quiet second ends a read only once the server says the
    consumer has nothing more to deliver."""
    from services.cli import opsbus

    n = 20_000
    async with contextlib.AsyncExitStack() as stack:
        server = stack.enter_context(NatsServer())
        await _streams(server.url)
        pub = await nats.connect(server.url)
        try:
            for i in range(n):
                await pub.publish("vmquota.ev.c1.ns.t", b"x" * 300)
                if i % 5000 == 0:
                    await pub.flush()
            await pub.flush()
            for _ in range(600):  # (stored, all of them: a read reads what the stream held when it began)
                if (await pub.jetstream().stream_info(contract.EVENTS_STREAM)).state.messages == n:
                    break
                await asyncio.sleep(0.1)
        finally:
            await pub.close()
        nc = await nats.connect(server.url, allow_reconnect=False)
        stack.push_async_callback(nc.close)
        assert server.proc is not None
        pid = server.proc.pid
        stack.callback(_resume, pid)
        got = 0
        async for _ in opsbus.messages(nc, contract.EVENTS_STREAM, "vmquota.ev.c1.>"):
            got += 1
            if got == 1:
                os.kill(pid, signal.SIGSTOP)
                asyncio.get_running_loop().call_later(3.0, os.kill, pid, signal.SIGCONT)
    assert got == n
