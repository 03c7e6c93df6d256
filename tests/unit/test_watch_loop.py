"""The watcher loop's pure parts: the relist diff, what it tracks, which pods it wants, failures and backoff."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.platform.kube import is_transient
from services.watcher.loop import (
    KnownSet,
    ManagedNamespaces,
    Recovery,
    Tracked,
    classify,
    diff_relist,
    is_newer,
    pod_wanted,
    quota_is_managed,
    sync_namespaces,
)
from shared.backoff import Backoff
from shared.snapshot import labelled_launcher

NAMESPACES = ("a", "b", "c")

# ---- relist diff ------------------------------------------------------------------------------------------------


@st.composite
def histories(draw: st.DrawFn) -> tuple[dict[str, Tracked], dict[str, Tracked], int]:
    """(what the loop knew, the cluster at the relist, the list's version): the loop saw every object up to some
    version, then missed a random run of creations, changes and deletions."""
    rv = 0
    cluster: dict[str, Tracked] = {}
    for i in range(draw(st.integers(0, 12))):
        rv += 1
        cluster[f"u{i}"] = Tracked(draw(st.sampled_from(NAMESPACES)), f"o{i}", rv)
    known = dict(cluster)
    next_id = len(cluster)
    for op in draw(st.lists(st.sampled_from(["create", "modify", "delete"]), max_size=15)):
        rv += 1
        if op == "create" or not cluster:
            cluster[f"u{next_id}"] = Tracked(draw(st.sampled_from(NAMESPACES)), f"o{next_id}", rv)
            next_id += 1
            continue
        uid = draw(st.sampled_from(sorted(cluster)))
        if op == "modify":
            cluster[uid] = cluster[uid]._replace(rv=rv)
        else:
            del cluster[uid]
    return known, cluster, rv


@given(histories())
def test_applying_a_relist_diff_reaches_the_cluster_state(
    h: tuple[dict[str, Tracked], dict[str, Tracked], int],
) -> None:
    known, cluster, list_rv = h
    diff = diff_relist(known, cluster, list_rv)
    after = dict(known)
    for uid, _ in diff.vanished:
        del after[uid]
    for uid in diff.changed:
        after[uid] = cluster[uid]
    assert after == cluster
    # Nothing is published twice: an object the loop holds at the listed version is not "changed".
    assert all(known.get(u) != cluster[u] for u in diff.changed)
    assert {u for u, _ in diff.vanished} == set(known) - set(cluster)
    assert sorted(u for uids in diff.present.values() for u in uids) == sorted(cluster)
    assert all(cluster[u].namespace == ns for ns, uids in diff.present.items() for u in uids)


def test_an_object_learnt_after_the_list_is_not_judged_by_it() -> None:
    known = {"old": Tracked("a", "x", 5), "new": Tracked("a", "y", 12)}
    diff = diff_relist(known, {}, list_rv=10)
    assert [u for u, _ in diff.vanished] == ["old"]  # "new" appeared after version 10: the list cannot know it


def test_vanished_objects_come_in_namespace_and_name_order() -> None:
    known = {"3": Tracked("b", "a", 1), "1": Tracked("a", "z", 2), "2": Tracked("a", "b", 3)}
    diff = diff_relist(known, {}, 10)
    assert [(t.namespace, t.name) for _, t in diff.vanished] == [("a", "b"), ("a", "z"), ("b", "a")]


def test_sync_namespaces_cover_listed_known_and_every_namespace_of_the_cluster() -> None:
    diff = diff_relist({}, {"u": Tracked("b", "x", 1)}, 1)
    assert sync_namespaces(diff, {"a"}, ["c", "b"]) == ["a", "b", "c"]
    assert sync_namespaces(diff_relist({}, {}, 1), set()) == []


def test_is_newer() -> None:
    assert is_newer(None, 1)
    assert is_newer(Tracked("a", "x", 4), 5)
    assert not is_newer(Tracked("a", "x", 5), 5)
    assert not is_newer(Tracked("a", "x", 6), 5)


# ---- what is tracked --------------------------------------------------------------------------------------------


def test_known_set_forgets_a_namespace_but_its_launcher_pods() -> None:
    known = KnownSet()
    known.put("l", "a", "launcher", 1, launcher=True)
    known.put("w", "a", "web", 2)
    known.put("o", "b", "other", 3)
    assert known.drop_namespace("a") == 1
    assert sorted(known) == ["l", "o"]
    assert known.namespaces() == {"a", "b"}
    assert known.drop_namespace("a", keep_launchers=False) == 1
    assert "l" not in known and len(known) == 1


def test_known_set_keeps_versions() -> None:
    known = KnownSet()
    known.put("u", "a", "x", 3)
    known.put("u", "a", "x", 7)
    assert known.get("u") == Tracked("a", "x", 7)
    assert known.pop("u") == Tracked("a", "x", 7) and known.pop("u") is None


def test_pods_wanted_launchers_everywhere_others_in_managed_namespaces() -> None:
    managed = ManagedNamespaces()
    managed.update("m", "q1", True)
    launcher = {"kubevirt.io": "virt-launcher"}
    assert (
        labelled_launcher(launcher)
        and not labelled_launcher({"kubevirt.io": "hotplug-disk"})
        and not labelled_launcher(None)
    )
    assert pod_wanted(launcher, "u", managed)
    assert pod_wanted({"app": "web"}, "m", managed)
    assert not pod_wanted({"app": "web"}, "u", managed)
    assert not pod_wanted(None, "u", managed)


def test_quota_opt_in_label() -> None:
    assert quota_is_managed({"vmquota.io/managed": "true"})
    assert not quota_is_managed({"vmquota.io/managed": "True"})  # (exactly "true", as label selectors match it)
    assert not quota_is_managed({"vmquota.io/managed": "false"})
    assert not quota_is_managed({})
    assert not quota_is_managed(None)
    assert not quota_is_managed(["vmquota.io/managed"])


def test_managed_namespaces_change_with_their_first_and_last_managed_quota() -> None:
    m = ManagedNamespaces()
    assert m.update("a", "q1", True) is True
    e1 = m.epoch("a")
    assert m.update("a", "q2", True) is None
    assert m.update("a", "q1", False) is None  # q2 still manages it
    assert m.epoch("a") == e1
    assert m.update("a", "q2", False) is False
    assert "a" not in m and m.epoch("a") == e1 + 1
    assert m.update("a", "q9", False) is None  # an unmanaged quota leaving changes nothing
    assert m.update("b", "q3", True) is True
    added, removed = m.replace({"c": ["q4"], "b": ["q3"], "d": []})
    assert (added, removed) == (["c"], [])
    added, removed = m.replace({})
    assert (added, removed) == ([], ["b", "c"])
    assert len(m) == 0


@given(st.lists(st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(["q1", "q2", "q3"]), st.booleans())))
def test_managed_namespaces_match_their_quotas(ops: list[tuple[str, str, bool]]) -> None:
    m = ManagedNamespaces()
    state: dict[tuple[str, str], bool] = {}
    managed_before: set[str] = set()
    for ns, q, on in ops:
        state[(ns, q)] = on
        change = m.update(ns, q, on)
        now = {n for (n, _), v in state.items() if v}
        assert set(m) == now
        if ns in now and ns not in managed_before:
            assert change is True
        elif ns not in now and ns in managed_before:
            assert change is False
        else:
            assert change is None
        managed_before = now


# ---- failures and backoff ---------------------------------------------------------------------------------------


def test_only_gone_relists() -> None:
    assert classify(410) is Recovery.RELIST
    for status in (0, 400, 401, 403, 404, 408, 429, 500, 503, 504):
        assert classify(status) is Recovery.BACKOFF
    assert all(is_transient(s) for s in (0, 408, 429, 500, 502, 503, 504))
    assert not any(is_transient(s) for s in (400, 401, 403, 404, 422))


def test_backoff_schedule_doubles_up_to_the_cap() -> None:
    b = Backoff(initial=0.5, maximum=30.0, factor=2.0, jitter=0.25)
    assert [b.base(n) for n in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert b.base(10_000) == 30.0  # no float overflow for a long outage


@settings(max_examples=200)
@given(st.integers(0, 60), st.integers(0, 2**32), st.one_of(st.none(), st.floats(0, 120)))
def test_backoff_delay_stays_within_the_jitter_and_honours_retry_after(
    attempt: int, seed: int, retry_after: float | None
) -> None:
    b = Backoff(initial=0.2, maximum=10.0, jitter=0.3)
    d = b.delay(attempt, random.Random(seed), retry_after)
    base = b.base(attempt)
    honoured = min(retry_after, b.maximum) if retry_after is not None else 0.0
    assert d >= base * 0.7 - 1e-9
    assert d <= max(base * 1.3, honoured) + 1e-9
    assert d >= honoured, "a Retry-After is honoured up to the maximum"
    assert d <= b.maximum * 1.3 + 1e-9, "however long the server asks to wait"


def test_backoff_jitter_spreads_watchers_that_failed_together() -> None:
    b = Backoff()
    rng = random.Random(7)
    delays = {round(b.delay(3, rng), 6) for _ in range(20)}
    assert len(delays) > 10


@pytest.mark.parametrize(
    "kwargs", [{"initial": 0}, {"initial": 5, "maximum": 1}, {"factor": 0.5}, {"jitter": 1.0}, {"jitter": -0.1}]
)
def test_backoff_refuses_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)
    with pytest.raises(ValueError):
        Backoff().base(-1)
