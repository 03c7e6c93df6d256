"""Every name vmquota writes or reads under ``vmquota.io/``: what an administrator sets on a ResourceQuota to opt it
in, and what vmquota writes on the quotas it manages and on the VMIs it nudges (documented in
``docs/accounting.md`` and ``docs/operations.md``)."""

from __future__ import annotations

from typing import Final

# ---- set by an administrator on a ResourceQuota -------------------------------------------------------------------

MANAGED_LABEL: Final = "vmquota.io/managed"
"""Label that opts a ResourceQuota in (value ``"true"``)."""
MODE_ANNOTATION: Final = "vmquota.io/mode"
"""Annotation naming the accounting mode (default ``VmiPodUsage``)."""
RATIO_ANNOTATION: Final = "vmquota.io/cpu-allocation-ratio"
"""Annotation: the quota's own CPU allocation ratio for ``VirtualResourcesWithCPUAllocationRatio``."""
BUDGET_ANNOTATION: Final = "vmquota.io/budget"
"""Annotation holding the budget ``B`` as a JSON map of resource names to quantities."""

# ---- written by the enforcer -----------------------------------------------------------------------------------

LAST_HARD_ANNOTATION: Final = "vmquota.io/last-hard"
"""The ``spec.hard`` the enforcer last wrote (JSON, canonical quantities)."""
STATUS_ANNOTATION: Final = "vmquota.io/status"
"""One line saying what the enforcer does with the quota."""
USAGE_ANNOTATION: Final = "vmquota.io/usage"
"""One line for people: use in the mode's terms against the budget, what is reserved and what ``hard`` is raised
for, as of the last ``spec.hard`` write (it is updated only with writes that happen anyway)."""
USAGE_FROM_ANNOTATION: Final = "vmquota.io/usage-from"
"""The usage snapshot the enforcer's last write of the quota was planned from, as ``<seq> <time>``
(:func:`shared.quota.enforcement.usage_mark`): an enforcer that starts ignores a snapshot older than it, a copy a
reader of the bus had stored after the newer ones (docs/operations.md, "What a reader can still write")."""
ENFORCED_BUDGET_ANNOTATION: Final = "vmquota.io/enforced-budget"
"""The budget the ``spec.hard`` vmquota last wrote from the ledger's usage was computed for, as the text of
``vmquota.io/budget`` then (an administrator's spelling kept): with the usage missing, a quota stays enforced only
while its budget is still this one, and the reservation guard admits VMs in VM terms only while the budget
annotation's text is this one (a budget lowered through it was open at the old one until the enforcer wrote)."""
VMI_MINIMUM_ANNOTATIONS: Final = {
    r: f"vmquota.io/min.{r}" for r in ("requests.memory", "limits.memory", "requests.cpu", "limits.cpu")
}
"""Resource → the annotation with what a VMI's explicit amount of it must be at least, per byte of guest memory or
per vCPU (``shared.quota.modes.vmi_minimums``), on a managed quota in a VM-term mode: the reservation guard's
rendering-model policy reads them (``deploy/components/reservation-guard``)."""
REPORT_ANNOTATIONS: Final = frozenset(
    {
        STATUS_ANNOTATION,
        USAGE_ANNOTATION,
        USAGE_FROM_ANNOTATION,
        ENFORCED_BUDGET_ANNOTATION,
        *VMI_MINIMUM_ANNOTATIONS.values(),
    }
)
"""What the enforcer writes on a quota for people (its status line, the usage summary): no accounting reads them, so
a change of them alone is not a change of the quota for the ledger (``shared.snapshot.same_content``)."""
NUDGE_ANNOTATION: Final = "vmquota.io/retry"
"""Written on a VMI whose launcher pod KubeVirt was refused, once vmquota made room for it: KubeVirt re-queues a
VMI on every update, so it tries again at once instead of at the end of its backoff (up to 16 minutes)."""
