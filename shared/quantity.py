"""Kubernetes resource quantities, exact.

A :class:`Quantity` holds its value as an integer number of nano-units (so ``100m`` CPU is ``100_000_000``) and
the format it was written in, exactly like ``k8s.io/apimachinery/pkg/api/resource.Quantity``:

* parsing accepts ``<signed number><suffix>`` where the suffix is binary SI (``Ki Mi Gi Ti Pi Ei``), decimal SI
  (``n u m "" k M G T P E``) or a decimal exponent (``e3``, ``E-2``); precision finer than nano is rounded up;
* :meth:`Quantity.canonical` prints what the API server prints (``1024Mi`` → ``1Gi``, ``0.5`` → ``500m``,
  ``1.5Gi`` → ``1536Mi``, a binary value under 1024 or with a fraction falls back to decimal SI);
* arithmetic never uses floats.

A value beyond what an int64 of base units holds (about 9.2e18) is cut to that: the API server caps a binary value
(``10Ei``) so, and keeps a decimal one (``1e19``, ``20E``) exactly, which no quota can hold either. A negative value
is refused with :class:`~shared.errors.InvalidQuantity` unless explicitly allowed.
"""

from __future__ import annotations

import decimal
import re
from enum import Enum
from fractions import Fraction
from functools import lru_cache, total_ordering
from typing import Final

from shared.errors import InvalidQuantity
from shared.text import clipped

NANO: Final = 1_000_000_000
MAX_BASE_UNITS: Final = 2**63 - 1
MAX_NANOS: Final = MAX_BASE_UNITS * NANO
_EXPONENT_COMPUTED: Final = 100
"""An exponent more than this past the number of characters of a value's digits makes a nonzero value beyond the
range (or below a nano, which rounds up to one, as the API server rounds it), whatever the digits: it is taken as
that far out, so that ``1e999999999`` costs no more than ``1e101``."""
_BASE_DIGITS: Final = len(str(MAX_BASE_UNITS))
"""A value of at least ``10**_BASE_DIGITS`` base units is past the range (19 digits)."""
_SHORT: Final = 64
"""The longest quantity text kept in the parse cache. A longer one is parsed all the same (the API server parses any
length, and keeps a decimal value's digits as written: a pod can carry a 67-digit limit, which quota charges like
any other pod's), but not kept."""


class Format(Enum):
    BINARY_SI = "BinarySI"
    DECIMAL_SI = "DecimalSI"
    DECIMAL_EXPONENT = "DecimalExponent"


_BINARY: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL: Final = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_BY_EXP: Final = {v: k for k, v in _DECIMAL.items()}
_BINARY_BY_EXP: Final = {v: k for k, v in _BINARY.items()}

_RE: Final = re.compile(r"([+-]?)([0-9]++(?:\.[0-9]*+)?|\.[0-9]++)([A-Za-z]*+)((?<=[eE])[+-]?[0-9]++)?")
"""Matched whole (``fullmatch``); possessive, so that a long text that is no quantity is refused in one pass, not
after backtracking over each of its digits (a tenant's 256 KiB annotation: 46 ms, against 1 ms)."""
_EXP_RE: Final = re.compile(r"[eE]([+-]?[0-9]++)")
"""Matched whole (``fullmatch``)."""


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


