"""ValidatingAdmissionPolicy: the in-apiserver CEL admission of ``admissionregistration.k8s.io/v1``, as
kube-apiserver runs it (``staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating``).

For every write, each ``ValidatingAdmissionPolicyBinding`` whose policy exists is considered:

1. the policy's ``matchConstraints`` (``resourceRules``: apiGroups, apiVersions, operations, resources with
   ``*``; ``namespaceSelector``, ``objectSelector``; an empty selector matches everything) and the binding's
   ``matchResources`` (which can only narrow) must match the request;
2. with a ``paramKind``, the binding's ``paramRef`` names the parameter object: by ``name`` (or ``selector``), in
   ``paramRef.namespace`` or, unset, in the namespace of the object being admitted. None found:
   ``parameterNotFoundAction: Allow`` skips the binding, ``Deny`` refuses the request;
3. every ``matchCondition`` must be true (else the binding is skipped);
4. every ``validation`` must be true; a ``variable`` is evaluated where an expression first reads it, as Kubernetes
   evaluates them (one nothing reads, or behind a ``&&`` or ``||`` the other side decides, is not; one that fails
   fails only what reads it: ``_Variables``). A false one with the action
   ``Deny`` refuses the request with ``<resource> "<name>" is forbidden: ValidatingAdmissionPolicy '<policy>'
   with binding '<binding>' denied request: <message>``, the HTTP code of the validation's ``reason`` (422
   ``Invalid`` when unset). An expression that fails to evaluate refuses the request under
   ``failurePolicy: Fail`` (the default) and is ignored under ``Ignore``. The message is the validation's
   ``messageExpression`` when that gives one line of at most 5 KiB (kube-apiserver drops a longer one:
   ``MaxEvaluatedMessageExpressionSizeBytes``), else its ``message``, else ``failed expression: <expression>``.

Expressions are CEL, evaluated by CEL's C++ implementation (the ``cel-expr-python`` bindings) with the variables
Kubernetes binds (``object``, ``oldObject``, ``request``, ``params``, ``namespaceObject``, ``variables``) and the
Kubernetes CEL libraries our shipped policies use (the strings extension: ``join``, ``split``, ``substring``; the
quantity library: ``quantity``, ``asApproximateFloat``; the lists library: ``sum``, ``max`` of doubles). CEL's cost
limits (one million per expression or variable, ten million per policy evaluation) are not modelled: the shipped
policies are kept within them (``docs/accounting.md``, "The reservation guard", "Within the API server's CEL
limits"). Policies, bindings and parameters are read from the store at each request (each version decoded once): the
simulator has no informer lag (a real API server's policy and parameter informers trail writes by milliseconds;
``docs/accounting.md`` says what that leaves open). CEL is handed, of each object, only the fields an expression
selects (``_read_paths``; the shipped policies' expressions evaluate alike either way,
``tests/unit/test_sim_policy_projection.py``): converting whole objects to CEL's values, once per parameter, was
most of the simulator's time with the guard installed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgspec

from services.devtools.simcluster.auth import current_user
from services.devtools.simcluster.selectors import LabelSelector
from services.devtools.simcluster.store import Store
from services.devtools.simcluster.store_api import DELETE_OPTIONS, ApiError, Obj, Operation, Resource
from shared.errors import SIM_INSTALL, InvalidInput
from shared.quantity import Quantity

V = TypeVar("V")
_REASON_CODES: Final = {"Unauthorized": 401, "Forbidden": 403, "Invalid": 422, "RequestEntityTooLarge": 413}
_decode = msgspec.json.Decoder().decode


class _Unsupported(Exception):
    pass


MAX_MESSAGE_EXPRESSION_BYTES: Final = 5 * 1024
"""The longest ``messageExpression`` result kube-apiserver keeps (``k8s.io/apiserver/pkg/apis/cel/config.go``)."""
_VARIABLES: Final = ("object", "oldObject", "request", "params", "namespaceObject", "variables")


@functools.cache
def _cel() -> tuple[Any, Any]:
    """CEL's C++ implementation (``cel-expr-python``, from the CEL project itself) with the extensions of Kubernetes'
    CEL environment our shipped policies use (the strings library: ``join``), and the type of a value that is an
    evaluation error (CEL returns errors as values). Every variable is ``dyn``: objects are evaluated as their
    JSON, as Kubernetes evaluates those of a resource without a schema."""
    try:
        from cel_expr_python import cel
        from cel_expr_python.ext.ext_strings import ExtStrings
    except ImportError as e:  # pragma: no cover - the sim extra brings it
        raise ApiError(
            500,
            "InternalError",
            f"ValidatingAdmissionPolicy evaluation needs the 'cel-expr-python' package: {SIM_INSTALL}",
        ) from e
    quantity = [
        # Kubernetes' quantity library, as far as the shipped policies use it: quantity(string) and its
        # asApproximateFloat() (the quantity stands for its approximate value here)
        cel.FunctionDecl(
            "quantity", [cel.Overload("quantity_string", cel.Type.DOUBLE, [cel.Type.STRING], impl=_quantity)]
        ),
        cel.FunctionDecl(
            "asApproximateFloat",
            [cel.Overload("quantity_approximate", cel.Type.DOUBLE, [cel.Type.DOUBLE], is_member=True, impl=float)],
        ),
        # Kubernetes' lists library, as far as they use it: sum() and max() of a list of doubles
        cel.FunctionDecl(
            "sum",
            [
                cel.Overload(
                    "list_double_sum", cel.Type.DOUBLE, [cel.Type.List(cel.Type.DOUBLE)], is_member=True, impl=_sum
                )
            ],
        ),
        cel.FunctionDecl(
            "max",
            [
                cel.Overload(
                    "list_double_max", cel.Type.DOUBLE, [cel.Type.List(cel.Type.DOUBLE)], is_member=True, impl=_max
                )
            ],
        ),
    ]
    env = cel.NewEnv(
        variables={name: cel.Type.DYN for name in _VARIABLES}, extensions=[ExtStrings()], functions=quantity
    )
    return env, cel.Type.ERROR


def _sum(values: Any) -> float:
    """``list.sum()``: 0.0 for an empty list."""
    return float(sum(values, 0.0))


def _max(values: Any) -> float:
    """``list.max()``: an evaluation error for an empty list, as Kubernetes'."""
    found = list(values)
    if not found:
        raise ValueError("max() of an empty list")
    return float(max(found))


