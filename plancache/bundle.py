"""Plan bundles: one signed file holding the plans of one GPU environment, for hosts without a server.

A bundle is a single UTF-8 JSON document::

    {"format": "plancache-bundle",
     "header": {"version": 1, "environment": {...}, "env_id": "...", "created_at": "...",
                "signer_key_id": "..." | null, "entries": N},
     "entries": [{"record": <PlanRecord>, "blob_b64": "<base64 plan blob>", "spec": <canonical GraphSpec>}, ...],
     "signature": "<base64 ed25519>" | null}

The signature covers the canonical JSON (sorted keys, no whitespace) of ``format``, ``header`` and
``entries`` as they appear in the file. JSON rather than a zip or tar: plan blobs are small (kilobytes
to a few megabytes), one document has exactly one canonical form to sign, reading it needs nothing
beyond the standard library on a client, ``jq`` can inspect it, and there are no archive members,
paths or orderings to validate. The cost is base64's third more bytes for the blobs.

Loading verifies everything before anything is used (:func:`verify_bundle`): the bundle signature
against the trusted keys when any are configured (then it is required), then each entry through
:func:`plancache.verify.verify_blob` in its fixed order: size and sha256 of the blob against its record,
the record's own plan signature (with trusted keys, as a client with trusted keys requires it of every
plan), that its graph key is the key of the enclosed spec, and that it is for the bundle's environment.
Reasons are those of :data:`plancache.verify.REASONS`. Any failure refuses the whole bundle with a
:class:`~plancache.errors.VerificationError` naming the entry.

This module needs no SQLAlchemy: :func:`export_bundle` and :func:`import_bundle` take a store object
(:class:`plancache.store.Store`) from the caller.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import Conflict, IntegrityError, NotFound, PlanCacheError, VerificationError
from .environment import Environment
from .protocol import PlanMeta, PlanRecord, b64decode, b64encode
from .signing import Signer, TrustedKeys
from .spec import canonical_json, graph_key
from .verify import verify_blob

if TYPE_CHECKING:
    from .store import Store

BUNDLE_FORMAT = "plancache-bundle"
BUNDLE_VERSION = 1
_PAGE = 1000


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BundleHeader(_Model):
    version: Literal[1]
    environment: Environment
    env_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    created_at: datetime
    signer_key_id: str | None = None
    entries: int = Field(ge=0)


class BundleEntry(_Model):
    record: PlanRecord
    blob_b64: str
    spec: dict[str, Any]


class BundleDocument(_Model):
    format: Literal["plancache-bundle"]
    header: BundleHeader
    entries: list[BundleEntry]
    signature: str | None = None


class BundlePlan(NamedTuple):
    """One verified plan of a bundle: its record, blob bytes and canonical spec."""

    record: PlanRecord
    blob: bytes
    spec: dict[str, Any]


@dataclass(frozen=True)
class ImportReport:
    environment: Environment
    imported: int
    unchanged: int
    signature_checked: bool


def _signed_part(doc: dict[str, Any]) -> bytes:
    return canonical_json({"format": doc["format"], "header": doc["header"], "entries": doc["entries"]}).encode()


def _entry_name(index: int, entry: BundleEntry) -> str:
    return f"bundle entry {index} (graph key {entry.record.graph_key[:16]})"


def build_bundle(environment: Environment, plans: Iterable[BundlePlan], signer: Signer | None = None,
                 *, now: datetime | None = None) -> dict[str, Any]:
    """The bundle document (a JSON-ready dict) for ``plans`` of ``environment``, signed when ``signer`` is given."""
    entries = [
        {"record": p.record.model_dump(mode="json"), "blob_b64": b64encode(p.blob), "spec": p.spec}
        for p in sorted(plans, key=lambda p: p.record.graph_key)
    ]
    header = BundleHeader(
        version=BUNDLE_VERSION, environment=environment, env_id=environment.env_id,
        created_at=now or datetime.now(timezone.utc), signer_key_id=signer.key_id if signer else None,
        entries=len(entries),
    )
    doc: dict[str, Any] = {"format": BUNDLE_FORMAT, "header": header.model_dump(mode="json"), "entries": entries}
    doc["signature"] = signer.sign_bytes(_signed_part(doc)) if signer else None
    return doc


def write_bundle(doc: dict[str, Any], path: Path | str) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file in the same folder, then a rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, ensure_ascii=False, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_bundle(path: Path | str) -> tuple[dict[str, Any], BundleDocument]:
    """Parse a bundle file: the raw document (what the signature covers) and its validated model.

    Raises :class:`VerificationError` (reason ``malformed``) for anything that is not a well-formed bundle.
    """
    try:
        raw = json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerificationError("malformed", f"{path}: not a plancache bundle (invalid JSON: {exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != BUNDLE_FORMAT:
        raise VerificationError("malformed", f"{path}: not a plancache bundle (no \"format\": \"{BUNDLE_FORMAT}\")")
    try:
        doc = BundleDocument.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise VerificationError("malformed", f"{path}: invalid bundle at {loc}: {first.get('msg')}") from None
    return raw, doc


def _verify_entry(index: int, entry: BundleEntry, header: BundleHeader, trusted: TrustedKeys | None) -> BundlePlan:
    """Decode the entry's blob and spec (``malformed``), then the shared verification against the header."""
    name = _entry_name(index, entry)
    try:
        blob = b64decode(entry.blob_b64, what=f"{name}: blob")
    except ValueError as exc:
        raise VerificationError("malformed", str(exc)) from None
    try:
        key = graph_key(entry.spec)
    except PlanCacheError as exc:
        raise VerificationError("malformed", f"{name}: {exc.message}") from None
    verify_blob(entry.record, blob, what=name, trusted=trusted, graph_key=key, environment=header.environment)
    return BundlePlan(entry.record, blob, entry.spec)


