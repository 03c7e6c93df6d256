"""Quantities parse and print as the Kubernetes API server does (k8s.io/apimachinery resource.Quantity)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import InvalidQuantity
from shared.quantity import MAX_BASE_UNITS, NANO, Format, Quantity

# input -> what the API server stores and prints
CANONICAL = [
    ("1024Mi", "1Gi"),
    ("1.5Gi", "1536Mi"),
    ("0.5Gi", "512Mi"),
    ("1Ki", "1Ki"),
    ("1024Ki", "1Mi"),
    ("1.5Ki", "1536"),  # binary with no exact suffix falls back to a plain number
    ("1023Mi", "1023Mi"),
    ("0.1Gi", "107374182400m"),  # a binary value with a fraction prints as decimal SI
    ("0.5", "500m"),
    ("1.5", "1500m"),
    ("100m", "100m"),
    ("1000m", "1"),
    ("2000", "2k"),
    ("1500", "1500"),
    ("1023", "1023"),
    ("1000000k", "1G"),
    ("1.5m", "1500u"),
    ("123456789n", "123456789n"),
    ("0.0000000001", "1n"),  # precision below nano rounds up
    ("1.0000000001", "1000000001n"),
    ("1e3", "1e3"),
    ("1E3", "1e3"),
    ("12e2", "1200"),
    ("100e-2", "1"),
    ("1e-3", "1e-3"),
    ("1e18", "1e18"),
    ("1E", "1E"),
    ("0", "0"),
    ("0Mi", "0"),
    ("+1", "1"),
    (".5", "500m"),
    ("1.", "1"),
    ("7Ei", "7Ei"),
]


@pytest.mark.parametrize(("text", "canonical"), CANONICAL)
def test_canonical_form_matches_the_api_server(text: str, canonical: str) -> None:
    q = Quantity.parse(text)
    assert q.canonical() == canonical
    assert Quantity.parse(canonical) == q


@pytest.mark.parametrize(
    ("text", "nanos"),
    [("100m", 100_000_000), ("1Ki", 1024 * NANO), ("1e-9", 1), ("1.5", 1_500_000_000), ("0.0000000001", 1)],
)
def test_values_are_exact_nanos(text: str, nanos: int) -> None:
    assert Quantity.parse(text).nanos == nanos


@pytest.mark.parametrize(
    "text",
    [
        "1K",
        "abc",
        "-1",
        "-100m",
        "",
        " 1Gi",
        "1Gi ",
        "1 Gi",
        "Gi",
        "1.2.3",
        "0x10",
        "1e",
        "inf",
        "NaN",
    ],
)
def test_invalid_quantities_are_refused(text: str) -> None:
    with pytest.raises(InvalidQuantity):
        Quantity.parse(text)


def test_negative_only_when_allowed() -> None:
    assert Quantity.parse("-1", allow_negative=True).nanos == -NANO
    assert Quantity.parse("-1.5Gi", allow_negative=True).canonical() == "-1536Mi"


def test_json_numbers_and_non_strings() -> None:
    assert Quantity.parse(2) == Quantity.parse("2")
    assert Quantity.parse(0.25).canonical() == "250m"
    for bad in (True, None, [1], {"a": 1}, float("nan")):
        with pytest.raises(InvalidQuantity):
            Quantity.parse(bad)


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        (str(MAX_BASE_UNITS + 1), Format.DECIMAL_SI),
        ("8Ei", Format.BINARY_SI),
        ("10Ei", Format.BINARY_SI),
        ("16E", Format.DECIMAL_SI),
        ("1e19", Format.DECIMAL_EXPONENT),
        ("1e100", Format.DECIMAL_EXPONENT),
        ("1e999999999", Format.DECIMAL_EXPONENT),
    ],
)
def test_a_value_beyond_int64_base_units_is_cut_to_it(text: str, fmt: Format) -> None:
    """The API server caps a binary value at an int64 of base units and keeps a decimal one of any size: a pod
    asking for ``1e19`` of ephemeral storage exists. Refused, it went unaccounted while native quota charged the
    rest of it; cut to the limit, it is counted, beyond any quota."""
    assert Quantity.parse(str(MAX_BASE_UNITS)).ceil() == MAX_BASE_UNITS
    q = Quantity.parse(text)
    assert q.ceil() == MAX_BASE_UNITS and q.format is fmt
    assert Quantity.parse(f"-{text}", allow_negative=True).ceil() == -MAX_BASE_UNITS


@pytest.mark.parametrize(("text", "nanos"), [("1e-999999999", 1), ("1.5e-95", 1), ("0e999999999", 0)])
def test_a_value_below_a_nano_rounds_up_to_one_however_small(text: str, nanos: int) -> None:
    assert Quantity.parse(text).nanos == nanos


def test_arithmetic_keeps_the_left_format_unless_zero() -> None:
    a, b = Quantity.parse("1Gi"), Quantity.parse("512Mi")
    assert (a + b).canonical() == "1536Mi"
    assert (a - b).canonical() == "512Mi"
    assert (Quantity(0) + b).format is Format.BINARY_SI
    assert (b - a).nanos < 0 and (b - a).clamp0().is_zero()


def test_rounding_helpers() -> None:
    q = Quantity.parse("1500m")
    assert q.ceil() == 2
    assert q.milli_ceil() == 1500
    assert Quantity.parse("1n").milli_ceil() == 1
    assert Quantity.parse("3").scale(Fraction(1, 3)).canonical() == "1"
    assert Quantity.parse("1").scale(Fraction(1, 3)).nanos == 333_333_334  # rounded up to nano


def test_equality_and_order_ignore_format() -> None:
    assert Quantity.parse("1Ki") == Quantity.parse("1024")
    assert hash(Quantity.parse("1Ki")) == hash(Quantity.parse("1024"))
    assert Quantity.parse("999m") < Quantity.parse("1")


def test_immutable() -> None:
    q = Quantity.parse("1")
    with pytest.raises(AttributeError):
        setattr(q, "nanos", 5)  # noqa: B010


_FORMATS = st.sampled_from(list(Format))


@given(st.integers(min_value=0, max_value=MAX_BASE_UNITS * NANO), _FORMATS)
def test_canonical_round_trips(nanos: int, fmt: Format) -> None:
    q = Quantity(nanos, fmt)
    text = q.canonical()
    back = Quantity.parse(text)
    assert back == q
    # canonical is a fixed point once parsed (not always at once: see the test below)
    assert Quantity.parse(back.canonical()).canonical() == back.canonical()
    if fmt is not Format.BINARY_SI:
        assert back.canonical() == text


def test_a_binary_quantity_off_the_1024_grid_prints_as_a_plain_number_that_reads_back_decimal() -> None:
    """As resource.Quantity does: 5000 in BinarySI is not a whole number of Ki, so it prints "5000"; "5000"
    has no suffix, so it parses as DecimalSI and then prints "5k". The amount never changes."""
    q = Quantity(5000 * NANO, Format.BINARY_SI)
    assert q.canonical() == "5000"
    back = Quantity.parse("5000")
    assert back == q and back.format is Format.DECIMAL_SI and back.canonical() == "5k"


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "e3", "e-3", "u", "n"]),
)
def test_parse_agrees_with_exact_arithmetic(number: int, suffix: str) -> None:
    factor = {
        "": Fraction(1),
        "m": Fraction(1, 1000),
        "k": Fraction(1000),
        "M": Fraction(10**6),
        "G": Fraction(10**9),
        "Ki": Fraction(1024),
        "Mi": Fraction(1024**2),
        "Gi": Fraction(1024**3),
        "e3": Fraction(1000),
        "e-3": Fraction(1, 1000),
        "u": Fraction(1, 10**6),
        "n": Fraction(1, 10**9),
    }[suffix]
    assert Quantity.parse(f"{number}{suffix}").value == number * factor


def test_sums_stay_exact_past_the_input_range() -> None:
    """Input is cut to int64 base units; a sum over many objects is not, so one absurd object cannot stop a
    namespace's accounting."""
    big = Quantity.parse("8E")
    total = big + big
    assert total.ceil() == 16 * 10**18 and total.canonical() == "16E"
    assert (total - big) == big
    assert Quantity.parse("16E").ceil() == MAX_BASE_UNITS, "input is cut to the range; sums are not"


