"""Reading Kubernetes objects from files for the command line (``vmquota render``, ``vmquota usage``).

:func:`load_objects` reads YAML or JSON from a file or ``-`` (stdin): several YAML documents, a ``kind: List``
(or any ``*List`` with ``items``, as ``kubectl get -o yaml`` prints), a JSON array, or a single object. Empty
documents are skipped. Timestamps stay strings (as Kubernetes' YAML-to-JSON conversion keeps them). Malformed input
raises :class:`~shared.errors.InvalidInput` naming the file and the document (1-based).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, TextIO

import yaml

from shared.errors import InvalidInput
from shared.fields import mapping, string
from shared.kinds import KUBEVIRT_KIND
from shared.kubevirt.config import config_fields_from_cr, fallback_note
from shared.text import clipped
from shared.vmi import object_ref

_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_Base):  # type: ignore[misc]
    """SafeLoader (libyaml when available) without the timestamp resolver: dates stay strings, as in JSON."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}

_DIGITS: Final = sys.get_int_max_str_digits()
"""The most decimal digits Python converts an integer to or from (0: no limit)."""
_TOO_LONG: Final = f"a number of more than {_DIGITS:,} digits (quote it)"


def _integer(loader: Any, node: Any) -> int:
    """A YAML integer, refused (a YAML error, its place named) when Python could not print it in decimal: a
    hexadecimal or binary one of that size loads, then fails wherever it is printed."""
    try:
        value: int = yaml.SafeLoader.construct_yaml_int(loader, node)
    except (ValueError, IndexError) as e:  # (a decimal one past the limit; `!!int abc`, `!!int ''`)
        why = _TOO_LONG if "integer string conversion" in str(e) else f"not an integer: {clipped(node.value)!r}"
        raise yaml.constructor.ConstructorError(None, None, why, node.start_mark) from None
    if _DIGITS and abs(value) >= 10**_DIGITS:
        raise yaml.constructor.ConstructorError(None, None, _TOO_LONG, node.start_mark)
    return value


_Loader.add_constructor("tag:yaml.org,2002:int", _integer)

CONSTRUCTION_ERRORS: Final = (ValueError, TypeError, LookupError, AttributeError)
"""What PyYAML's safe constructors raise for a value an explicit tag does not fit (``!!float abc``, ``!!bool x``,
``!!timestamp abc``), beside its own errors."""


def load_yaml(text: str) -> object:
    """One YAML document, read as the files of objects are (:class:`_Loader`); :class:`InvalidInput` in one line
    when it is not YAML, or a value does not fit its tag."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise InvalidInput(yaml_problem(e)) from None
    except RecursionError:
        raise InvalidInput("invalid YAML: nested too deeply") from None
    except CONSTRUCTION_ERRORS as e:
        raise InvalidInput(f"invalid YAML: {_cut(str(e))}") from None


MAX_OBJECTS_TEXT: Final = 256 * 2**20
"""Most characters a file of objects (``-f``, a seed or scenario file) may hold: a ``kubectl get -o yaml`` of
tens of thousands of VMs and pods fits; ``/dev/zero`` or a runaway pipe is refused instead of read until the
machine's memory is gone."""

MAX_SETTING_TEXT: Final = 16 * 2**20
"""Most characters a file a setting names (a kubeconfig, a CA bundle, a credentials file) may hold."""


def _read_at_most(f: TextIO, limit: int) -> str:
    """All of ``f``, or :class:`InvalidInput` once it holds more than ``limit`` characters (never more read)."""
    text = f.read(limit + 1)
    if len(text) > limit:
        raise InvalidInput(f"is larger than {limit // 2**20} MiB")
    return text


def read_text(path: str) -> tuple[str, str]:
    """(display name, text) of a file or ``-`` (stdin), at most :data:`MAX_OBJECTS_TEXT` characters. A named pipe
    (``-f <(kubectl get ...)``) is read as a file is, so one with no writer waits for one, as ``cat`` does."""
    if path == "-":
        try:
            return "<stdin>", _read_at_most(sys.stdin, MAX_OBJECTS_TEXT)
        except InvalidInput as e:
            raise e.at("<stdin>") from None
        except UnicodeDecodeError:
            raise InvalidInput("is not UTF-8 text", "<stdin>") from None
    try:
        with open(path, encoding="utf-8") as f:
            return path, _read_at_most(f, MAX_OBJECTS_TEXT)
    except InvalidInput as e:
        raise e.at(path) from None
    except FileNotFoundError:
        raise InvalidInput("no such file", path) from None
    except IsADirectoryError:
        raise InvalidInput("is a directory, not a file", path) from None
    except UnicodeDecodeError:
        raise InvalidInput("is not UTF-8 text", path) from None
    except OSError as e:
        raise InvalidInput(e.strerror or str(e), path) from None


def read_setting_file(path: str, flag: str, *, shown: str | None = None, kind: str = "", lenient: bool = False) -> str:
    """The text of a file a setting names (a kubeconfig, a CA bundle, a credentials file); :class:`InvalidInput`
    naming the setting ``flag`` when it cannot be read, the file ``shown`` as the operator gave it (``path``
    otherwise). Not UTF-8 text is an error (``kind`` says what it should have been) unless ``lenient``: the
    setting's own check then says what the text is not."""
    shown = shown or path
    try:
        with open(path, encoding="utf-8", errors="replace" if lenient else "strict") as f:
            return _read_at_most(f, MAX_SETTING_TEXT)
    except InvalidInput as e:
        raise InvalidInput(f"{shown} {e.message}", flag) from None
    except FileNotFoundError:
        raise InvalidInput(f"no such file: {shown}", flag) from None
    except IsADirectoryError:
        raise InvalidInput(f"{shown} is a directory, not a file", flag) from None
    except UnicodeDecodeError:
        raise InvalidInput(f"{shown} is not UTF-8 text{f' (not {kind})' if kind else ''}", flag) from None
    except OSError as e:
        raise InvalidInput(f"cannot read {shown}: {e.strerror or e}", flag) from None


