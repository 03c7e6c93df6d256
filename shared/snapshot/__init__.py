"""Compact, versioned snapshots of the Kubernetes objects accounting needs, and nothing else.

Each snapshot is a frozen msgspec Struct tagged by the Kubernetes ``kind``; field names are camelCase on the wire
(JSON) and snake_case in Python; unknown fields are ignored on decode, so an older reader accepts a newer writer
(rolling upgrades); ``schema`` is the snapshot schema version.

Quantities are :class:`~shared.quantity.Quantity` objects in Python and canonical strings on the wire: encode and
decode with :data:`enc_hook` / :data:`dec_hook` (or :func:`encode` / :func:`decode`), also when a snapshot is
embedded in another Struct.

Modules: ``types`` (the snapshot types and the labels they are read with), ``vmispec`` (the part of a VMI's spec
the launcher pod depends on), ``sharing`` (what a ledger holds for thousands of objects, shared), ``hooks`` (the
quantities' wire form), ``codec`` (encode, decode), ``fastpath`` (the events decoder's reading of parts that recur
verbatim). The names below are the package's public surface.

:func:`shared.normalize.normalize` turns a raw Kubernetes object (JSON/YAML dict) into its snapshot; malformed
input raises :class:`~shared.errors.InvalidInput` naming the object and the field.
"""

from shared.snapshot.codec import decode as decode
from shared.snapshot.codec import encode as encode
from shared.snapshot.codec import from_builtins as from_builtins
from shared.snapshot.codec import to_builtins as to_builtins
from shared.snapshot.fastpath import WIRE_SNAPSHOT as WIRE_SNAPSHOT
from shared.snapshot.fastpath import from_wire as from_wire
from shared.snapshot.fastpath import wire_variant as wire_variant
from shared.snapshot.hooks import dec_hook as dec_hook
from shared.snapshot.hooks import enc_hook as enc_hook
from shared.snapshot.sharing import shared_resources as shared_resources
from shared.snapshot.types import EVACUATION_ANNOTATION as EVACUATION_ANNOTATION
from shared.snapshot.types import HOT_MEMORY_CHANGE as HOT_MEMORY_CHANGE
from shared.snapshot.types import LAUNCHER_LABEL as LAUNCHER_LABEL
from shared.snapshot.types import MIGRATION_JOB_LABEL as MIGRATION_JOB_LABEL
from shared.snapshot.types import POD_LABELS_KEPT as POD_LABELS_KEPT
from shared.snapshot.types import REJECTED_BY_QUOTA as REJECTED_BY_QUOTA
from shared.snapshot.types import SCHEMA as SCHEMA
from shared.snapshot.types import SNAPSHOT_TYPES as SNAPSHOT_TYPES
from shared.snapshot.types import SUPPORTED_KINDS as SUPPORTED_KINDS
from shared.snapshot.types import VMI_WAITING_PHASES as VMI_WAITING_PHASES
from shared.snapshot.types import WORKLOAD_UPDATE_ANNOTATION as WORKLOAD_UPDATE_ANNOTATION
from shared.snapshot.types import AnySnapshot as AnySnapshot
from shared.snapshot.types import Condition as Condition
from shared.snapshot.types import EventSnapshot as EventSnapshot
from shared.snapshot.types import KubeVirtSnapshot as KubeVirtSnapshot
from shared.snapshot.types import NamespaceSnapshot as NamespaceSnapshot
from shared.snapshot.types import PodSnapshot as PodSnapshot
from shared.snapshot.types import QuotaSnapshot as QuotaSnapshot
from shared.snapshot.types import ScopeSelector as ScopeSelector
from shared.snapshot.types import Snapshot as Snapshot
from shared.snapshot.types import VmiMigrationState as VmiMigrationState
from shared.snapshot.types import VmimSnapshot as VmimSnapshot
from shared.snapshot.types import VmiSnapshot as VmiSnapshot
from shared.snapshot.types import VmSnapshot as VmSnapshot
from shared.snapshot.types import awaits_attachment_pod as awaits_attachment_pod
from shared.snapshot.types import is_cluster_scoped as is_cluster_scoped
from shared.snapshot.types import labelled_launcher as labelled_launcher
from shared.snapshot.types import migration_awaits_attachment as migration_awaits_attachment
from shared.snapshot.types import same_content as same_content
from shared.snapshot.types import target_awaits_attachment as target_awaits_attachment
from shared.snapshot.vmispec import HELD_SPEC_FIELDS as HELD_SPEC_FIELDS
from shared.snapshot.vmispec import compact_vmi_spec as compact_vmi_spec
from shared.snapshot.vmispec import prune_vmi_spec as prune_vmi_spec
from shared.snapshot.vmispec import size_digest as size_digest
