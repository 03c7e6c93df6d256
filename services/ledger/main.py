"""``vmquota run ledger``: connect, then run :class:`~services.ledger.service.LedgerService` until stopped."""

from __future__ import annotations

from services.ledger.service import LedgerOptions, LedgerService
from services.platform.bus import Bus
from services.platform.runner import Runtime
from shared.accounting.wire import account


async def main(rt: Runtime) -> None:
    reconnects = rt.metrics.reconnects.labels(service=rt.name)
    bus = await Bus.connect(rt.nats_options(), on_reconnect=reconnects.inc, stop=rt.stop)
    try:
        opts = LedgerOptions(
            partitions=rt.config.partitions,
            cluster=rt.config.cluster,
            events_max_age=rt.config.events_max_age,
            usage_history_max_age=rt.config.usage_history_max_age,
            service=rt.name,
        )
        service = LedgerService(bus, opts, account, metrics=rt.metrics, health=rt.health)
        await service.run(rt.stop)
    finally:
        await bus.close()
