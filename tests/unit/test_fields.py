"""``shared.fields``: the readers every normaliser and renderer uses name the malformed field, and the readers that
use them report the same path for the same mistake."""

from __future__ import annotations

from typing import Any

import pytest

from shared.errors import InvalidInput
from shared.fields import boolean, mapping, objects, path, sequence, string, string_map
from shared.kubevirt.config import config_fields_from_cr
from shared.normalize import normalize
from shared.vmi import vmi_spec


def test_absent_and_null_fields_are_empty() -> None:
    for obj in ({}, {"k": None}):
        assert mapping(obj, "k", "spec") == {} and string(obj, "k", "spec") == "" and string_map(obj, "k", "") == {}
        assert boolean(obj, "k", "") is None and sequence(obj, "k", "") == [] and objects(obj, "k", "") == []
    with pytest.raises(TypeError):
        mapping({}, "k", "")["x"] = 1  # type: ignore[index]  # the empty value is shared: read-only


@pytest.mark.parametrize(
    ("read", "obj", "where", "message"),
    [
        (mapping, {"k": [1]}, "spec", "spec.k: expected an object, got list"),
        (mapping, {"k": "x"}, "", "k: expected an object, got str"),
        (string, {"k": 3}, "metadata", "metadata.k: expected a string, got int"),
        (string_map, {"k": {"a": 1}}, "metadata", "metadata.k.a: expected a string value, got int"),
        (string_map, {"k": {1: "a"}}, "metadata", "metadata.k: expected a string key, got int 1"),
        (boolean, {"k": "false"}, "spec.cpu", "spec.cpu.k: expected true or false, got 'false'"),
        (sequence, {"k": {}}, "spec", "spec.k: expected a list, got dict"),
        (objects, {"k": [{}, 3]}, "spec", "spec.k[1]: expected an object, got int"),
    ],
)
def test_a_malformed_field_is_named_by_its_path(read: Any, obj: dict[str, Any], where: str, message: str) -> None:
    with pytest.raises(InvalidInput) as e:
        read(obj, "k", where)
    assert str(e.value) == message


def test_path() -> None:
    assert path("", "status") == "status" and path("spec.domain", "cpu") == "spec.domain.cpu"


def test_the_readers_built_on_them_name_the_same_paths() -> None:
    meta: dict[Any, Any] = {"name": "v", "namespace": "a", "uid": "u", "resourceVersion": "1", "annotations": {1: "x"}}
    vmi = {"kind": "VirtualMachineInstance", "metadata": meta}
    with pytest.raises(InvalidInput, match=r"metadata\.annotations: expected a string key, got int 1"):
        vmi_spec(vmi)
    with pytest.raises(InvalidInput, match=r"metadata\.annotations: expected a string key, got int 1"):
        normalize(vmi)
    with pytest.raises(InvalidInput) as e:
        config_fields_from_cr({"kind": "KubeVirt", "status": "Deployed"})
    assert e.value.where == "status", "a top-level field is named without a leading dot"
    for wrong in (0, False, 1.9, ["v1.9"]):  # (not a string, falsy or not: refused alike)
        with pytest.raises(InvalidInput, match=r"status\.observedKubeVirtVersion: expected a string"):
            config_fields_from_cr({"kind": "KubeVirt", "status": {"observedKubeVirtVersion": wrong}})
    assert config_fields_from_cr({"status": {"observedKubeVirtVersion": 0}}, version="v1.9")["version"] == "v1.9"