_LONG_DIGITS = "1234567890123456789012345678901234567890123456789012345678901234567"


@pytest.mark.parametrize(
    ("text", "nanos"),
    [
        (_LONG_DIGITS, MAX_BASE_UNITS * NANO),
        ("1" + "0" * 5000, MAX_BASE_UNITS * NANO),
        ("0" * 5000 + "1.5Gi", 1536 * 1024**2 * NANO),
        ("0." + "0" * 100 + "1Ei", 1),
        ("0.5" + "0" * 5000 + "Gi", 512 * 1024**2 * NANO),
        ("1" + "0" * 5000 + "e-5000", NANO),
        ("1" + "0" * 300 + "e-310", 1),
        ("1e" + "9" * 5000, MAX_BASE_UNITS * NANO),
        ("1e-" + "9" * 5000, 1),
        ("1e+" + "0" * 5000 + "3", 1000 * NANO),
        ("7" * 1_000_000 + "e-999990", 7_777_777_777_777_777_778),
    ],
)
def test_a_quantity_written_in_more_than_64_characters_is_read(text: str, nanos: int) -> None:
    """The API server parses a quantity of any length, and keeps a decimal value's digits as written: a pod can
    carry a 67-digit limit, and quota charges its requests like any other pod's. Refused, the pod went unaccounted
    (dead-lettered) while native quota charged it."""
    assert Quantity.parse(text).nanos == nanos


