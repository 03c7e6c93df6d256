"""``vmquota schema``: the JSON Schemas of the bus's messages, for subscribers written in another language. Every
message the services publish, and every example in docs/events.md, validates against its schema (a real JSON Schema
validator); what the decoders refuse as malformed, the schemas refuse too."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from services.cli.main import main
from shared import contract
from shared.accounting.wire import account
from shared.contract import subjects
from shared.contract.schema import MESSAGES, json_schema
from shared.errors import InvalidInput
from shared.ledger.usage import usage_snapshot
from tests import builders
from tests.benchmarks.bench_memory import events_of, vm_objects

EVENTS_DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"
_BY_TYPE = {
    subjects.UPSERTED: "event",
    subjects.DELETED: "event",
    subjects.SYNC: "event",
    subjects.USAGE: "usage",
    subjects.DECISION: "decision",
    subjects.DEAD_LETTER: "deadletter",
}


def _validator(message: str) -> jsonschema.protocols.Validator:
    schema = json_schema(message)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


VALIDATORS = {name: _validator(name) for name in MESSAGES}


def _valid(message: str, doc: Any) -> None:
    errors = sorted(VALIDATORS[message].iter_errors(doc), key=str)
    assert not errors, f"{message}: {errors[0].message} at {list(errors[0].absolute_path)}"


def test_every_example_in_the_events_doc_validates() -> None:
    blocks = re.findall(r"```json\n(.*?)```", EVENTS_DOC.read_text(), re.S)
    docs = [json.loads(b) for b in blocks]
    typed = [d for d in docs if isinstance(d, dict) and d.get("type") in _BY_TYPE]
    assert {d["type"] for d in typed} >= {subjects.UPSERTED, subjects.USAGE, subjects.DECISION}, "examples found"
    for doc in typed:
        _valid(_BY_TYPE[doc["type"]], doc)


def test_the_messages_the_services_publish_validate() -> None:
    objs = [o for i in range(8) for o in vm_objects(i)]
    events = events_of(objs)
    for data in events:
        _valid("event", json.loads(data))
    quota = builders.quota_obj("rq", {"limits.memory": "64Gi"})
    led = builders.folded(
        [*objs, {**quota, "metadata": {**quota["metadata"], "namespace": objs[0]["metadata"]["namespace"]}}]
    )
    ns = objs[0]["metadata"]["namespace"]
    body = account(led.view("c1", ns), now=datetime(2026, 12, 5, tzinfo=UTC))
    assert body.quotas and body.vms, "a namespace with a managed quota and VMs"
    snap, _ = usage_snapshot(
        body, cluster="c1", namespace=ns, seq=9, source="vmquota/ledger/c1", time="2026-12-05T00:00:00Z"
    )
    _valid("usage", json.loads(contract.encode(snap)))
    _valid("decision", json.loads(contract.encode(builders.decision(ns, hard_after={"limits.memory": "80Gi"}))))
    letter, _ = contract.dead_letter("ledger", "not a JSON event", cluster="c1", payload=b"\x00garbage")
    _valid("deadletter", json.loads(contract.encode(letter)))
    _valid("relist", json.loads(contract.encode(contract.RelistRequest(token="t1", requester="vmquota/ledger/all"))))


@pytest.mark.parametrize(
    ("message", "change"),
    [
        ("event", {"snapshot": {"kind": "Pod", "name": "p", "requests": {"cpu": "lots"}}}),
        ("event", {"type": "io.vmquota.event.renamed"}),
        ("event", {"schema": "one"}),
        ("usage", {"seq": "9"}),
        ("decision", {"hardAfter": {"limits.memory": 80}}),
    ],
)
def test_what_the_decoders_refuse_the_schemas_refuse(message: str, change: dict[str, Any]) -> None:
    if message == "event":
        doc = json.loads(events_of(vm_objects(0))[2])  # (the launcher pod)
    elif message == "usage":
        doc = json.loads(contract.encode(builders.usage_snapshot("tenant")))
    else:
        doc = json.loads(contract.encode(builders.decision()))
    doc.update(change)
    assert not VALIDATORS[message].is_valid(doc)
    decode = {"event": contract.decode_event, "usage": contract.decode_usage, "decision": contract.decode_decision}
    with pytest.raises(InvalidInput):
        decode[message](json.dumps(doc).encode())


def test_the_command_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "usage"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema("usage")