def _documents(name: str, text: str) -> Iterator[tuple[int, object]]:
    stripped = text.lstrip()
    if stripped[:1] in ("{", "["):
        json_error: str
        try:
            yield 1, json.loads(text)
            return
        except ValueError as e:
            json_error = _TOO_LONG if "integer string conversion" in str(e) else str(e)
        except RecursionError:
            json_error = "nested too deeply"
        try:  # flow-style YAML also starts with a brace
            docs = list(yaml.load_all(text, Loader=_Loader))
        except (yaml.YAMLError, RecursionError, *CONSTRUCTION_ERRORS):
            raise InvalidInput(f"invalid JSON: {_cut(json_error)}", f"{name}: document 1") from None
        yield from enumerate(docs, 1)
        return
    index = 0
    try:
        for index, doc in enumerate(yaml.load_all(text, Loader=_Loader), 1):
            yield index, doc
    except yaml.YAMLError as e:
        raise InvalidInput(yaml_problem(e), f"{name}: document {index + 1}") from None
    except RecursionError:
        raise InvalidInput("invalid YAML: nested too deeply", f"{name}: document {index + 1}") from None
    except CONSTRUCTION_ERRORS as e:  # (an explicit tag on a value it does not fit: !!float abc)
        raise InvalidInput(f"invalid YAML: {_cut(str(e))}", f"{name}: document {index + 1}") from None


def _cut(text: str) -> str:
    """A parser's message, at most one line of 200 characters."""
    return clipped(text.splitlines()[0] if text else text, 200)


def load_documents(path: str | Path) -> tuple[str, list[object]]:
    """(display name, the YAML or JSON documents of a file, empty ones skipped); InvalidInput naming the file when
    it cannot be read or parsed (a file that is not UTF-8 text, nesting too deep: one line, never a traceback)."""
    name, text = read_text(str(path))
    return name, [doc for _, doc in _documents(name, text) if doc is not None]


def yaml_problem(e: yaml.YAMLError) -> str:
    """One line for a YAML error: ``invalid YAML (line 2): expected the node content, but found '<stream end>'``
    (PyYAML's own text spans several lines and quotes the input)."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1})" if mark is not None else ""
    problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
    return f"invalid YAML{where}: {problem}"


def parse_objects(name: str, text: str) -> list[dict[str, Any]]:
    """The objects in ``text`` (see the module docstring); ``name`` is used in error messages."""
    out: list[dict[str, Any]] = []
    for index, doc in _documents(name, text):
        where = f"{name}: document {index}"
        if doc is None:
            continue
        if isinstance(doc, list):
            items, prefix = doc, ""
        elif isinstance(doc, dict):
            kind = doc.get("kind")
            if isinstance(kind, str) and kind.endswith("List") and "items" in doc:
                items, prefix = doc.get("items") or [], "items"
                if not isinstance(items, list):
                    raise InvalidInput("expected a list", f"{where}: items")
            else:
                out.append(doc)
                continue
        else:
            raise InvalidInput(f"expected an object, got {type(doc).__name__} {doc!r:.40}", where)
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise InvalidInput(f"expected an object, got {type(item).__name__}", f"{where}: {prefix}[{i}]")
            out.append(item)
    return out


def load_objects(path: str) -> list[dict[str, Any]]:
    """Read the Kubernetes objects of a YAML/JSON file, or of stdin when ``path`` is ``-``."""
    name, text = read_text(path)
    return parse_objects(name, text)


def kubevirt_fields(path: str, version: str | None, notes: TextIO) -> dict[str, Any]:
    """The :class:`~shared.kubevirt.KubeVirtConfig` fields the first KubeVirt object in file ``path`` sets
    (``--kubevirt-config``); ``version`` (``--kubevirt-version``), when given, is used instead of its observed
    version, which then need not be one this build knows."""
    crs = [o for o in load_objects(path) if o.get("kind") == KUBEVIRT_KIND]
    if not crs:
        raise InvalidInput("no KubeVirt object found", path)
    return cr_fields(crs[0], version, notes, path)


def cr_fields(cr: Mapping[str, Any], version: str | None, notes: TextIO, where: str = "") -> dict[str, Any]:
    """:func:`kubevirt_fields` of a KubeVirt object at hand (``where``: what to name it after in errors). When its
    observed version is newer than this build knows and no ``version`` is given, a note says so on ``notes``."""
    try:
        fields = config_fields_from_cr(cr, version=version)
    except InvalidInput as e:
        e = e.at(object_ref(cr))
        raise InvalidInput(e.message, f"{where}: {e.where}" if where else e.where) from None
    if version is None:  # (the observed version, which config_fields_from_cr has read and checked)
        note = fallback_note(string(mapping(cr, "status", ""), "observedKubeVirtVersion", "status"))
        if note is not None:
            print(f"note: {note} (--kubevirt-version picks another)", file=notes)
    return fields
