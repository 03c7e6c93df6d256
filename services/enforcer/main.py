"""``vmquota run enforcer``: connect to NATS and the cluster, then enforce while holding the cluster's Lease."""

from __future__ import annotations

from services.enforcer.kube import KubeQuotas
from services.enforcer.options import EnforcerOptions
from services.enforcer.service import Enforcer
from services.platform.bus import Bus
from services.platform.kubeclient import kube_client
from services.platform.lease import Fence
from services.platform.runner import Runtime, leader_elected
from shared import contract
from shared.errors import InvalidInput


async def main(rt: Runtime) -> None:
    cluster = rt.config.cluster
    if cluster is None:
        raise InvalidInput("--cluster (VMQUOTA_CLUSTER) is required for the enforcer", "--cluster")
    reconnects = rt.metrics.reconnects.labels(service=rt.name)
    bus = await Bus.connect(rt.nats_options(), on_reconnect=reconnects.inc, stop=rt.stop)
    try:
        await bus.wait_for_streams(contract.STREAMS_USED["enforcer"])
        api = await kube_client(rt.config.kubeconfig)
        try:
            opts = EnforcerOptions(
                cluster=cluster,
                dry_run=rt.config.dry_run,
                identity=rt.config.identity,
                service=rt.name,
                reservation_guard=rt.config.reservation_guard,
                guard_creators=rt.config.guard_creators,
                exclude_namespaces=rt.config.exclude_namespaces,
                resync_interval=rt.config.resync_interval,
                usage_refresh_interval=rt.config.usage_refresh_interval,
            )
            fence = Fence()  # (held while this replica leads: its writes check it)
            enforcer = Enforcer(bus, KubeQuotas(api, fence=fence), opts, metrics=rt.metrics)
            rt.health.set_ready(rt.name, True)  # connected: ready to lead or to stand by
            log = rt.log(cluster=cluster)
            log.info("enforcer ready", dry_run=opts.dry_run, reservation_guard=opts.reservation_guard)
            if not opts.reservation_guard:
                log.warning(
                    "reservation guard off: a tenant's pod can take room held for a migration target or an admitted "
                    "VM, and a VM overcommitting memory can get past a VM-term budget; install "
                    "deploy/components/reservation-guard to close both (docs/accounting.md, 'Known limits')"
                )
            await leader_elected(rt, lambda: enforcer.run(rt.stop), fence=fence)
        finally:
            await api.close()
    finally:
        await bus.close()
