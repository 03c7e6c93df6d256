"""Resource lists: parsing with errors that name the key, canonical output, and the accounting operations."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import InvalidInput
from shared.quantity import Format, Quantity
from shared.resources import (
    add,
    charged_alike,
    equal,
    fits,
    format_resource_list,
    growth,
    is_byte_resource,
    maximum,
    natural_format,
    nonzero,
    only,
    parse_resource_list,
    positive_part,
    sub,
)


def rl(**kw: str) -> dict[str, Quantity]:
    return {k.replace("_", "."): Quantity.parse(v) for k, v in kw.items()}


def test_parse_and_format_canonical_sorted() -> None:
    parsed = parse_resource_list({"memory": "1024Mi", "cpu": "0.5", "pods": 10})
    assert format_resource_list(parsed) == {"cpu": "500m", "memory": "1Gi", "pods": "10"}
    assert list(format_resource_list(parsed)) == ["cpu", "memory", "pods"]
    assert parse_resource_list(None) == {}


@pytest.mark.parametrize(
    ("obj", "where"),
    [
        ({"cpu": "abc"}, "spec.hard.cpu"),
        ({"memory": "1K"}, "spec.hard.memory"),
        ({"cpu": "-1"}, "spec.hard.cpu"),
        ({"": "1"}, "spec.hard"),
        ("1Gi", "spec.hard"),
    ],
)
def test_errors_name_the_field(obj: object, where: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_resource_list(obj, "spec.hard")
    assert err.value.where == where


def test_negative_allowed_only_on_request() -> None:
    assert parse_resource_list({"cpu": "-1"}, allow_negative=True)["cpu"].nanos < 0


def test_add_sub_maximum_growth() -> None:
    a, b = rl(cpu="1", memory="1Gi"), rl(cpu="500m", pods="1")
    assert format_resource_list(add(a, b)) == {"cpu": "1500m", "memory": "1Gi", "pods": "1"}
    assert format_resource_list(sub(a, b)) == {"cpu": "500m", "memory": "1Gi", "pods": "-1"}
    assert format_resource_list(maximum(a, b)) == {"cpu": "1", "memory": "1Gi", "pods": "1"}
    assert format_resource_list(growth(rl(cpu="2", memory="1Gi"), a)) == {"cpu": "1"}
    assert growth(a, rl(cpu="4", memory="4Gi")) == {}
    assert a == rl(cpu="1", memory="1Gi")  # inputs untouched


def test_fits_checks_only_requested_hard_resources() -> None:
    hard = rl(cpu="2", memory="2Gi")
    assert fits(rl(cpu="1"), rl(cpu="1"), hard) == []
    assert fits(rl(cpu="1001m"), rl(cpu="1"), hard) == ["cpu"]
    assert fits(rl(pods="100"), {}, hard) == []  # not constrained


def test_helpers() -> None:
    assert format_resource_list(only(rl(cpu="1", pods="2"), ["pods"])) == {"pods": "2"}
    assert nonzero(rl(cpu="0", pods="1")) == rl(pods="1")
    assert equal(rl(cpu="0"), {})
    assert not equal(rl(cpu="1"), {})
    assert positive_part(parse_resource_list({"cpu": "-1"}, allow_negative=True))["cpu"].is_zero()


@pytest.mark.parametrize(
    ("name", "byte"),
    [
        ("memory", True),
        ("limits.memory", True),
        ("requests.ephemeral-storage", True),
        ("hugepages-2Mi", True),
        ("requests.hugepages-1Gi", True),
        ("memory/vmi", True),
        ("requests.storage", True),
        ("cpu", False),
        ("pods", False),
        ("requests.nvidia.com/gpu", False),
    ],
)
def test_byte_resources(name: str, byte: bool) -> None:
    assert is_byte_resource(name) is byte
    assert natural_format(name) is (Format.BINARY_SI if byte else Format.DECIMAL_SI)


_lists = st.dictionaries(
    st.sampled_from(["cpu", "memory", "pods", "limits.cpu"]),
    st.integers(min_value=0, max_value=10**15).map(lambda n: Quantity(n)),
    max_size=4,
)


@given(_lists, _lists)
def test_add_then_sub_is_identity(a: dict[str, Quantity], b: dict[str, Quantity]) -> None:
    assert equal(sub(add(a, b), b), a)
    assert equal(add(a, growth(b, a)), maximum(a, b))


def test_a_request_and_its_bare_name_are_charged_alike() -> None:
    """Quota charges ``cpu`` and ``requests.cpu`` the same amount (memory, ephemeral storage and hugepages likewise); a
    limit, an object count and an extended resource have one name each."""
    assert charged_alike(["cpu", "requests.memory", "hugepages-2Mi"]) == {
        "cpu",
        "requests.cpu",
        "memory",
        "requests.memory",
        "hugepages-2Mi",
        "requests.hugepages-2Mi",
    }
    assert charged_alike(["limits.cpu", "requests.nvidia.com/gpu", "count/pods"]) == {
        "limits.cpu",
        "requests.nvidia.com/gpu",
        "nvidia.com/gpu",
        "count/pods",
    }