def verify_bundle(raw: dict[str, Any], doc: BundleDocument, trusted: TrustedKeys | None) -> list[BundlePlan]:
    """Every check of the module docstring; the verified plans, or :class:`VerificationError` for the first failure.

    With ``trusted`` empty or ``None`` the bundle signature is not checked (nothing to check it against).
    """
    header = doc.header
    if header.env_id != header.environment.env_id:
        raise VerificationError("environment", f"bundle header env_id {header.env_id} is not the id of its "
                                               f"environment ({header.environment.env_id})")
    if header.entries != len(doc.entries):
        raise VerificationError("malformed", f"bundle header counts {header.entries} entries, it holds {len(doc.entries)}")
    if trusted:
        if doc.signature and header.signer_key_id is None:
            raise VerificationError("malformed", "the bundle has a signature but its header names no signer key")
        trusted.verify_bytes(_signed_part(raw), doc.signature, header.signer_key_id, what="bundle")
    plans: list[BundlePlan] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(doc.entries):
        key = entry.record.graph_key
        if key in seen:
            raise VerificationError("malformed", f"{_entry_name(index, entry)}: graph key repeats entry {seen[key]}")
        seen[key] = index
        plans.append(_verify_entry(index, entry, header, trusted))
    return plans


def load_bundle(path: Path | str, trusted_keys: TrustedKeys | None) -> list[BundlePlan]:
    """Read and verify a bundle file; its plans as ``(record, blob, spec)`` tuples (no server, no store)."""
    raw, doc = read_bundle(path)
    return verify_bundle(raw, doc, trusted_keys)


def collect_plans(store: "Store", environment: Environment, graph_keys: list[str] | None) -> list[BundlePlan]:
    """The stored plans (record, blob, canonical spec) of ``graph_keys`` — or every stored plan, with ``None`` —
    on ``environment``. A key without a plan there is :class:`NotFound`, listing every such key."""
    if graph_keys is None:
        records: dict[str, PlanRecord] = {}
        offset = 0
        while page := store.list_plans(env_id=environment.env_id, limit=_PAGE, offset=offset):
            records.update((r.graph_key, r) for r in page)
            offset += len(page)
        if not records:
            raise NotFound(f"no plans are stored for {environment.describe()} (env id {environment.env_id})")
    else:
        found = {k: store.get_plan(k, environment) for k in dict.fromkeys(graph_keys)}
        missing = [k for k, r in found.items() if r is None]
        if missing:
            raise NotFound(f"{len(missing)} of {len(found)} graph keys have no plan on {environment.describe()}: "
                           + ", ".join(missing[:10]) + (" …" if len(missing) > 10 else ""))
        records = {k: r for k, r in found.items() if r is not None}
    plans = []
    for key, record in records.items():
        blob, spec = store.get_blob(record.blob_sha256), store.get_spec(key)
        if blob is None or spec is None:
            raise IntegrityError(f"plan {key} on {environment.describe()}: its {'blob' if blob is None else 'spec'} is not stored")
        plans.append(BundlePlan(record, blob, spec))
    return plans


def export_bundle(store: "Store", environment: Environment, graph_keys: list[str] | None, out: Path | str,
                  signer: Signer | None = None) -> int:
    """Write the bundle of ``graph_keys`` (or every plan, with ``None``) on ``environment`` to ``out``;
    the number of plans written."""
    plans = collect_plans(store, environment, graph_keys)
    write_bundle(build_bundle(environment, plans, signer), out)
    return len(plans)


def import_bundle(store: "Store", path: Path | str, trusted_keys: TrustedKeys | None,
                  *, progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Verify a bundle whole, then publish its specs and plans into ``store`` (idempotent).

    Nothing is written when any entry fails verification, or when the store already holds a different
    plan for an entry's graph key and environment (:class:`Conflict` naming the entry).
    """
    raw, doc = read_bundle(path)
    plans = verify_bundle(raw, doc, trusted_keys)
    environment = doc.header.environment
    unchanged = 0
    for index, plan in enumerate(plans):
        stored = store.get_plan(plan.record.graph_key, plan.record.environment)
        if stored is None:
            continue
        if stored.blob_sha256 != plan.record.blob_sha256:
            raise Conflict(f"bundle entry {index} (graph key {plan.record.graph_key[:16]}): the store holds another "
                           f"plan (blob {stored.blob_sha256[:16]}) for this graph key on {environment.describe()}")
        unchanged += 1
    for done, plan in enumerate(plans, 1):
        store.put_spec(plan.record.graph_key, plan.spec)
        meta = PlanMeta.model_validate(plan.record.model_dump(include=set(PlanMeta.model_fields)))
        store.publish_plan(meta, plan.blob)
        if progress:
            progress(done, len(plans))
    return ImportReport(environment, len(plans) - unchanged, unchanged, bool(trusted_keys))
