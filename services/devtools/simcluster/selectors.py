"""Kubernetes label and field selectors: parsing (with the API server's 400 errors) and matching.

Label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a`` (exists), ``!a`` (does not
exist), ``a>3``, ``a<3``, comma-separated (AND). Field selectors: ``f=v``, ``f==v``, ``f!=v``, comma-separated, with
backslash escapes; only the fields a resource supports (else ``field label not supported``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from services.devtools.simcluster.store_api import ApiError
from shared.resources import is_qualified_name

LabelOp = Literal["=", "!=", "in", "notin", "exists", "!", "gt", "lt"]

_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_TOKEN_RE = re.compile(r"\s*(\(|\)|,|!=|==|=|!|>|<|[^\s(),!=<>]+)")


def _bad(detail: str) -> ApiError:
    return ApiError(400, "BadRequest", f"unable to parse requirement: {detail}")


def _check_key(key: str) -> None:
    if not is_qualified_name(key):  # (as the API server: "/name", an empty prefix, is refused too)
        raise _bad(f'invalid label key "{key}": name part must consist of alphanumeric characters, "-", "_" or "."')


def _check_value(value: str) -> None:
    if len(value) > 63 or not _VALUE_RE.match(value):
        raise _bad(f'invalid label value: "{value}": a valid label must be an empty string or consist of alphanumeric')


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: LabelOp
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        op = self.op
        if op == "exists":
            return self.key in labels
        if op == "!":
            return self.key not in labels
        value = labels.get(self.key)
        if op == "=" or op == "in":
            return value is not None and value in self.values
        if op == "!=" or op == "notin":
            return value is None or value not in self.values
        if value is None:
            return False
        try:
            have = int(value)
        except ValueError:
            return False
        want = int(next(iter(self.values)))
        return have > want if op == "gt" else have < want


@dataclass(frozen=True, slots=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.requirements

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    @classmethod
    def from_object(cls, selector: Mapping[str, Any]) -> LabelSelector:
        """A ``metav1.LabelSelector`` (``matchLabels``, ``matchExpressions`` with In, NotIn, Exists,
        DoesNotExist); 400 for an unknown operator."""
        reqs = [Requirement(str(k), "=", frozenset({str(v)})) for k, v in (selector.get("matchLabels") or {}).items()]
        ops: dict[str, LabelOp] = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
        for e in selector.get("matchExpressions") or []:
            op = ops.get(str(e.get("operator", "")))
            if op is None:
                raise _bad(f"{e.get('operator')!r} is not a valid label selector operator")
            reqs.append(Requirement(str(e.get("key", "")), op, frozenset(str(v) for v in e.get("values") or [])))
        return cls(tuple(reqs))


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:  # pragma: no cover - the pattern matches any non-space character
            raise _bad(text[pos:])
        out.append(m.group(1))
        pos = m.end()
    return out


@lru_cache(maxsize=512)
def parse_label_selector(text: str | None) -> LabelSelector:
    """Parse a label selector string; ``ApiError`` 400 on bad syntax. Empty or None selects everything."""
    if not text or not text.strip():
        return LabelSelector()
    toks = _tokens(text)
    reqs: list[Requirement] = []
    i = 0

    def peek(k: int = 0) -> str | None:
        return toks[i + k] if i + k < len(toks) else None

    while i < len(toks):
        tok = toks[i]
        if tok == "!":
            key = peek(1)
            if key is None or key in "(),!=<>":
                raise _bad(f"found '{key or ''}', expected: identifier after '!'")
            _check_key(key)
            reqs.append(Requirement(key, "!"))
            i += 2
        elif tok in "(),=<>" or tok in ("!=", "=="):
            raise _bad(f"found '{tok}', expected: !, identifier, or 'end of string'")
        else:
            key = tok
            _check_key(key)
            op = peek(1)
            if op is None or op == ",":
                reqs.append(Requirement(key, "exists"))
                i += 1
            elif op in ("=", "==", "!=", ">", "<"):
                value = peek(2)
                if value is None or value == ",":
                    value = ""
                    i += 2
                elif value in "()!=<>":
                    raise _bad(f"found '{value}', expected: identifier")
                else:
                    i += 3
                _check_value(value)
                if op in (">", "<"):
                    try:
                        int(value)
                    except ValueError:
                        raise _bad(f"for 'Gt', 'Lt' operators, the value must be an integer: {value!r}") from None
                    reqs.append(Requirement(key, "gt" if op == ">" else "lt", frozenset((value,))))
                else:
                    reqs.append(Requirement(key, "!=" if op == "!=" else "=", frozenset((value,))))
            elif op in ("in", "notin"):
                if peek(2) != "(":
                    raise _bad(f"found '{peek(2) or ''}', expected: '('")
                i += 3
                values: set[str] = set()
                expect_value = True
                while True:
                    t = peek()
                    if t is None:
                        raise _bad("found 'end of string', expected: ')'")
                    i += 1
                    if t == ")":
                        if expect_value and values:
                            values.add("")
                        break
                    if t == ",":
                        if expect_value:
                            values.add("")
                        expect_value = True
                        continue
                    if not expect_value or t in "(!=<>":
                        raise _bad(f"found '{t}', expected: ',', ')' or identifier")
                    _check_value(t)
                    values.add(t)
                    expect_value = False
                if not values:
                    raise _bad(f"for 'in', 'notin' operators, values set can't be empty: {key}")
                reqs.append(Requirement(key, op, frozenset(values)))  # type: ignore[arg-type]
            else:
                raise _bad(f"found '{op}', expected: in, notin, =, ==, !=, gt, lt")
        nxt = peek()
        if nxt is not None:
            if nxt != ",":
                raise _bad(f"found '{nxt}', expected: ',' or 'end of string'")
            i += 1
            if peek() is None:
                raise _bad("found 'end of string', expected: identifier after ','")
    return LabelSelector(tuple(reqs))


FieldOp = Literal["=", "!="]


@dataclass(frozen=True, slots=True)
class FieldSelector:
    terms: tuple[tuple[str, FieldOp, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.terms

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(f for f, _, _ in self.terms)

    def matches(self, fields: Mapping[str, str]) -> bool:
        return all((fields.get(name, "") == value) == (op == "=") for name, op, value in self.terms)

    def check(self, supported: Collection[str]) -> FieldSelector:
        """400 BadRequest like the API server for a field the resource cannot be selected by."""
        for name, _, _ in self.terms:
            if name not in supported:
                raise ApiError(400, "BadRequest", f'field label not supported: "{name}"')
        return self


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            continue
        if c == sep:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _unescape(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1] not in "\\,=!":
                raise ApiError(400, "BadRequest", f"invalid field selector: invalid escape sequence in {text!r}")
            out.append(text[i + 1])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


@lru_cache(maxsize=512)
def parse_field_selector(text: str | None) -> FieldSelector:
    """Parse a field selector string; ``ApiError`` 400 on bad syntax. Empty or None selects everything."""
    if not text or not text.strip():
        return FieldSelector()
    terms: list[tuple[str, FieldOp, str]] = []
    for part in _split_unescaped(text, ","):
        if not part:
            continue
        m = re.match(r"^((?:[^\\=!]|\\.)*)(!=|==|=)(.*)$", part)
        if m is None or not m.group(1).strip():
            raise ApiError(400, "BadRequest", f"invalid field selector: {part!r}: expected field=value or field!=value")
        op: FieldOp = "!=" if m.group(2) == "!=" else "="
        terms.append((_unescape(m.group(1).strip()), op, _unescape(m.group(3).strip())))
    return FieldSelector(tuple(terms))
