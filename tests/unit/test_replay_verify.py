"""``vmquota replay --verify`` re-derives each ``hard`` the enforcer wrote from the usage it planned with, and the
quota's ``status.used`` it held ``hard`` within (the decision's ``charged``)."""

from __future__ import annotations

from datetime import datetime

from services.cli.replay import Replay, _verify
from shared import contract

GI = 1024**3
B = 64 * GI
POD = 17_520_887_552  # a 16Gi VM's launcher pod


class _Replayed(Replay):
    """A replay whose fold gives, for the namespace, the terms the ledger published at the decision's usage."""

    def __init__(self, terms: contract.QuotaTerms) -> None:
        super().__init__()
        self.terms = terms

    def usage(self, cluster: str, namespace: str, at: datetime) -> contract.UsageSnapshot:
        return contract.UsageSnapshot(
            id="c1/replay/ns/1",
            source="vmquota/replay/c1",
            subject=namespace,
            time="2026-01-01T00:00:00Z",
            cluster=cluster,
            namespace=namespace,
            seq=85,
            quotas={"compute": self.terms},
        )


def _decision(hard_after: int, charged: dict[str, str]) -> contract.Decision:
    return contract.Decision(
        id="c1/decision/uid/9",
        source="vmquota/enforcer/c1",
        subject="ns/compute",
        time="2026-01-01T00:00:01Z",
        cluster="c1",
        namespace="ns",
        quota="compute",
        mode="VmiPodUsage",
        budget={"limits.memory": "64Gi"},
        hard_before={"limits.memory": str(B + POD)},
        hard_after={"limits.memory": str(hard_after)},
        usage_seq=85,
        charged=charged,
    )


def test_a_hard_held_within_what_the_api_server_charged_is_derived_again_from_the_usage_and_the_charge() -> None:
    """A migration handed off: the source pod ended and the quota controller stopped charging it before the ledger
    heard of it. The usage gives ``hard`` 64Gi with the source still in ``P`` (65.3Gi); the enforcer, which read
    ``status.used`` (49Gi), held ``hard`` within it: 47.7Gi. The verify compared that with the usage's 64Gi and
    reported a difference where there was none (``test_ops_cli`` failed so, now and then)."""
    terms = contract.QuotaTerms(
        mode="VmiPodUsage",
        budget={"limits.memory": "64Gi"},
        hard={"limits.memory": "64Gi"},
        pods={"limits.memory": str(4 * POD)},
        used={"limits.memory": str(3 * POD)},
    )
    r = _Replayed(terms)
    differences: list[str] = []
    assert _verify(r, _decision(B - POD, {"limits.memory": str(3 * POD)}), differences) == 1
    assert differences == []
    # a hard the charge does not explain is still a difference, and so is one planned without a read
    assert _verify(r, _decision(B - 2 * POD, {"limits.memory": str(3 * POD)}), differences) == 1
    assert _verify(r, _decision(B - POD, {}), differences) == 1
    assert len(differences) == 2 and all("replay gives" in d for d in differences), differences
