"""The bus contract: subjects, stream definitions, message Structs and message ids. Pure: no I/O.

Modules: ``subjects`` (subjects, names and their validation, message ids), ``streams`` (the streams and the
bucket), ``messages`` (the message types and their builders), ``codec`` (encoding, and decoding with validation).
The names below are the package's public surface: ``contract.X`` everywhere.

Every message on the bus is JSON encoded from one of the msgspec Structs below. Each carries ``schema`` (the
version of this contract), CloudEvents-style attributes (``id``, ``source``, ``type``, ``subject``, ``time``) and
the cluster it is about. Decoders allow unknown fields, so a newer producer can add fields during a rolling
upgrade; a message with a newer ``schema`` than this module knows is refused (it goes to the dead-letter subject).

Subjects (``docs/events.md`` documents every field with an example):

* ``vmquota.ev.<cluster>.<namespace>.<kind>`` — object events (:class:`Upserted`, :class:`Deleted`,
  :class:`Sync`); cluster-scoped objects (Namespace, the KubeVirt CR) use the namespace token ``_cluster``;
* ``vmquota.usage.<cluster>.<namespace>`` — the ledger's :class:`UsageSnapshot` of a namespace;
* ``vmquota.quota.<cluster>.<namespace>`` — the enforcer's :class:`Decision` on a quota;
* ``vmquota.dlq.<service>`` — :class:`DeadLetter`: what a service could not use, with the reason;
* ``vmquota.relist.<cluster>`` — core NATS, no stream: a ledger's :class:`RelistRequest` after the events stream
  lost events of the cluster it had not read; the cluster's watcher answers on the events subjects.
"""

from shared.contract.codec import check_event_subject as check_event_subject
from shared.contract.codec import decode_dead_letter as decode_dead_letter
from shared.contract.codec import decode_decision as decode_decision
from shared.contract.codec import decode_decision_on as decode_decision_on
from shared.contract.codec import decode_event as decode_event
from shared.contract.codec import decode_event_fast as decode_event_fast
from shared.contract.codec import decode_event_on as decode_event_on
from shared.contract.codec import decode_event_plain as decode_event_plain
from shared.contract.codec import decode_relist_request as decode_relist_request
from shared.contract.codec import decode_usage as decode_usage
from shared.contract.codec import decode_usage_on as decode_usage_on
from shared.contract.codec import encode as encode
from shared.contract.messages import MAX_DLQ_PAYLOAD as MAX_DLQ_PAYLOAD
from shared.contract.messages import MAX_ERROR_CHARS as MAX_ERROR_CHARS
from shared.contract.messages import MAX_ERRORS as MAX_ERRORS
from shared.contract.messages import MAX_REASON as MAX_REASON
from shared.contract.messages import RELIST_TOKEN as RELIST_TOKEN
from shared.contract.messages import SCHEMA as SCHEMA
from shared.contract.messages import DeadLetter as DeadLetter
from shared.contract.messages import Decision as Decision
from shared.contract.messages import Deleted as Deleted
from shared.contract.messages import MigrationState as MigrationState
from shared.contract.messages import ObjectEvent as ObjectEvent
from shared.contract.messages import QuotaTerms as QuotaTerms
from shared.contract.messages import RelistRequest as RelistRequest
from shared.contract.messages import Snapshot as Snapshot
from shared.contract.messages import Sync as Sync
from shared.contract.messages import Upserted as Upserted
from shared.contract.messages import UsageBody as UsageBody
from shared.contract.messages import UsageSnapshot as UsageSnapshot
from shared.contract.messages import VmState as VmState
from shared.contract.messages import answers_key as answers_key
from shared.contract.messages import capped_errors as capped_errors
from shared.contract.messages import dead_letter as dead_letter
from shared.contract.messages import error_count as error_count
from shared.contract.messages import object_event as object_event
from shared.contract.messages import short_reason as short_reason
from shared.contract.messages import source as source
from shared.contract.messages import sync_event as sync_event
from shared.contract.streams import DAY as DAY
from shared.contract.streams import DECISIONS_STREAM as DECISIONS_STREAM
from shared.contract.streams import DLQ_PER_SUBJECT as DLQ_PER_SUBJECT
from shared.contract.streams import DLQ_STREAM as DLQ_STREAM
from shared.contract.streams import EVENTS_STREAM as EVENTS_STREAM
from shared.contract.streams import LEDGER_BUCKET as LEDGER_BUCKET
from shared.contract.streams import STREAM_KEEPER as STREAM_KEEPER
from shared.contract.streams import STREAM_OWNERS as STREAM_OWNERS
from shared.contract.streams import STREAMS_USED as STREAMS_USED
from shared.contract.streams import USAGE_HISTORY_STREAM as USAGE_HISTORY_STREAM
from shared.contract.streams import USAGE_STREAM as USAGE_STREAM
from shared.contract.streams import StreamSizes as StreamSizes
from shared.contract.streams import StreamSpec as StreamSpec
from shared.contract.streams import parse_duration as parse_duration
from shared.contract.streams import parse_size as parse_size
from shared.contract.streams import streams as streams
from shared.contract.streams import streams_for as streams_for
from shared.contract.subjects import CLUSTER_TOKEN as CLUSTER_TOKEN
from shared.contract.subjects import KIND_TOKENS as KIND_TOKENS
from shared.contract.subjects import PREFIX as PREFIX
from shared.contract.subjects import TOKEN_KINDS as TOKEN_KINDS
from shared.contract.subjects import EventSubject as EventSubject
from shared.contract.subjects import check_cluster as check_cluster
from shared.contract.subjects import check_kind as check_kind
from shared.contract.subjects import check_namespace as check_namespace
from shared.contract.subjects import decision_subject as decision_subject
from shared.contract.subjects import dlq_subject as dlq_subject
from shared.contract.subjects import event_subject as event_subject
from shared.contract.subjects import events_filter as events_filter
from shared.contract.subjects import msg_id as msg_id
from shared.contract.subjects import namespace_token as namespace_token
from shared.contract.subjects import parse_event_subject as parse_event_subject
from shared.contract.subjects import relist_subject as relist_subject
from shared.contract.subjects import resource_version as resource_version
from shared.contract.subjects import subject_kind as subject_kind
from shared.contract.subjects import subject_scope as subject_scope
from shared.contract.subjects import sync_uid as sync_uid
from shared.contract.subjects import usage_subject as usage_subject
