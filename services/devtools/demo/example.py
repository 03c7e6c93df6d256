"""The example tenant of ``vmquota up --example`` and ``vmquota simulate --example`` (``example.yaml`` beside this
file): a namespace with a 64Gi / 16 vCPU budget in VM terms, three VMs running, two stopped."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

EXAMPLE_NAMESPACE = "tenant-a"


def example_documents() -> list[dict[str, Any]]:
    """The example's objects, in the order to create them."""
    text = resources.files("services.devtools.demo").joinpath("example.yaml").read_text()
    return [d for d in yaml.safe_load_all(text) if d]