def test_an_unreadable_long_quantity_is_named_in_a_short_line() -> None:
    with pytest.raises(InvalidQuantity) as e:
        Quantity.parse("1" * 100_000 + "Xi")
    assert len(str(e.value)) < 200 and "..." in str(e.value)


@given(
    st.sampled_from(["", "+", "-"]),
    st.text("0123456789", min_size=1, max_size=120),
    st.one_of(st.none(), st.text("0123456789", max_size=120)),
    st.one_of(
        st.sampled_from(["", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]),
        st.integers(min_value=-400, max_value=400).map(lambda e: f"e{e}"),
        st.integers(min_value=0, max_value=400).map(lambda e: f"E+{e}"),
    ),
)
def test_parse_of_any_length_agrees_with_exact_arithmetic(sign: str, whole: str, frac: str | None, suffix: str) -> None:
    """The value of a quantity of any length and exponent, against a plain computation in fractions: rounded up to
    the nano, cut at an int64 of base units either way."""
    text = f"{sign}{whole}" + (f".{frac}" if frac is not None else "") + suffix
    digits = frac or ""
    mantissa = Fraction(int(whole + digits), 10 ** len(digits))
    if suffix[:1] in ("e", "E") and suffix[1:2] not in ("", "i"):
        factor = Fraction(10) ** int(suffix[1:])
    else:
        factor = Fraction(
            2 ** {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}[suffix]
            if suffix.endswith("i")
            else Fraction(10)
            ** {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}[suffix]
        )
    exact = mantissa * factor * NANO
    nanos = min(-((-exact.numerator) // exact.denominator), MAX_BASE_UNITS * NANO)
    q = Quantity.parse(text, allow_negative=True)
    assert q.nanos == (-nanos if sign == "-" else nanos)


def test_an_integer_past_what_str_prints_is_cut_and_errors_stay_short() -> None:
    """A YAML integer of 5,000 digits (PyYAML makes it an int, which Python will not print) was a ValueError; a
    negative or non-string value of any size was quoted whole in its error."""
    assert Quantity.parse(10**5000).ceil() == MAX_BASE_UNITS
    assert Quantity.parse(-(10**5000), allow_negative=True).ceil() == -MAX_BASE_UNITS
    for bad in (-(10**5000), "-" + "1" * 200_000, [1] * 100_000):
        with pytest.raises(InvalidQuantity) as e:
            Quantity.parse(bad)
        assert len(str(e.value)) < 200, str(e.value)[:300]