def _quantity(text: str) -> float:
    """``quantity(text)`` of Kubernetes' CEL library (an invalid quantity is an evaluation error)."""
    try:
        return Quantity.parse(text).nanos / 1e9
    except InvalidInput as e:
        raise ValueError(f"invalid quantity {text!r}: {e}") from None


_ACTIVATION_NAMES: Final = ("object", "oldObject", "request", "params", "namespaceObject", "variables", "authorizer")
_ROOT_USE: Final = re.compile(r"(?<![.\w])(" + "|".join(_ACTIVATION_NAMES) + r")((?:\.[A-Za-z_]\w*)*)(\s*\()?")
"""A name of the activation where an expression reads it, the field selections that follow it, and whether the last
of them is a call (a method: ``object.metadata.name.startsWith(...)``)."""

Path = tuple[str, ...]


def _read_paths(expression: str) -> dict[str, frozenset[Path]]:
    """The activation's names the expression reads, each with the field paths under which it reads them: every
    use of a name followed by field selections reads at most the subtree at the end of them (whatever follows, an
    index, a macro or more selections on another line, reads inside that subtree); any other use reads it whole
    (the empty path). A name in a string literal or a shadowing macro variable only adds to what is kept."""
    out: dict[str, set[Path]] = {}
    for m in _ROOT_USE.finditer(expression):
        path = tuple(m.group(2).split(".")[1:])
        if m.group(3) and path:  # (the last selection is a method's name)
            path = path[:-1]
        out.setdefault(m.group(1), set()).add(path)
    return {name: frozenset(paths) for name, paths in out.items()}


def _project(value: Any, paths: frozenset[Path]) -> Any:
    """``value`` with only what ``paths`` reach (a subtree whole at each path's end). An expression reading only
    through those paths evaluates alike, a missing field's error and ``has()`` included; lists and scalars are
    kept whole."""
    if () in paths or not isinstance(value, dict):
        return value
    under: dict[str, set[Path]] = {}
    for path in paths:
        if path[0] in value:
            under.setdefault(path[0], set()).add(path[1:])
    return {key: _project(value[key], frozenset(rest)) for key, rest in under.items()}


