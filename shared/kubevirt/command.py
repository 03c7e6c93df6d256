"""The command KubeVirt starts a launcher pod's ``compute`` container with, and the VMI uid it names.

A pod's containers cannot be changed once it is created (only their images and resources, through ``resize``), so
the ``--uid`` of a ``compute`` container running ``virt-launcher-monitor`` is the one mark of a launcher pod its
tenant cannot take off: labels and owner references are the tenant's to rewrite at any moment. It does not vouch
that KubeVirt made the pod (a tenant may create a pod with that command), only which VMI a pod KubeVirt made was
made for (``pkg/virt-controller/services/template.go``, checked at v1.9.0)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any, Final

from shared.kubevirt.types import COMPUTE

LAUNCHER_MONITOR: Final = "/usr/bin/virt-launcher-monitor"


def launcher_command(name: str, uid: str, namespace: str) -> list[str]:
    """The start of KubeVirt's command for a VMI's ``compute`` container (its other flags are the cluster's)."""
    return [LAUNCHER_MONITOR, "--qemu-timeout", "240s", "--name", name, "--uid", uid, "--namespace", namespace]


def set_launcher_command(pod_spec: dict[str, Any], name: str, uid: str, namespace: str) -> None:
    """Give the ``compute`` container of ``pod_spec`` (a rendered launcher pod's) KubeVirt's command for the VMI."""
    for c in pod_spec.get("containers", ()):
        if c.get("name") == COMPUTE:
            c["command"] = launcher_command(name, uid, namespace)


def launched_vmi_uid(containers: object) -> str:
    """The VMI uid the ``compute`` container of ``containers`` (a pod's ``spec.containers``) names in a
    ``virt-launcher-monitor`` command, or "" (not such a pod, or a command that is not a list of strings)."""
    if not isinstance(containers, list):
        return ""
    for c in containers:
        if not isinstance(c, dict) or c.get("name") != COMPUTE:
            continue
        command = c.get("command")
        if not isinstance(command, list) or not command or command[0] != LAUNCHER_MONITOR:
            return ""
        for flag, value in pairwise(command):
            if flag == "--uid" and isinstance(value, str):
                return value
        return ""
    return ""
