"""The core's memo policy (shared/bounded.py): read as a dict, at most maxsize entries, emptied when full."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.bounded import Bounded


def test_keep_remembers_and_returns_the_value() -> None:
    m: Bounded[str, int] = Bounded(4)
    assert m.keep("a", 1) == 1
    assert m.get("a") == 1 and "a" in m


def test_a_full_memo_is_emptied_before_the_next_value() -> None:
    m: Bounded[int, int] = Bounded(3)
    for i in range(3):
        m.keep(i, i)
    m.keep(3, 3)
    assert dict(m) == {3: 3}


@given(st.integers(1, 8), st.lists(st.integers(0, 20), max_size=60))
def test_never_more_than_maxsize_and_every_value_found_is_the_one_kept(maxsize: int, keys: list[int]) -> None:
    m: Bounded[int, int] = Bounded(maxsize)
    for k in keys:
        found = m.get(k)
        assert found is None or found == k * 7
        m.keep(k, k * 7)
        assert len(m) <= maxsize and m[k] == k * 7