class _Program:
    """One compiled CEL expression."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        self.reads = _read_paths(expression)
        """The activation's names the expression reads, and the paths it reads them through: only those are handed
        to CEL. Each run converts what it is given to CEL's values, and the objects (an object and its old
        version, a parameter) are most of that when handed whole: a policy with a parameter per object of a
        namespace runs its match conditions once per parameter."""
        try:
            self._program = _cel()[0].compile(expression)
        except ApiError:
            raise
        except Exception as e:  # (the bindings raise a plain error naming the parse or check failure)
            raise _Unsupported(f"compilation failed: {e}") from e

    def run(self, data: Mapping[str, Any], shared: _Shared | None = None) -> Any:
        """The value (plain Python: JSON types) with the activation ``data`` (converted once for every expression
        of ``shared`` that reads no variable), or raise ``_Unsupported`` with the evaluation error."""
        try:
            if shared is not None and "variables" not in self.reads:
                value = self._program.eval(activation=shared.converted())
            else:
                value = self._program.eval(data=_projected(data, self.reads))
        except Exception as e:
            raise _Unsupported(str(e)) from e
        if value.type() == _cel()[1]:
            raise _Unsupported(str(value))
        return value.plain_value()


def _projected(data: Mapping[str, Any], reads: Mapping[str, frozenset[Path]]) -> dict[str, Any]:
    return {name: _project(data[name], paths) for name, paths in reads.items() if name in data}


class _Shared:
    """One conversion to CEL's values, for the expressions of a policy's variables and validations that read no
    variable: what all of them read of the activation, converted when the first of them runs (an object and its
    old version are most of what each run would otherwise convert again)."""

    def __init__(self, data: Mapping[str, Any], programs: list[_Program]) -> None:
        self.data = data
        self.programs = programs
        self._converted: Any = None

    def converted(self) -> Any:
        if self._converted is None:
            reads: dict[str, frozenset[Path]] = {}
            for program in self.programs:
                if "variables" not in program.reads:
                    for name, paths in program.reads.items():
                        reads[name] = reads.get(name, frozenset()) | paths
            self._converted = _cel()[0].Activation(data=_projected(self.data, reads))
        return self._converted


_MISSING_KEY: Final = re.compile(r'Key not found in map : "([^"]*)"')


class _Variables:
    """A policy's variables, each evaluated where an expression first reads it, as Kubernetes evaluates them: a
    variable nothing reads, or one behind a ``&&`` or ``||`` the other side decides, is never evaluated, and one
    that fails to evaluate fails only the expressions that read it (left unbound, reading it fails the same way).
    An expression is run with the variables evaluated so far; reading one not evaluated yet fails as a missing key,
    which evaluates it and runs the expression again (a failure of an object's own missing key of the same name
    evaluates that variable in vain, and fails again). CEL reports one error of an expression, the first: one that
    is not such a key (an object's missing field, a variable that failed) may stand where the other side of a ``||``
    or ``&&``, or another element of a macro, reads a variable not evaluated yet that would decide; so every variable
    the expression reads is evaluated then, and it runs once more, as it would with all of them (a variable's value
    is the same whenever it is evaluated)."""

    def __init__(self, programs: Mapping[str, _Program], activation: dict[str, Any], shared: _Shared) -> None:
        self.programs = programs
        self.activation = activation
        self.shared = shared
        self._failed: set[str] = set()

    def run(self, program: _Program, *, shared: bool = True) -> Any:
        """``program``'s value (``shared``: it is one of the programs the shared conversion was made for)."""
        while True:
            try:
                return program.run(self.activation, self.shared if shared else None)
            except _Unsupported as e:
                name = self._unevaluated(str(e))
                if name is not None:
                    self._evaluate(name)
                    continue
                done = self.activation["variables"]
                pending = [n for n in self._read_by(program) if n not in done and n not in self._failed]
                if not pending:
                    raise
                for n in pending:
                    self._evaluate(n)

    def _read_by(self, program: _Program) -> list[str]:
        """The variables ``program`` reads (all of them where it reads ``variables`` whole)."""
        paths = program.reads.get("variables", frozenset())
        if () in paths:
            return list(self.programs)
        read = {p[0] for p in paths if p}
        return [n for n in self.programs if n in read]

    def _unevaluated(self, error: str) -> str | None:
        m = _MISSING_KEY.search(error)
        name = m.group(1) if m else None
        if name is None or name not in self.programs or name in self._failed:
            return None
        return None if name in self.activation["variables"] else name

    def _evaluate(self, name: str) -> None:
        self._failed.add(name)  # (until it has a value: a variable reading itself fails)
        try:
            value = self.run(self.programs[name])
        except _Unsupported:
            return
        self._failed.discard(name)
        self.activation["variables"] = {**self.activation["variables"], name: value}


HELD_MAX: Final = 65536
"""Entries each of the policy system's caches of :func:`_held` keeps at most (emptied when full)."""


def _held(cache: dict[Hashable, tuple[Any, V]], obj: Any, key: Hashable, make: Callable[[], V]) -> V:
    """``make()``, kept in ``cache`` under ``key`` (which names ``obj`` by its ``id``) for as long as ``obj`` is the
    object held with it: the entry holds ``obj``, so its id is no other object's while the entry is kept."""
    entry = cache.get(key)
    if entry is not None and entry[0] is obj:
        return entry[1]
    if len(cache) >= HELD_MAX:
        cache.clear()
    value = make()
    cache[key] = (obj, value)
    return value


def _matches_rule(rule: Obj, op: Operation, res: Resource, subresource: str | None) -> bool:
    def has(field: str, value: str) -> bool:
        values = rule.get(field) or []
        return "*" in values or value in values

    def resource_matches(entry: str) -> bool:  # (the API server's rules.Matcher: "pods/*" is pods and its
        # subresources, "*" every main resource and no subresource, "*/*" everything)
        name, _, sub = entry.partition("/")
        return name in ("*", res.plural) and sub in ("*", subresource or "")

    resource_ok = any(resource_matches(str(entry)) for entry in rule.get("resources") or ())
    return has("apiGroups", res.group) and has("apiVersions", res.version) and has("operations", op) and resource_ok


def _selected(selector: Obj | None, labels: Mapping[str, str]) -> bool:  # an unset selector matches all
    if not selector:
        return True
    return LabelSelector.from_object(selector).matches(labels)


@dataclass(frozen=True, slots=True)
class _Request:
    op: Operation
    res: Resource
    namespace: str
    name: str
    new: Obj | None
    old: Obj | None
    subresource: str | None = None

    @property
    def obj(self) -> Obj:
        return self.new if self.new is not None else (self.old or {})


class PolicySystem:
    """The ValidatingAdmissionPolicy admission plugin of one simulated API server (``install()`` adds it in front of
    every resource's other admission, as kube-apiserver runs it before ResourceQuota)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._policies = store.resource("validatingadmissionpolicies")
        self._bindings = store.resource("validatingadmissionpolicybindings")
        self._namespaces = store.resource("namespaces")
        self._compiled: dict[tuple[str, str], _Program] = {}
        self._decoded: dict[Hashable, tuple[Any, Obj]] = {}
        """(see :func:`_held`) a stored object's JSON → its decoding: what each request reads of policies, bindings
        and parameters is decoded once per version (a write stores new JSON). The decodings are only read."""
        self._rule_matches: dict[Hashable, tuple[Any, bool]] = {}
        """(see :func:`_held`) a decoded ``matchConstraints`` or ``matchResources`` with an operation, resource and
        subresource → whether its rules match."""
        self.denied = 0

    def install(self) -> None:
        for info in self.store.registry.infos:
            self.store.add_admission(info.resource, self._admit, first=True)

    def _program(self, policy: Obj, expression: str) -> _Program:
        key = (str(policy["metadata"].get("uid", "")), expression)
        prog = self._compiled.get(key)
        if prog is None:
            if len(self._compiled) > 4096:
                self._compiled.clear()
            prog = self._compiled[key] = _Program(expression)
        return prog

    def _all(self, res: Resource) -> list[Obj]:
        return self._all_in(res, None)

    def _decode(self, raw: bytes) -> Obj:
        return _held(self._decoded, raw, id(raw), lambda: _decode(raw))

    async def _admit(
        self, op: Operation, res: Resource, new: Obj | None, old: Obj | None, subresource: str | None = None
    ) -> Obj | None:
        if res.group == "admissionregistration.k8s.io":
            return None
        bindings = self._all(self._bindings)
        if not bindings:
            return None
        obj = new if new is not None else (old or {})
        meta = obj.get("metadata") or {}
        req = _Request(op, res, str(meta.get("namespace") or ""), str(meta.get("name") or ""), new, old, subresource)
        policies = {p["metadata"]["name"]: p for p in self._all(self._policies)}
        for binding in bindings:
            spec = binding.get("spec") or {}
            policy = policies.get(str(spec.get("policyName", "")))
            if policy is not None:
                self._check(policy, binding, req)
        return None

    def _namespace_labels(self, namespace: str) -> dict[str, str]:
        ns = self.store.peek(self._namespaces, None, namespace) if namespace else None
        return dict(((ns or {}).get("metadata") or {}).get("labels") or {})

    def _matches(self, constraints: Obj | None, req: _Request, *, required: bool) -> bool:
        if not constraints:
            return not required
        if not self._rules_match(constraints, req):
            return False
        if req.res.namespaced and not _selected(
            constraints.get("namespaceSelector"), self._namespace_labels(req.namespace)
        ):
            return False
        selector = constraints.get("objectSelector")
        return any(_selected(selector, _labels(o)) for o in (req.new, req.old) if o is not None)

    def _rules_match(self, constraints: Obj, req: _Request) -> bool:
        """Whether the request's operation and resource match ``resourceRules`` and no ``excludeResourceRules``;
        held per constraints object (a decoded version's, see ``_decoded``) and request kind."""

        def found() -> bool:
            rules = constraints.get("resourceRules") or []
            excluded = constraints.get("excludeResourceRules") or []
            return any(_matches_rule(r, req.op, req.res, req.subresource) for r in rules) and not any(
                _matches_rule(r, req.op, req.res, req.subresource) for r in excluded
            )

        return _held(self._rule_matches, constraints, (id(constraints), req.op, req.res, req.subresource), found)

    def _params(self, policy: Obj, binding: Obj, req: _Request) -> list[Obj | None]:
        """The parameter objects to evaluate with (``[None]`` when the policy takes none, ``[]`` when none is found
        and the binding allows that); raise ``_Unsupported`` for a binding that cannot be configured."""
        kind = (policy.get("spec") or {}).get("paramKind")
        ref = (binding.get("spec") or {}).get("paramRef")
        if not kind or not ref:
            return [None]
        group = str(kind.get("apiVersion", "")).rpartition("/")[0]
        try:
            res = self.store.resource(str(kind.get("kind", "")))
        except KeyError:
            raise _Unsupported(f"paramKind kind `{kind.get('kind')}` not known") from None
        if res.group != group:
            raise _Unsupported(f"paramKind kind `{kind.get('kind')}` not known")
        if res.namespaced:
            if not req.res.namespaced and not ref.get("namespace"):
                raise _Unsupported(
                    "cannot use namespaced paramRef in policy binding that matches cluster-scoped resources"
                )
            namespace: str | None = str(ref.get("namespace") or req.namespace)
        else:
            if ref.get("namespace"):
                raise _Unsupported("paramRef.namespace must not be provided for a cluster-scoped `paramKind`")
            namespace = None
        if ref.get("name"):
            found = self.store.peek(res, namespace, str(ref["name"]))
            params: list[Obj | None] = [found] if found is not None else []
        else:
            selector = LabelSelector.from_object(ref.get("selector") or {})
            params = [p for p in self._all_in(res, namespace) if selector.matches(_labels(p))]
        if not params and (ref.get("parameterNotFoundAction") or "Deny") == "Deny":
            raise _Unsupported("no params found for policy binding with `Deny` parameterNotFoundAction")
        return params

    def _all_in(self, res: Resource, namespace: str | None) -> list[Obj]:
        return [self._decode(raw) for raw in self.store.list_raw(res, namespace)[0]]

    def _check(self, policy: Obj, binding: Obj, req: _Request) -> None:
        pspec = policy.get("spec") or {}
        bspec = binding.get("spec") or {}
        if not self._matches(pspec.get("matchConstraints"), req, required=True):
            return
        if bspec.get("matchResources") and not self._matches(bspec["matchResources"], req, required=False):
            return
        actions = list(bspec.get("validationActions") or [])
        fail_closed = (pspec.get("failurePolicy") or "Fail") == "Fail"
        try:
            params = self._params(policy, binding, req)
        except _Unsupported as e:
            if fail_closed:
                self._deny(policy, binding, req, f"failed to configure binding: {e}", "Invalid", actions)
            return
        base = self._activation(req) if params else {}
        for param in params:
            self._validate(policy, binding, req, {**base, "params": param, "variables": {}}, actions, fail_closed)

    def _validate(
        self,
        policy: Obj,
        binding: Obj,
        req: _Request,
        activation: dict[str, Any],
        actions: list[Any],
        fail_closed: bool,
    ) -> None:
        """Run the policy with one parameter (``activation``: what its expressions see)."""
        pspec = policy.get("spec") or {}
        try:
            for cond in pspec.get("matchConditions") or []:
                if not bool(self._program(policy, str(cond.get("expression", ""))).run(activation)):
                    return
        except _Unsupported as e:
            if fail_closed:
                self._deny(policy, binding, req, f"expression evaluation failed: {e}", "Invalid", actions)
            return
        variables = {
            str(var.get("name", "")): self._program(policy, str(var.get("expression", "")))
            for var in pspec.get("variables") or []
        }
        validations = [(v, self._program(policy, str(v.get("expression", "")))) for v in pspec.get("validations") or []]
        shared = _Shared(activation, [*variables.values(), *(p for _, p in validations)])
        lazy = _Variables(variables, activation, shared)
        for v, program in validations:
            try:
                ok = bool(lazy.run(program))
            except _Unsupported as e:
                if fail_closed:
                    message = f"expression '{program.expression}' resulted in error: {e}"
                    self._deny(policy, binding, req, message, "Invalid", actions)
                continue
            if not ok:
                message = self._message(policy, v, lazy)
                self._deny(policy, binding, req, message, str(v.get("reason") or "Invalid"), actions)

    def _message(self, policy: Obj, validation: Obj, lazy: _Variables) -> str:
        expr = validation.get("messageExpression")
        if expr:
            try:
                text = str(lazy.run(self._program(policy, str(expr)), shared=False)).strip()
            except _Unsupported:
                text = ""
            if text and "\n" not in text and len(text.encode()) <= MAX_MESSAGE_EXPRESSION_BYTES:
                return text
        message = str(validation.get("message") or "").strip()
        return message or f"failed expression: {str(validation.get('expression', '')).strip()}"

    def _activation(self, req: _Request) -> dict[str, Any]:
        """What a policy's expressions see of the request, but its parameter and variables."""
        user = current_user()
        kind = {"group": req.res.group, "version": req.res.version, "kind": req.res.kind}
        resource = {"group": req.res.group, "version": req.res.version, "resource": req.res.plural}
        request = {
            "kind": kind,
            "resource": resource,
            "subResource": req.subresource or "",
            "requestKind": kind,
            "requestResource": resource,
            "requestSubResource": req.subresource or "",
            "name": req.name,
            "namespace": req.namespace,
            "operation": req.op,
            "userInfo": user.as_request(),
            "dryRun": False,
            "options": DELETE_OPTIONS.get() if req.op == "DELETE" else None,
        }
        ns = None
        if req.res.namespaced and req.namespace:
            ns = self.store.peek(self._namespaces, None, req.namespace)
            if ns is not None:
                ns["metadata"].pop("managedFields", None)
                ns["metadata"].pop("ownerReferences", None)
        return {
            "object": req.new,
            "oldObject": req.old,
            "request": request,
            "namespaceObject": ns,
        }

    def _deny(self, policy: Obj, binding: Obj, req: _Request, message: str, reason: str, actions: list[Any]) -> None:
        if "Deny" not in actions:
            return  # Warn and Audit only report
        self.denied += 1
        text = (
            f"ValidatingAdmissionPolicy '{policy['metadata']['name']}' with binding "
            f"'{binding['metadata']['name']}' denied request: {message}"
        )
        what = f"{req.res.plural}.{req.res.group}" if req.res.group else req.res.plural
        name = req.name or str((req.obj.get("metadata") or {}).get("generateName") or "") or "Unknown"
        full = f'{what} "{name}" is forbidden: {text}'
        raise ApiError(
            _REASON_CODES.get(reason, 422),
            reason,
            full,
            {"name": name, "group": req.res.group, "kind": req.res.plural, "causes": [{"message": text}]},
        )


def _labels(obj: Obj) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}