@total_ordering
class Quantity:
    """An exact Kubernetes quantity. Immutable and hashable; equality and order compare values only."""

    __slots__ = ("_canonical", "format", "nanos")

    nanos: int
    format: Format
    _canonical: str | None

    def __init__(self, nanos: int, fmt: Format = Format.DECIMAL_SI) -> None:
        # No range check here: input is checked where it is parsed (and a single pod's totals in podusage), while
        # sums over a namespace stay exact even past int64, so one absurd object cannot stop a namespace's
        # accounting.
        object.__setattr__(self, "nanos", nanos)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "_canonical", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Quantity is immutable")

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: object, *, allow_negative: bool = False) -> Quantity:
        """Parse a quantity as Kubernetes does. Integers are accepted as plain numbers (JSON ``"cpu": 2``)."""
        if type(text) is str:  # the common case first: one cached lookup
            q = _parse_any(text)
            if q.nanos < 0 and not allow_negative:
                raise InvalidQuantity(f"quantity {_shown(text)} must not be negative")
            return q
        if isinstance(text, Quantity):
            q = text
        elif isinstance(text, bool) or not isinstance(text, (str, int, float)):
            raise InvalidQuantity(f"expected a quantity string, got {type(text).__name__} {clipped(repr(text))}")
        elif isinstance(text, int) and abs(text) > MAX_BASE_UNITS:  # (a YAML integer of 5,000 digits has no str())
            q = Quantity(MAX_NANOS if text > 0 else -MAX_NANOS)
        else:
            if isinstance(text, float):
                if text != text or text in (float("inf"), float("-inf")):
                    raise InvalidQuantity(f"invalid quantity {text!r}")
                text = repr(text)
            text = str(text)  # (no trimming: the API server refuses " 1Gi" too)
            q = _parse_any(text)
        if q.nanos < 0 and not allow_negative:
            raise InvalidQuantity(
                f"quantity {_shown(str(q) if isinstance(text, int) else str(text))} must not be negative"
            )
        return q

    @staticmethod
    @lru_cache(maxsize=4096)
    def _parse_str(s: str) -> Quantity:
        # cached: quantities are immutable and the same few strings ("1Gi", "100m") recur in every object
        return _parse(s)

    @classmethod
    def from_int(cls, value: int, fmt: Format = Format.DECIMAL_SI) -> Quantity:
        return cls(value * NANO, fmt)

    @classmethod
    def from_milli(cls, milli: int) -> Quantity:
        return cls(milli * 1_000_000, Format.DECIMAL_SI)

    @classmethod
    def from_fraction(cls, value: Fraction, fmt: Format = Format.DECIMAL_SI) -> Quantity:
        """Exact value rounded up to nano precision."""
        v = value * NANO
        return cls(_ceil_div(v.numerator, v.denominator), fmt)

    # ---- views ---------------------------------------------------------------------------------------------
    @property
    def value(self) -> Fraction:
        return Fraction(self.nanos, NANO)

    def ceil(self) -> int:
        """The value in base units, rounded up (``Quantity.Value()``)."""
        return _ceil_div(self.nanos, NANO)

    def milli_ceil(self) -> int:
        """The value in milli-units, rounded up (``Quantity.MilliValue()``)."""
        return _ceil_div(self.nanos, 1_000_000)

    def is_zero(self) -> bool:
        return self.nanos == 0

    def canonical(self) -> str:
        c = self._canonical
        if c is None:
            c = _format(self.nanos, self.format)
            object.__setattr__(self, "_canonical", c)
        return c

    def with_format(self, fmt: Format) -> Quantity:
        return self if fmt is self.format else Quantity(self.nanos, fmt)

    # ---- arithmetic (the left operand's format wins, unless it is zero: as Kubernetes' Add) ---------------
    def _fmt_with(self, other: Quantity) -> Format:
        return other.format if self.nanos == 0 else self.format

    def __add__(self, other: Quantity) -> Quantity:
        return Quantity(self.nanos + other.nanos, self._fmt_with(other))

    def __sub__(self, other: Quantity) -> Quantity:
        return Quantity(self.nanos - other.nanos, self._fmt_with(other))

    def __neg__(self) -> Quantity:
        return Quantity(-self.nanos, self.format)

    def scale(self, factor: Fraction | int) -> Quantity:
        """Multiply by an exact factor, rounding up to nano precision."""
        return Quantity.from_fraction(Fraction(self.nanos, NANO) * factor, self.format)

    def clamp0(self) -> Quantity:
        return self if self.nanos >= 0 else Quantity(0, self.format)

    # ---- comparison ----------------------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, Quantity):
            return self.nanos == other.nanos
        return NotImplemented

    def __lt__(self, other: Quantity) -> bool:
        return self.nanos < other.nanos

    def __hash__(self) -> int:
        return hash(self.nanos)

    def __str__(self) -> str:
        return self.canonical()

    def __repr__(self) -> str:
        return f"Quantity({self.canonical()!r})"


