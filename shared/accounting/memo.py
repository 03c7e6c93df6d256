"""The incremental accelerator's memory: values derived from objects, kept per slot with the very objects they
came from (:class:`Memo`), one per KubeVirt configuration, kept here beside it. The accounting passes are written
once, asking their memo for each value they derive; accounting with ``memoize=False`` gets :data:`NO_MEMO`, which
remembers nothing (every value is computed), and gives the same result: the reference the tests compare with.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Final

from shared.bounded import Bounded
from shared.kubevirt import KubeVirtConfig
from shared.snapshot import KubeVirtSnapshot, Snapshot, encode


class Memo:
    """Values derived from objects, one per *slot* (a VMI's estimate, a VM's entry, a namespace's pod pass, a
    sum's chunks): only the latest version of an object is worth keeping, so the memo is as large as the live
    objects, not as their history (which would also make every full garbage collection walk the history). A value
    is kept with the objects it was derived from and the inputs it depends on (``key``); a hit needs an equal key
    and the very same objects (a key of their ids: the entry keeps them alive, so no other object has those ids)
    or objects with the same encoded form, so a reused identity with other content (a fixture, a restored object)
    is recomputed, never served stale: a result is the same with and without the memo. Slots least recently
    written go first when it is full."""

    __slots__ = ("_latest", "_maxsize", "_next_token", "_tokens")

    remembers: bool = True
    """False for :class:`NoMemo` (what only an accelerator does, such as chunked sums, is then not done)."""

    def __init__(self, maxsize: int) -> None:
        self._latest: dict[Hashable, tuple[Hashable, tuple[object, ...], Any]] = {}
        self._maxsize = maxsize
        self._tokens: Bounded[Hashable, int] = Bounded(256)
        self._next_token = 0

    def get_latest(self, slot: Hashable, key: Hashable, objs: tuple[Snapshot, ...] | None = None) -> Any:
        """The value last remembered in ``slot`` if it was for ``key`` (and, given ``objs``, for the same or equal
        objects), else :data:`MISS`."""
        hit = self._latest.get(slot)
        if hit is None or hit[0] != key:
            return MISS
        if objs is not None:
            kept = hit[1]
            if len(kept) != len(objs):
                return MISS
            for a, b in zip(kept, objs, strict=True):
                if a is not b and encode(a) != encode(b):  # type: ignore[arg-type]  # Quantity equality ignores the format: compare the wire form
                    return MISS
        return hit[2]

    def latest(
        self, slot: Hashable, key: Hashable, objs: tuple[object, ...], compute: Callable[..., Any], *args: Any
    ) -> Any:
        """The value in ``slot`` for ``key`` (a key made of ids of ``objs``), else ``compute(*args)``, remembered."""
        hit = self._latest.get(slot)
        if hit is not None and hit[0] == key:
            return hit[2]
        found = compute(*args)
        self.put_latest(slot, key, objs, found)
        return found

    def last(self, slot: Hashable) -> tuple[Hashable, tuple[object, ...], Any] | None:
        """What ``slot`` holds, whatever its key: (key, objects, value)."""
        return self._latest.get(slot)

    def put_latest(self, slot: Hashable, key: Hashable, objs: tuple[object, ...], value: Any) -> None:
        latest = self._latest
        latest.pop(slot, None)
        latest[slot] = (key, objs, value)
        if len(latest) > self._maxsize:
            del latest[next(iter(latest))]

    def token(self, value: Hashable) -> int:
        """A small number standing for ``value`` in keys (cheap to hash); never reused for another value."""
        t = self._tokens.get(value)
        if t is None:
            t = self._tokens.keep(value, self._next_token)
            self._next_token += 1
        return t


class NoMemo(Memo):
    """A memo that remembers nothing: every value asked for is computed (the plain reference accounting)."""

    __slots__ = ()

    remembers = False

    def __init__(self) -> None:
        super().__init__(0)

    def get_latest(self, slot: Hashable, key: Hashable, objs: tuple[Snapshot, ...] | None = None) -> Any:
        return MISS

    def latest(
        self, slot: Hashable, key: Hashable, objs: tuple[object, ...], compute: Callable[..., Any], *args: Any
    ) -> Any:
        return compute(*args)

    def last(self, slot: Hashable) -> tuple[Hashable, tuple[object, ...], Any] | None:
        return None

    def put_latest(self, slot: Hashable, key: Hashable, objs: tuple[object, ...], value: Any) -> None:
        return None

    def token(self, value: Hashable) -> int:
        return -1


NO_MEMO: Final = NoMemo()
MISS: Final = object()
_MEMO_SIZE: Final = 65536
"""Memo slots per KubeVirt configuration: some ten per VM (its renderings, its entry, a migration target's estimate
and growth, its pods' entries) and a few per namespace and quota; past that, misses only cost time."""
_config_memo: tuple[KubeVirtSnapshot, KubeVirtConfig] | None = None


def config_of(kv: KubeVirtSnapshot | None, memoize: bool) -> KubeVirtConfig:
    """The configuration of a KubeVirt snapshot (KubeVirt's defaults without one); the last one is remembered so
    that its memoised estimates survive from one accounting to the next."""
    global _config_memo
    if kv is None:
        return _DEFAULT_CONFIG if memoize else KubeVirtConfig()
    memo = _config_memo
    if memoize and memo is not None and (memo[0] is kv or encode(memo[0]) == encode(kv)):
        return memo[1]
    config = KubeVirtConfig.from_cr(kv.as_object())
    if memoize:
        _config_memo = (kv, config)
    return config


_DEFAULT_CONFIG: Final = KubeVirtConfig()


def memo_of(config: KubeVirtConfig) -> Memo:
    """The memo of values derived under this configuration (they depend on it): KubeVirt's defaults have one, and
    the configuration accounted last has one, kept beside it here (a configuration is immutable and holds no memo
    of its own); another configuration gets a new one (a KubeVirt CR changes rarely; the old values are then
    worthless)."""
    global _last_memo
    if config is _DEFAULT_CONFIG:
        return _DEFAULT_MEMO
    last = _last_memo
    if last is not None and last[0] is config:
        return last[1]
    memo = Memo(_MEMO_SIZE)
    _last_memo = (config, memo)
    return memo


_DEFAULT_MEMO: Final = Memo(_MEMO_SIZE)
_last_memo: tuple[KubeVirtConfig, Memo] | None = None
