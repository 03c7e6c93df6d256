"""The Kubernetes kinds vmquota reads, by name: one constant per kind, and which of them hold for the whole
cluster rather than one namespace."""

from __future__ import annotations

from typing import Final

VM_KIND: Final = "VirtualMachine"
VMI_KIND: Final = "VirtualMachineInstance"
VMIM_KIND: Final = "VirtualMachineInstanceMigration"
POD_KIND: Final = "Pod"
QUOTA_KIND: Final = "ResourceQuota"
NAMESPACE_KIND: Final = "Namespace"
KUBEVIRT_KIND: Final = "KubeVirt"
EVENT_KIND: Final = "Event"
RESERVATION_KIND: Final = "QuotaReservation"
"""vmquota's own kind: the reservation guard's parameter (``shared.quota.guard``)."""

FINAL_PHASES: Final = frozenset({"Succeeded", "Failed"})
"""The phases a pod, a VMI and a migration never leave: each kind has these two, and nothing of the object runs."""

CLUSTER_SCOPED_KINDS: Final = frozenset({NAMESPACE_KIND, KUBEVIRT_KIND})
"""Kinds that hold for the whole cluster: every namespace's accounting reads them, and the bus publishes them under
the ``_cluster`` namespace token. The KubeVirt CR is namespaced in Kubernetes, but it configures the whole cluster
(``cpuAllocationRatio``, overcommit, feature gates)."""