ZERO: Final = Quantity(0)


def _parse_any(s: str) -> Quantity:
    """:func:`_parse`, through the cache where ``s`` is short enough to keep (:data:`_SHORT`)."""
    return Quantity._parse_str(s) if len(s) <= _SHORT else _parse(s)


def _parse(s: str) -> Quantity:
    """The quantity ``s`` writes, of any length. Exact: the digits are scaled in decimal arithmetic with room for every
    one of them (a context as wide as the digits, times ``2**60 * 10**9`` at most), and rounded up to the nano."""
    if not s:
        raise InvalidQuantity("empty quantity")
    m = _RE.fullmatch(s)
    if m is None:
        raise InvalidQuantity(f"invalid quantity {_shown(s)}")
    sign, number, suffix, exp_digits = m.groups()
    fmt: Format
    power2 = 0
    if exp_digits is not None or _EXP_RE.fullmatch(suffix or ""):
        full = (suffix or "") + (exp_digits or "")
        em = _EXP_RE.fullmatch(full)
        if em is None:
            raise InvalidQuantity(f"invalid quantity {_shown(s)}: bad exponent {_shown(full)}")
        scale10 = _exponent(em.group(1), len(number) + _EXPONENT_COMPUTED)
        fmt = Format.DECIMAL_EXPONENT
    elif suffix in _BINARY:
        scale10, power2, fmt = 0, _BINARY[suffix], Format.BINARY_SI
    elif suffix in _DECIMAL:
        scale10, fmt = _DECIMAL[suffix], Format.DECIMAL_SI
    else:
        raise InvalidQuantity(f"invalid quantity {_shown(s)}: unknown suffix {_shown(suffix)}")
    whole = number.partition(".")[0].lstrip("0")
    if whole and len(whole) - 1 + scale10 >= _BASE_DIGITS:  # (at least 10**19 base units: no arithmetic needed)
        return Quantity(-MAX_NANOS if sign == "-" else MAX_NANOS, fmt)
    ctx = decimal.Context(prec=len(number) + 40, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
    value = ctx.multiply(ctx.scaleb(decimal.Decimal(number), scale10 + 9), 1 << power2)
    # (precision finer than nano rounds up; the API server caps a binary value past int64 and keeps a decimal one
    # exactly, which no quota holds either)
    nanos = MAX_NANOS if value > MAX_NANOS else int(value.to_integral_value(decimal.ROUND_CEILING, ctx))
    return Quantity(-nanos if sign == "-" else nanos, fmt)


def _exponent(text: str, bound: int) -> int:
    """An exponent's text (``-12``) as a number, taken no further out than ``bound`` (:data:`_EXPONENT_COMPUTED`)."""
    digits = text.lstrip("+-").lstrip("0")
    e = bound if len(digits) > len(str(bound)) else min(bound, int(digits or "0"))
    return -e if text.startswith("-") else e


def _shown(text: str) -> str:
    """``text`` quoted for an error message, cut after 64 characters."""
    return repr(clipped(text))


def _format(nanos: int, fmt: Format) -> str:
    if nanos == 0:
        return "0"
    sign = "-" if nanos < 0 else ""
    mag = abs(nanos)
    if fmt is Format.BINARY_SI and mag >= 1024 * NANO and mag % NANO == 0:
        units = mag // NANO
        exp = 0
        while units % 1024 == 0 and exp < 60:
            units //= 1024
            exp += 10
        return f"{sign}{units}{_BINARY_BY_EXP.get(exp, '')}"
    # decimal: strip factors of ten, then make the exponent a multiple of three
    mantissa, exp = mag, -9
    while mantissa % 10 == 0:
        mantissa //= 10
        exp += 1
    rem = exp % 3
    if rem:
        mantissa *= 10**rem
        exp -= rem
    if fmt is Format.DECIMAL_EXPONENT:
        return f"{sign}{mantissa}" + (f"e{exp}" if exp else "")
    if exp > 18:
        mantissa *= 10 ** (exp - 18)
        exp = 18
    return f"{sign}{mantissa}{_DECIMAL_BY_EXP[exp]}"
