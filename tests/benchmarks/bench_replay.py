"""Replay: an ordered consumer reads the events stream from its first message and folds every event into a fresh
``Ledger`` (what an operator replaying history, or a new ledger without a checkpoint, does), against the raw
nats-py ordered-consumer rate over the same stream in the same run (the same subscription, reading only).

The stream holds the watcher's events of ``VMS`` VMs (a VirtualMachine, a VirtualMachineInstance and a
virt-launcher pod each, ~1.2 KB per event on average), published beforehand. Consumer and nats-server share
the machine, as in the pipeline benchmark. Rounds alternate raw and folding reads and the ``vmquota replay``
command's own reader (``opsbus.messages`` and ``cli_replay.Replay``); the best of each is kept.
"""

from __future__ import annotations

import asyncio
import gc
import time

from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from services.devtools.natsserver import NatsServer
from services.platform import logs
from services.platform.bus import Bus, NatsOptions, position
from services.platform.publisher import publish_all
from shared import contract
from shared.accounting.namespace import ACCOUNTED_KINDS
from shared.ledger.fold import Ledger, PartitionSet
from tests.benchmarks.bench_memory import KINDS, events_of, vm_objects
from tests.benchmarks.common import Result

VMS = 10_000
ROUNDS = 2
TARGET_RATIO = 50.0
"""Folding should keep at least half of the raw replay rate (decode + fold against a read that does nothing)."""


async def _fill(bus: Bus, events: list[bytes]) -> None:
    await bus.ensure_streams(contract.streams_for("ledger"))
    items = []
    for data in events:
        ev = contract.decode_event(data)
        assert not isinstance(ev, contract.Sync)
        items.append((contract.event_subject(ev.cluster, ev.kind, ev.namespace), data, ev.id))
    stored, duplicates = await publish_all(bus, items, window=1000)
    if stored != len(events) or duplicates:
        raise AssertionError(f"stored {stored} events ({duplicates} duplicates), expected {len(events)}")


async def replay(bus: Bus, want: int, fold: Ledger | None) -> float:
    """Read the events stream from the start with an ordered consumer; events/s over ``want`` events."""
    done = asyncio.Event()
    got = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal got
        if fold is not None:
            fold.apply_bytes(msg.data, position(msg).stream, msg.subject)
        got += 1
        if got >= want:
            done.set()

    t0 = time.perf_counter()
    sub = await bus.js.subscribe(
        "vmquota.ev.>",
        stream=contract.EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
        cb=on_msg,
        pending_msgs_limit=want + 1,
        pending_bytes_limit=512 * 1024 * 1024,
    )
    try:
        await asyncio.wait_for(done.wait(), 300)
        t1 = time.perf_counter()
    finally:
        await sub.unsubscribe()
    return want / (t1 - t0)


async def command_replay(bus: Bus, want: int) -> float:
    """What ``vmquota replay --at`` does: ``opsbus.messages`` (an ordered consumer, message by message), the time
    of each message checked against ``--at``, and ``Replay.apply`` (decode, fold) over the whole stream; events/s."""
    from services.cli import opsbus
    from services.cli.replay import Replay

    r = Replay()
    at_ns = time.time_ns() + 3600 * 10**9  # (`--at` an hour ahead: every event is before it, and checked)
    t0 = time.perf_counter()
    async for m in opsbus.messages(bus.nc, contract.EVENTS_STREAM, "vmquota.ev.>"):
        seq, _, _, stored = position(m)
        if stored > at_ns:
            break
        r.apply(m.data, seq, m.subject)
    t1 = time.perf_counter()
    if r.events != want or r.skipped:
        raise AssertionError(f"vmquota replay read {r.events} events ({r.skipped} unreadable), expected {want}")
    return want / (t1 - t0)


async def run_async(n: int = VMS, rounds: int = ROUNDS) -> list[Result]:
    logs.configure("warning")
    objects = [o for i in range(n) for o in vm_objects(i)]
    events = events_of(objects)
    accounted = sum(1 for o in objects if o["kind"] in ACCOUNTED_KINDS)
    size = sum(map(len, events)) / len(events)
    gc.collect()
    gc.freeze()  # the workload stays out of the consumer's collections, as in the pipeline benchmark
    raws: list[float] = []
    folds: list[float] = []
    commands: list[float] = []
    with NatsServer() as server:
        bus = await Bus.connect(NatsOptions(url=server.url))
        try:
            await _fill(bus, events)
            for _ in range(rounds):
                raws.append(await replay(bus, len(events), None))
                ledger = Ledger(PartitionSet.all(1), ACCOUNTED_KINDS)  # (as the ledger and `vmquota replay` fold)
                folds.append(await replay(bus, len(events), ledger))
                folded = sum(len(st.live(kind)) for st in ledger.states.values() for kind in KINDS)
                if folded != accounted:
                    raise AssertionError(f"the replayed ledger holds {folded} objects, expected {accounted}")
                del ledger
                gc.collect()
                commands.append(await command_replay(bus, len(events)))
                gc.collect()
        finally:
            await bus.close()
            gc.unfreeze()
    raw, folding, command = max(raws), max(folds), max(commands)
    note = f"{len(events)} events ({n} VMs), {size:,.0f} B on average, ordered push consumer"
    return [
        Result("replay: raw nats-py ordered consumer", raw, "events/s", note=note),
        Result("replay: ordered consumer + ledger fold", folding, "events/s", note=note),
        Result("replay: folding / raw", 100.0 * folding / raw, "%", target=TARGET_RATIO),
        Result("replay: the vmquota replay command (its reader and fold)", command, "events/s", note=note),
        Result("replay: vmquota replay / raw", 100.0 * command / raw, "%", target=TARGET_RATIO),
    ]


if __name__ == "__main__":
    for result in asyncio.run(run_async()):
        print(result.line())
