"""Plan bundles: one signed file holding the plans of one GPU environment, for hosts without a server.

A bundle is a single UTF-8 JSON document::

    {"format": "plancache-bundle",
     "header": {"version": 2, "environment": {...}, "env_id": "...", "created_at": "...", "entries": N},
     "entries": [{"record": <PlanRecord>, "blob_b64": "<base64 plan blob>", "spec": <canonical GraphSpec>}, ...],
     "envelope": <DSSE envelope> | null}

The envelope (:mod:`plancache.signing`) carries an in-toto statement (:func:`bundle_statement`) whose subjects
are the entries' blobs, named by graph key, and whose predicate (:data:`~plancache.signing.BUNDLE_PREDICATE`)
is the header and the sha256 of the canonical JSON (sorted keys, no whitespace) of ``entries`` as they appear
in the file: it covers every record, blob and spec. Version 1 bundles (signed with the retired statement-v1
signature) are refused with a message saying to export them again.

Records carry no candidates tables (:class:`~plancache.protocol.CandidateTable` is stored apart on the server;
an admin reads it there): a bundle holds what a client loads. Entries of bundles written when records held a
``candidates`` list still read, the list dropped (:class:`~plancache.protocol.PlanRecord`).

JSON rather than a zip or tar: plan blobs are small (kilobytes to a few megabytes), one document has exactly
one canonical form to sign, reading it needs nothing beyond the standard library on a client, ``jq`` can
inspect it, and there are no archive members, paths or orderings to validate. The cost is base64's third
more bytes for the blobs.

Loading verifies everything before anything is used (:func:`verify_bundle`): the bundle's envelope against
the trusted keys when any are configured (then it is required, and its statement must be this bundle's),
then each entry through :func:`plancache.verify.verify_blob` in its fixed order: size and sha256 of the blob against its record,
the record's own plan signature (with trusted keys, as a client with trusted keys requires it of every
plan), that its graph key is the key of the enclosed spec, and that it is for the bundle's environment.
Reasons are those of :data:`plancache.verify.REASONS`. Any failure refuses the whole bundle with a
:class:`~plancache.errors.VerificationError` naming the entry.

This module needs no SQLAlchemy: :func:`export_bundle` and :func:`import_bundle` take a store object
(:class:`plancache.store.Store`) from the caller.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

from pydantic import Field, ValidationError

from .canonical import canonical_json
from .environment import ENV_ID_PATTERN, Environment
from .errors import (
    Conflict,
    IntegrityError,
    NotFound,
    PayloadTooLarge,
    PlanCacheError,
    Reason,
    SignatureError,
    VerificationError,
)
from .files import atomic_write, read_limited
from .protocol import Envelope, PlanMeta, PlanRecord, b64decode, b64encode
from .signing import BUNDLE_PREDICATE, Signer, TrustedKeys, statement
from .spec import graph_key
from .validation import StrictModel, validation_message
from .verify import verify_blob

if TYPE_CHECKING:
    from .store import Store

BUNDLE_FORMAT = "plancache-bundle"
BUNDLE_VERSION: Final = 2
#: The most a bundle file is read for (it is parsed whole, in memory): 1000 plans of 64 KiB make 89 MB
#: (docs/DEPLOYMENT.md), so this holds about 12,000; ``/dev/zero`` or another file named by mistake is refused.
MAX_BUNDLE_BYTES = 1 << 30


class BundleHeader(StrictModel):
    version: Literal[2]
    environment: Environment
    env_id: str = Field(pattern=ENV_ID_PATTERN)
    created_at: datetime
    entries: int = Field(ge=0)


class BundleEntry(StrictModel):
    record: PlanRecord
    blob_b64: str
    spec: dict[str, Any]


class BundleDocument(StrictModel):
    format: Literal["plancache-bundle"]
    header: BundleHeader
    entries: list[BundleEntry]
    envelope: Envelope | None = None


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
    older: int = 0  # entries skipped: the store already holds a newer revision for their key and environment


def bundle_statement(doc: dict[str, Any]) -> dict[str, Any]:
    """The in-toto statement the envelope of bundle ``doc`` (the document as it appears in the file) signs."""
    entries = doc["entries"]
    digest = hashlib.sha256(canonical_json(entries).encode()).hexdigest()
    return statement(((e["record"]["graph_key"], e["record"]["blob_sha256"]) for e in entries), BUNDLE_PREDICATE,
                     {"header": doc["header"], "entries_sha256": digest})


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
        created_at=now or datetime.now(UTC), entries=len(entries),
    )
    doc: dict[str, Any] = {"format": BUNDLE_FORMAT, "header": header.model_dump(mode="json"), "entries": entries}
    doc["envelope"] = signer.envelope(bundle_statement(doc)).model_dump() if signer else None
    return doc


def write_bundle(doc: dict[str, Any], path: Path | str) -> None:
    """Write ``doc`` to ``path`` with :func:`~plancache.files.atomic_write` (compact JSON, UTF-8); one over
    :data:`MAX_BUNDLE_BYTES`, which no import would read, is :class:`PayloadTooLarge` (nothing is written)."""
    data = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    if len(data) > MAX_BUNDLE_BYTES:
        raise PayloadTooLarge(f"a bundle of {len(doc['entries'])} plans would be {len(data)} bytes, over the limit of "
                              f"{MAX_BUNDLE_BYTES} bytes an import reads: export fewer plans per file (--keys FILE)")
    atomic_write(path, data)


def read_bundle(path: Path | str) -> tuple[dict[str, Any], BundleDocument]:
    """Parse a bundle file: the raw document (what the envelope's statement covers) and its validated model.

    Raises :class:`VerificationError` (reason ``malformed``) for anything that is not a well-formed bundle, and
    ``OSError`` for a file that cannot be read or is over :data:`MAX_BUNDLE_BYTES` (``EFBIG``).
    """
    try:
        raw = json.loads(read_limited(path, MAX_BUNDLE_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerificationError(Reason.MALFORMED, f"{path}: not a plancache bundle (invalid JSON: {exc})") from None
    except RecursionError:  # arrays or objects nested deeper than Python's recursion limit
        raise VerificationError(Reason.MALFORMED, f"{path}: not a plancache bundle (JSON nested too deep)") from None
    if not isinstance(raw, dict) or raw.get("format") != BUNDLE_FORMAT:
        raise VerificationError(Reason.MALFORMED, f"{path}: not a plancache bundle (no \"format\": \"{BUNDLE_FORMAT}\")")
    header = raw.get("header")
    if isinstance(header, dict) and header.get("version") == 1:
        raise VerificationError(Reason.MALFORMED, f"{path}: a version 1 bundle, signed with the retired statement-v1 "
                                             f"signature, which this plancache no longer reads: export it again")
    # The document without its entries, then each entry on its own, stopping at the first invalid one: validated
    # whole, a file of N invalid entries made N errors (3 MB of ``{}`` entries: 3 million errors, 3.3 GB, 21 s).
    entries = raw.get("entries")
    listed: list[Any] = entries if isinstance(entries, list) else []
    try:
        doc = BundleDocument.model_validate({**raw, "entries": []} if isinstance(entries, list) else raw)
        for index, entry in enumerate(listed):
            try:
                doc.entries.append(BundleEntry.model_validate(entry))
            except ValidationError as exc:
                problems = [{**p, "loc": ("entries", index, *p["loc"])} for p in exc.errors(include_input=False)]
                raise VerificationError(Reason.MALFORMED,
                                        f"{path}: invalid bundle: {validation_message(problems, 1)}") from None
    except ValidationError as exc:
        raise VerificationError(Reason.MALFORMED, f"{path}: invalid bundle: {validation_message(exc.errors(), 1)}") from None
    return raw, doc


def _verify_entry(index: int, entry: BundleEntry, header: BundleHeader, trusted: TrustedKeys | None) -> BundlePlan:
    """Decode the entry's blob and spec (``malformed``), then the shared verification against the header."""
    name = _entry_name(index, entry)
    try:
        blob = b64decode(entry.blob_b64, what=f"{name}: blob")
    except ValueError as exc:
        raise VerificationError(Reason.MALFORMED, str(exc)) from None
    try:
        key = graph_key(entry.spec)
    except PlanCacheError as exc:
        raise VerificationError(Reason.MALFORMED, f"{name}: {exc.message}") from None
    verify_blob(entry.record, blob, what=name, trusted=trusted, graph_key=key, environment=header.environment)
    return BundlePlan(entry.record, blob, entry.spec)


def verify_bundle(raw: dict[str, Any], doc: BundleDocument, trusted: TrustedKeys | None) -> list[BundlePlan]:
    """Every check of the module docstring; the verified plans, or :class:`VerificationError` for the first failure.

    With ``trusted`` empty or ``None`` the bundle's envelope is not checked (nothing to check it against).
    """
    header = doc.header
    if header.env_id != header.environment.env_id:
        raise VerificationError(Reason.ENVIRONMENT, f"bundle header env_id {header.env_id} is not the id of its "
                                               f"environment ({header.environment.env_id})")
    if header.entries != len(doc.entries):
        raise VerificationError(Reason.MALFORMED, f"bundle header counts {header.entries} entries, it holds {len(doc.entries)}")
    if trusted and trusted.open(doc.envelope, BUNDLE_PREDICATE, what="bundle") != bundle_statement(raw):
        raise SignatureError(Reason.BAD_SIGNATURE, "bundle: its header or entries do not match its signed statement")
    plans: list[BundlePlan] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(doc.entries):
        key = entry.record.graph_key
        if key in seen:
            raise VerificationError(Reason.MALFORMED, f"{_entry_name(index, entry)}: graph key repeats entry {seen[key]}")
        seen[key] = index
        plans.append(_verify_entry(index, entry, header, trusted))
    return plans


def load_bundle(path: Path | str, trusted_keys: TrustedKeys | None) -> list[BundlePlan]:
    """Read and verify a bundle file; its plans as ``(record, blob, spec)`` tuples (no server, no store)."""
    raw, doc = read_bundle(path)
    return verify_bundle(raw, doc, trusted_keys)


def collect_plans(store: Store, environment: Environment, graph_keys: list[str] | None) -> list[BundlePlan]:
    """The stored plans (record, blob, canonical spec) of ``graph_keys`` — or every stored plan, with ``None`` —
    on ``environment``. A key without a plan there is :class:`NotFound`, listing every such key."""
    if graph_keys is None:
        # The keys in one query, then each record: paging the listing (newest first) by offset left out a plan
        # replaced meanwhile (a re-tune, `plans resign`), which moved to the top of pages already read.
        found_now = {k: store.get_plan(k, environment) for k in store.plan_graph_keys(environment.env_id)}
        records: dict[str, PlanRecord] = {k: r for k, r in found_now.items() if r is not None}  # (None: withdrawn)
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
            absent = "blob" if blob is None else "spec"
            raise IntegrityError(f"plan {key} on {environment.describe()}: its {absent} is not stored")
        plans.append(BundlePlan(record, blob, spec))
    return plans


def export_bundle(store: Store, environment: Environment, graph_keys: list[str] | None, out: Path | str,
                  signer: Signer | None = None) -> int:
    """Write the bundle of ``graph_keys`` (or every plan, with ``None``) on ``environment`` to ``out``;
    the number of plans written."""
    plans = collect_plans(store, environment, graph_keys)
    write_bundle(build_bundle(environment, plans, signer), out)
    return len(plans)


def import_bundle(store: Store, path: Path | str, trusted_keys: TrustedKeys | None,
                  *, progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Verify a bundle whole, then publish its specs and plans into ``store`` (idempotent).

    Nothing is written when any entry fails verification, or when the store already holds a different
    plan of the same or an older revision for an entry's graph key and environment (:class:`Conflict` naming the
    entry). An entry older than the stored record, or than a withdrawal of its plan, is skipped and counted
    (``older``); one of the stored plan signed again (its blob, a higher revision: ``plans resign``) replaces it.
    """
    raw, doc = read_bundle(path)
    plans = verify_bundle(raw, doc, trusted_keys)
    environment = doc.header.environment
    withdrawn = store.get_withdrawals(environment, [plan.record.graph_key for plan in plans])
    unchanged, older, fresh = 0, 0, []
    replaced: set[str] = set()  # stored with the same blob and a lower revision (signed again): the bundle's replaces it
    for index, plan in enumerate(plans):
        stored = store.get_plan(plan.record.graph_key, plan.record.environment)
        withdrawal = withdrawn.get(plan.record.graph_key)
        if (stored is not None and stored.revision > plan.record.revision
                or withdrawal is not None and withdrawal.revision >= plan.record.revision):
            older += 1  # an older record never replaces a newer one, nor comes back after a withdrawal: skipped
            continue
        if stored is not None and stored.blob_sha256 != plan.record.blob_sha256:
            raise Conflict(f"bundle entry {index} (graph key {plan.record.graph_key[:16]}): the store holds another "
                           f"plan (blob {stored.blob_sha256[:16]}) for this graph key on {environment.describe()}")
        if stored is not None and stored.revision < plan.record.revision:
            replaced.add(plan.record.graph_key)
        else:
            unchanged += stored is not None
        fresh.append(plan)
    plans = fresh
    for done, plan in enumerate(plans, 1):
        store.put_spec(plan.record.graph_key, plan.spec)
        meta = PlanMeta.model_validate(plan.record.model_dump(include=set(PlanMeta.model_fields)))
        store.publish_plan(meta, plan.blob, replace=plan.record.graph_key in replaced)
        if progress:
            progress(done, len(plans))
    if plans:
        store.analyze()  # a bulk change
    return ImportReport(environment, len(plans) - unchanged, unchanged, bool(trusted_keys), older)
