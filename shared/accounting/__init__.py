"""A namespace's usage as a pure function of the objects in it.

:func:`~shared.accounting.namespace.account_view` takes the snapshots of one namespace by kind (VMIs, migrations,
pods, ResourceQuotas, the Namespace, FailedCreate events; ``account_namespace`` takes them in any order, VMs
accepted and ignored) and returns, for every managed quota:

* ``U`` — accounted usage: each VM counted once in the quota's mode (running VMs always; pending VMs only when
  admitted), every non-VM pod at its pod usage, and the hotplug growth of pending migrations;
* ``P`` — pod usage: what the native evaluator charges the namespace's pods (``shared.podusage``);
* ``S`` — reservations, in pod terms: the launcher pod of each admitted VM whose pod does not exist yet, and the
  target pod of each pending migration;
* ``D``, ``X``, ``W`` — the overlap of VMs' pods, its unvouched part, and what the namespace takes of the budget in
  pod terms;
* ``hard`` — the equation (``shared.quota.equation``) applied to them;

plus every VM (running, admitted, refused, stopped), pod and migration with what it counts and why.

Rules (``docs/accounting.md`` explains them):

* a pod is a VM's launcher pod only when the VMI's ``status.activePods`` names it; a VM is *running* while it
  has a non-terminal launcher pod; running VMs always count, at the per-resource maximum of their launcher pods
  (source and target during a migration), at most as vmquota renders the pod;
* pending VMs are admitted in creation order (then name, uid): admitted iff ``U + u <= B`` for every natively
  enforced resource of every managed quota (managed quotas are unscoped); an admitted VM adds ``u`` to ``U`` and its
  launcher pod estimate to ``S``;
* estimates: the renderer's launcher pod for the VMI (the published overhead when KubeVirt published it), with the
  ``requested:`` amounts of the VMI's latest quota refusals (FailedCreate events) replacing the estimated ones;
  a migration target: the source pod's usage plus the hotplug growth, at least the rendering of the current spec,
  refusal amounts again replacing the estimate;
* only the oldest active migration of a VMI reserves a target; the others queue behind it (KubeVirt runs one at
  a time per VMI);
* launcher pods of a VMI that is not in the set count as non-VM pods (their resources are in use); terminal
  launcher pods count what the evaluator still charges them (``count/pods``);
* the result does not depend on the order of the input: objects are sorted, duplicates keep the newest version.

Only the kinds in :data:`ACCOUNTED_KINDS` are read.

Modules: ``namespace`` (the input and the result), the passes in the order they run (``state``, what they share;
``pods``, ``vms``, ``migrations``, ``admission``), ``results`` (what it returns), ``estimates`` (launcher pod
estimates, the evidence bound), ``memo`` and ``sums`` (the incremental accelerator), ``wire`` (the result as a
bus usage body).
"""
