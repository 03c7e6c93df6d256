"""Randomized differential test of the ledger's fold against a consistent Kubernetes-like history.

A truth (one namespace, Pods, VMIs, migrations, one global resourceVersion counter) is changed at random; the
watcher publishes an event per change and, now and then, relists a kind (every live object at its current version,
then a sync marker listing the live uids at the current resourceVersion). The delivered stream is perturbed: a lost
head (answered by a relist), an old watcher leader's publishes and markers delivered late, duplicates. After a final
full relist the fold must hold exactly the truth's live objects, and a fold restarted from checkpoints anywhere must
equal the continuous one.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from shared.ledger.fold import Ledger
from tests.fold_events import Event, answer, down, sync, up

POD, VMI, VMIM = "Pod", "VirtualMachineInstance", "VirtualMachineInstanceMigration"
KINDS = (POD, VMI, VMIM)
PREFIX = {POD: "p", VMI: "v", VMIM: "m"}
CASES = int(os.environ.get("FOLD_FUZZ_CASES", "3000"))
GAPS = float(os.environ.get("FOLD_FUZZ_GAPS", "0"))
"""The share of losses that are a gap after what the ledger read (rather than a lost head): 0 by default."""
INTERLEAVED = float(os.environ.get("FOLD_FUZZ_INTERLEAVED", "0.3"))
"""The share of a kind's relists whose publishes interleave with the watch's events."""
SEED = int(os.environ.get("FOLD_FUZZ_SEED", "0"))


@dataclass
class Obj:
    kind: str
    uid: str
    rv: int
    fields: dict[str, Any]


@dataclass
class Truth:
    rv: int = 0
    n: int = 0
    live: dict[str, Obj] = field(default_factory=dict)
    stream: list[Event] = field(default_factory=list)
    relists: int = 0
    pending: list[Event] = field(default_factory=list)
    ends: dict[int, tuple[int, int, dict[str, dict[str, int]]]] = field(default_factory=dict)
    """id of the last marker of a full relist → (the stream index the relist started at, the truth then)."""
    kind_ends: dict[int, tuple[int, int, str, dict[str, int]]] = field(default_factory=dict)
    """id of a kind's relist marker → (the stream index its relist started at, the kind, its truth then)."""

    def _ev(self, o: Obj) -> Event:
        f = dict(o.fields)
        if "active_pods" in f:
            f["active_pods"] = dict(f["active_pods"])
        return up(o.uid, o.rv, kind=o.kind, **f)

    def create(self, kind: str, **fields: Any) -> Obj:
        self.rv += 1
        self.n += 1
        o = Obj(kind, f"{PREFIX[kind]}{self.n}", self.rv, fields)
        self.live[o.uid] = o
        self.stream.append(self._ev(o))
        return o

    def update(self, o: Obj, **fields: Any) -> None:
        self.rv += 1
        o.rv = self.rv
        o.fields = {**o.fields, **fields}
        self.stream.append(self._ev(o))

    def delete(self, o: Obj) -> None:
        self.rv += 1
        del self.live[o.uid]
        self.stream.append(down(o.uid, self.rv, kind=o.kind))

    def of(self, kind: str) -> list[Obj]:
        return [o for o in self.live.values() if o.kind == kind]

    def relist(self, kind: str, interleaved: bool = False) -> None:
        """``interleaved``: listed now, its publishes and marker interleaved with the watch's next events (no
        check of the fold after it)."""
        if interleaved:
            objs = self.of(kind)
            self.pending.extend(self._ev(o) for o in objs)
            self.pending.append(sync(sorted(o.uid for o in objs), self.rv, kind=kind))
            return
        self.flush()
        begin = len(self.stream)
        objs = self.of(kind)
        for o in objs:
            self.stream.append(self._ev(o))
        self.stream.append(sync(sorted(o.uid for o in objs), self.rv, kind=kind))
        self.kind_ends[id(self.stream[-1])] = (begin, len(self.stream) - 1, kind, {o.uid: o.rv for o in objs})

    def flush(self, count: int | None = None) -> None:
        n = len(self.pending) if count is None else min(count, len(self.pending))
        self.stream.extend(self.pending[:n])
        del self.pending[:n]

    def full_relist(self, rnd: random.Random) -> None:
        self.flush()
        begin = len(self.stream)
        kinds = list(KINDS)
        rnd.shuffle(kinds)
        for k in kinds:
            self.relist(k)
        self.relists += 1
        if rnd.random() < 0.5:
            self.stream.append(answer(f"loss-{self.relists}", rv=self.rv))
        self.ends[id(self.stream[-1])] = (begin, len(self.stream) - 1, self.expected())

    def expected(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for o in self.live.values():
            out.setdefault(o.kind, {})[o.uid] = o.rv
        return out


def step(t: Truth, rnd: random.Random) -> None:
    r = rnd.random()
    vmis, pods, migs = t.of(VMI), t.of(POD), t.of(VMIM)
    if r < 0.12 or not vmis:
        t.create(VMI, phase="Pending", vcpus=rnd.randint(1, 4))
    elif r < 0.30:
        v = rnd.choice(vmis)
        t.create(POD, phase="Running", command_vmi_uid=v.uid)
    elif r < 0.35:
        t.create(POD, phase="Running")
    elif r < 0.50:
        v = rnd.choice(vmis)
        mine = [p.uid for p in pods if p.fields.get("command_vmi_uid") == v.uid]
        named = {u: "n1" for u in mine if rnd.random() < 0.7}
        if rnd.random() < 0.2 and pods:  # (a pod not made for it: a tenant's controller reference)
            named[rnd.choice(pods).uid] = "n1"
        vcpus = v.fields["vcpus"] + (1 if rnd.random() < 0.3 else 0)
        t.update(v, phase=rnd.choice(["Scheduling", "Running", "Running"]), active_pods=named, vcpus=vcpus)
    elif r < 0.58 and pods:
        p = rnd.choice(pods)
        t.update(p, phase=rnd.choice(["Running", "Succeeded", "Failed"]))
    elif r < 0.64:
        v = rnd.choice(vmis)
        t.create(VMIM, phase="Pending")
    elif r < 0.68 and migs:
        m = rnd.choice(migs)
        t.update(m, phase=rnd.choice(["Running", "Succeeded", "Failed"]))
    elif r < 0.88:
        t.delete(rnd.choice(list(t.live.values())))
    elif r < 0.94:
        t.relist(rnd.choice(KINDS), interleaved=rnd.random() < INTERLEAVED)
    else:
        t.full_relist(rnd)


@dataclass
class Case:
    delivered: list[Event]
    start: int
    truth: dict[str, dict[str, int]]
    notes: list[str]
    checks: dict[int, dict[str, dict[str, int]]] = field(default_factory=dict)
    """Delivered index → the truth the fold must hold after it: the end of a full relist delivered whole (its
    first delivery)."""
    kind_checks: dict[int, tuple[str, dict[str, int]]] = field(default_factory=dict)
    """Delivered index → (kind, that kind's truth) after the marker of a kind's relist delivered whole."""


def make_case(seed: int) -> Case:
    rnd = random.Random(seed)
    t = Truth()
    notes: list[str] = []
    steps = rnd.randint(5, 60)
    loss_at = rnd.randint(1, steps) if rnd.random() < 0.6 else None
    lost_head = 0
    lost_from = 0  # (> 0: a gap, the ledger having read what came before it)
    for i in range(steps):
        step(t, rnd)
        t.flush(rnd.randint(0, 3))
        if i == loss_at:
            lost_head = rnd.randint(1, len(t.stream))  # the stream's head dropped, up to here
            for _ in range(rnd.randint(0, 3)):
                step(t, rnd)
            t.full_relist(rnd)  # the relist answering the loss
            if rnd.random() < GAPS:
                lost_from = rnd.randrange(lost_head)
            notes.append(f"lost base[{lost_from}:{lost_head}]")
    t.flush()
    base = list(t.stream)
    delivered = base[:lost_from] + base[lost_head:]
    origin = [*range(lost_from), *range(lost_head, len(base))]  # (each delivered event's base index; -1: a copy)
    # (b) an old watcher leader's publishes and markers, from an earlier point of the history, delivered later
    for _ in range(rnd.choice([0, 0, 1, 2, 3])):
        if len(base) < 2:
            break
        i = rnd.randrange(len(base))
        j = rnd.randint(i + 1, min(len(base), i + 12))
        window = [e for e in base[i:j] if rnd.random() < 0.7]
        # inserted after the point it was taken from
        lo = max((k + 1 for k, o in enumerate(origin) if 0 <= o < j), default=0)
        p = rnd.randint(lo, len(delivered))
        delivered[p:p] = window
        origin[p:p] = [-1] * len(window)
        notes.append(f"old leader base[{i}:{j}] at {p}")
    # (c) duplicates
    for _ in range(rnd.choice([0, 0, 1, 3, 6])):
        if not delivered:
            break
        i = rnd.randrange(len(delivered))
        p = rnd.randint(i + 1, len(delivered))
        delivered.insert(p, delivered[i])
        origin.insert(p, -1)
    final = len(t.stream)
    t.full_relist(rnd)
    delivered.extend(t.stream[final:])
    checks: dict[int, dict[str, dict[str, int]]] = {}
    seen: set[int] = set()
    for k, ev in enumerate(delivered):
        if id(ev) in t.ends and id(ev) not in seen:
            seen.add(id(ev))
            begin, end, truth = t.ends[id(ev)]
            if begin >= lost_head or end < lost_from:
                checks[k] = truth
    kind_checks: dict[int, tuple[str, dict[str, int]]] = {}
    for k, ev in enumerate(delivered):
        if id(ev) in t.kind_ends and id(ev) not in seen:
            seen.add(id(ev))
            begin, end, kind, objs = t.kind_ends[id(ev)]
            if begin >= lost_head or end < lost_from:
                kind_checks[k] = (kind, objs)
    return Case(delivered, lost_head - lost_from + 1, t.expected(), notes, checks, kind_checks)


def fold(events: list[Event], led: Ledger, start: int) -> Ledger:
    for i, ev in enumerate(events):
        led.apply(ev, start + i)
    return led


def live(led: Ledger) -> dict[str, dict[str, int]]:
    st_ = led.state("c1", "a")
    if st_ is None:
        return {}
    out: dict[str, dict[str, int]] = {}
    for kind in KINDS:
        objs = {s.uid: int(s.resource_version) for s in st_.live(kind)}
        if objs:
            out[kind] = objs
    return out


def restored(led: Ledger) -> Ledger:
    again = Ledger()
    for st_ in led.states.values():
        again.load(st_.checkpoint())
    return again


def check(seed: int) -> None:
    c = make_case(seed)
    rnd = random.Random(seed ^ 0x5EED)
    whole = Ledger()
    for k, ev in enumerate(c.delivered):
        whole.apply(ev, c.start + k)
        if k in c.kind_checks:
            kind, objs = c.kind_checks[k]
            assert live(whole).get(kind, {}) == objs, (seed, "after the relist of", kind, "ending at", k, c.notes)
        if k in c.checks:
            assert live(whole) == c.checks[k], (seed, "after the relist ending at", k, c.notes)
    assert live(whole) == c.truth, (seed, c.notes)
    reference = whole.fingerprint()
    n = len(c.delivered)
    # restarted at several points, each time from checkpoints of every state, continuing where it stopped
    cuts = sorted(rnd.sample(range(1, n), min(n - 1, 4))) if n > 1 else []
    led, at = Ledger(), 0
    for cut in cuts:
        fold(c.delivered[at:cut], led, c.start + at)
        led, at = restored(led), cut
    fold(c.delivered[at:], led, c.start + at)
    assert led.fingerprint() == reference, (seed, "chain of restarts", cuts, c.notes)
    # restarted from a checkpoint, replaying from an earlier point of the stream (events a state holds are skipped)
    if n > 1:
        cut = rnd.randrange(1, n)
        back = rnd.randint(0, cut)
        again = restored(fold(c.delivered[:cut], Ledger(), c.start))
        fold(c.delivered[back:], again, c.start + back)
        assert again.fingerprint() == reference, (seed, "replay from", back, "after cut", cut, c.notes)


@pytest.mark.parametrize("chunk", range(10))
def test_the_fold_of_a_perturbed_consistent_history_is_the_truth_and_restarts_alike(chunk: int) -> None:
    per = CASES // 10
    for seed in range(SEED + chunk * per, SEED + (chunk + 1) * per):
        check(seed)
