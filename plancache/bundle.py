"""Plan bundles: one signed file holding the plans of one GPU environment, for hosts without a server.

A bundle is a single UTF-8 JSON document::

    {"format": "plancache-bundle",
     "header": {"version": 2, "environment": {...}, "env_id": "...", "created_at": "...", "entries": N},
     "entries": [{"record": <PlanRecord>, "blob_b64": "<base64 plan blob>", "spec": <canonical GraphSpec>}, ...],
     "envelope": <DSSE envelope> | null}

The envelope (:mod:`plancache.signing`) carries an in-toto statement (:func:`bundle_statement`) whose one
subject, :data:`ENTRIES_SUBJECT`, and predicate (:data:`~plancache.signing.BUNDLE_PREDICATE`: the header and that
digest) name the sha256 of the canonical JSON (sorted keys, no whitespace) of ``entries`` as they appear in the
file: it covers every record, blob and spec, and its size does not grow with the bundle's (an envelope's payload
is at most :data:`~plancache.protocol.MAX_ENVELOPE_PAYLOAD` characters). A statement naming each entry's blob as a
subject of its own (:func:`legacy_bundle_statement`, bundles of at most 72 plans) is accepted too. Version 1
bundles (signed with the retired statement-v1 signature) are refused with a message saying to export them again.

:func:`export_bundle` streams: it reads one plan from the store and writes its entry at a time, hashing as it
goes, and writes the header and the envelope after the entries, so its memory does not grow with the bundle.

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

import errno
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
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
from .files import atomic_write, fsync_dir, read_limited
from .protocol import Envelope, PlanMeta, PlanRecord, b64decode, b64encode
from .signing import BUNDLE_PREDICATE, Signer, TrustedKeys, statement
from .spec import graph_key
from .validation import StrictModel, validation_message
from .verify import verify_blob

if TYPE_CHECKING:
    from .store import Store

BUNDLE_FORMAT = "plancache-bundle"
#: How a bundle :func:`stream_bundle` wrote begins: such a file is read an entry (a line) at a time.
_STREAMED_HEAD = b'{"format":"' + BUNDLE_FORMAT.encode() + b'","entries":[\n'
BUNDLE_VERSION: Final = 2
#: The most a bundle file that :func:`stream_bundle` did not write is read for (it is parsed whole, in memory: 1000
#: plans of 64 KiB make 89 MB, docs/DEPLOYMENT.md), and the longest entry (line) of one it wrote, which is read an
#: entry at a time and has no bound as a whole; ``/dev/zero`` or another file named by mistake is refused.
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


#: The name of the one subject of a bundle's statement: the digest of its ``entries``.
ENTRIES_SUBJECT = "plancache-bundle-entries"


def _entries_sha256(entries: list[dict[str, Any]]) -> str:
    return hashlib.sha256(canonical_json(entries).encode()).hexdigest()


def bundle_statement(header: dict[str, Any], entries_sha256: str) -> dict[str, Any]:
    """The in-toto statement the envelope of a bundle signs: of its ``header`` and the sha256 of the canonical JSON
    of its entries."""
    return statement([(ENTRIES_SUBJECT, entries_sha256)], BUNDLE_PREDICATE,
                     {"header": header, "entries_sha256": entries_sha256})


def legacy_bundle_statement(doc: dict[str, Any]) -> dict[str, Any]:
    """The statement of a bundle whose subjects are its entries' blobs, one each (the first form of version 2, which
    fits the envelope up to 72 plans), accepted as :func:`bundle_statement`."""
    entries = doc["entries"]
    return statement(((e["record"]["graph_key"], e["record"]["blob_sha256"]) for e in entries), BUNDLE_PREDICATE,
                     {"header": doc["header"], "entries_sha256": _entries_sha256(entries)})


def _entry_name(index: int, entry: BundleEntry) -> str:
    return f"bundle entry {index} (graph key {entry.record.graph_key[:16]})"


def build_bundle(environment: Environment, plans: Iterable[BundlePlan], signer: Signer | None = None,
                 *, now: datetime | None = None) -> dict[str, Any]:
    """The bundle document (a JSON-ready dict) for ``plans`` of ``environment``, signed when ``signer`` is given."""
    entries = [_entry(p) for p in sorted(plans, key=lambda p: p.record.graph_key)]
    header = _header(environment, len(entries), now)
    doc: dict[str, Any] = {"format": BUNDLE_FORMAT, "header": header, "entries": entries}
    doc["envelope"] = signer.envelope(bundle_statement(header, _entries_sha256(entries))).model_dump() if signer else None
    return doc


def _entry(plan: BundlePlan) -> dict[str, Any]:
    return {"record": plan.record.file_json(), "blob_b64": b64encode(plan.blob), "spec": plan.spec}


def _header(environment: Environment, entries: int, now: datetime | None) -> dict[str, Any]:
    return BundleHeader(version=BUNDLE_VERSION, environment=environment, env_id=environment.env_id,
                        created_at=now or datetime.now(UTC), entries=entries).model_dump(mode="json")


def _compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _too_large(plans: int, size: int, what: str = "the bundle") -> PayloadTooLarge:
    return PayloadTooLarge(f"{what} is over the limit of {MAX_BUNDLE_BYTES} bytes an import reads ({size} bytes "
                           f"with {plans} plans): export fewer plans per file (--keys FILE)")


def write_bundle(doc: dict[str, Any], path: Path | str) -> None:
    """Write ``doc`` to ``path`` with :func:`~plancache.files.atomic_write` (compact JSON, UTF-8); one over
    :data:`MAX_BUNDLE_BYTES`, which no import would read, is :class:`PayloadTooLarge` (nothing is written)."""
    data = _compact(doc)
    if len(data) > MAX_BUNDLE_BYTES:
        raise _too_large(len(doc["entries"]), len(data))
    atomic_write(path, data)


def stream_bundle(environment: Environment, plans: Iterable[BundlePlan], path: Path | str, signer: Signer | None = None,
                  *, now: datetime | None = None) -> int:
    """Write the bundle of ``plans`` (in the order given) to ``path`` an entry at a time, as :func:`build_bundle`
    and :func:`write_bundle` would write it whole, but holding one plan at a time; the header and the envelope
    come after the entries, and an import reads it an entry at a time (:class:`StreamedBundle`): its size has no
    bound, an entry over :data:`MAX_BUNDLE_BYTES` is :class:`PayloadTooLarge`, nothing written. Atomic: a temporary
    file renamed into place. Returns the number of plans."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o600)
            digest = hashlib.sha256(b"[")
            fh.write(_STREAMED_HEAD)
            count = 0
            for plan in plans:
                entry = _entry(plan)
                digest.update((b"," if count else b"") + canonical_json(entry).encode())
                line = _compact(entry)
                count += 1
                if len(line) + 2 > MAX_BUNDLE_BYTES:  # with its "," and newline
                    raise _too_large(count, len(line), f"entry {count - 1} (graph key {plan.record.graph_key[:16]})")
                fh.write((b",\n" if count > 1 else b"") + line)
            digest.update(b"]")
            header = _header(environment, count, now)
            envelope = signer.envelope(bundle_statement(header, digest.hexdigest())).model_dump() if signer else None
            fh.write(b"\n]," + _compact({"header": header, "envelope": envelope})[1:])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return count


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


def _verify_entry(index: int, entry: BundleEntry, environment: Environment, trusted: TrustedKeys | None
                  ) -> BundlePlan:
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
    verify_blob(entry.record, blob, what=name, trusted=trusted, graph_key=key, environment=environment)
    return BundlePlan(entry.record, blob, entry.spec)


def _signed_statement_matches(signed: dict[str, Any], raw: dict[str, Any]) -> bool:
    """Whether ``signed`` is the statement of the bundle document ``raw`` (or its legacy statement)."""
    subject = signed.get("subject")
    if isinstance(subject, list) and len(subject) == 1 and isinstance(subject[0], dict) \
            and subject[0].get("name") == ENTRIES_SUBJECT:
        return signed == bundle_statement(raw["header"], _entries_sha256(raw["entries"]))
    return signed == legacy_bundle_statement(raw)


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
    if trusted and not _signed_statement_matches(trusted.open(doc.envelope, BUNDLE_PREDICATE, what="bundle"), raw):
        raise SignatureError(Reason.BAD_SIGNATURE, "bundle: its header or entries do not match its signed statement")
    plans: list[BundlePlan] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(doc.entries):
        key = entry.record.graph_key
        if key in seen:
            raise VerificationError(Reason.MALFORMED, f"{_entry_name(index, entry)}: graph key repeats entry {seen[key]}")
        seen[key] = index
        plans.append(_verify_entry(index, entry, header.environment, trusted))
    return plans


def load_bundle(path: Path | str, trusted_keys: TrustedKeys | None) -> list[BundlePlan]:
    """Read and verify a bundle file; its plans as ``(record, blob, spec)`` tuples (no server, no store)."""
    raw, doc = read_bundle(path)
    return verify_bundle(raw, doc, trusted_keys)


def bundle_keys(store: Store, environment: Environment, graph_keys: list[str] | None) -> list[str]:
    """The graph keys to export, sorted: ``graph_keys``, or every key with a plan on ``environment`` with ``None``.
    A key without a plan there is :class:`NotFound`, listing every such key; so is an environment without plans."""
    # The keys in one query, then each record as it is written: paging the listing (newest first) by offset left
    # out a plan replaced meanwhile (a re-tune, `plans resign`), which moved to the top of pages already read.
    stored = store.plan_graph_keys(environment.env_id)
    if graph_keys is None:
        if not stored:
            raise NotFound(f"no plans are stored for {environment.describe()} (env id {environment.env_id})")
        return stored
    have = set(stored)
    asked = sorted(dict.fromkeys(graph_keys))
    missing = [k for k in asked if k not in have]
    if missing:
        raise NotFound(f"{len(missing)} of {len(asked)} graph keys have no plan on {environment.describe()}: "
                       + ", ".join(missing[:10]) + (" …" if len(missing) > 10 else ""))
    return asked


def iter_plans(store: Store, environment: Environment, keys: Iterable[str]) -> Iterator[BundlePlan]:
    """The stored plan (record, blob, canonical spec) of each key on ``environment``, read one at a time; a key whose
    plan was withdrawn meanwhile is left out."""
    for key in keys:
        record = store.get_plan(key, environment)
        if record is None:
            continue
        blob, spec = store.get_blob(record.blob_sha256), store.get_spec(key)
        if blob is None or spec is None:
            absent = "blob" if blob is None else "spec"
            raise IntegrityError(f"plan {key} on {environment.describe()}: its {absent} is not stored")
        yield BundlePlan(record, blob, spec)


def export_bundle(store: Store, environment: Environment, graph_keys: list[str] | None, out: Path | str,
                  signer: Signer | None = None) -> int:
    """Stream the bundle of ``graph_keys`` (or every plan, with ``None``) on ``environment`` to ``out``
    (:func:`stream_bundle`); the number of plans written."""
    return stream_bundle(environment, iter_plans(store, environment, bundle_keys(store, environment, graph_keys)),
                         out, signer)


def import_bundle(store: Store, path: Path | str, trusted_keys: TrustedKeys | None,
                  *, progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Verify a bundle whole, then publish its specs and plans into ``store`` (idempotent).

    Nothing is written when any entry fails verification, or when the store already holds a different
    plan of the same or an older revision for an entry's graph key and environment (:class:`Conflict` naming the
    entry). An entry older than the stored record, or than a withdrawal of its plan, is skipped and counted
    (``older``); one of the stored plan signed again (its blob, a higher revision: ``plans resign``) replaces it.

    A bundle :func:`stream_bundle` wrote is read an entry at a time, twice: verified whole first (keeping each
    entry's digest), then published, each entry checked to be the bytes verified (a file changed in between
    stops the import there, every entry published so far verified on its own)."""
    briefs: list[tuple[str, int, str]] = []
    header, plans = read_verified(path, trusted_keys, lambda p: briefs.append(
        (p.record.graph_key, p.record.revision, p.record.blob_sha256)))
    environment = header.environment
    actions, unchanged, older = _import_actions(store, environment, briefs)
    total = sum(action != "skip" for action in actions)
    done = 0
    for action, plan in zip(actions, plans):
        if action == "skip":
            continue
        store.put_spec(plan.record.graph_key, plan.spec)
        meta = PlanMeta.model_validate(plan.record.model_dump(include=set(PlanMeta.model_fields)))
        store.publish_plan(meta, plan.blob, replace=action == "replace")
        done += 1
        if progress:
            progress(done, total)
    if total:
        store.analyze()  # a bulk change
    return ImportReport(environment, total - unchanged, unchanged, bool(trusted_keys), older)


def read_verified(path: Path | str, trusted: TrustedKeys | None,
                  visit: Callable[[BundlePlan], None] | None = None) -> tuple[BundleHeader, Iterable[BundlePlan]]:
    """Read and verify a bundle whole (:func:`verify_bundle`), calling ``visit`` with each plan; its header and its
    plans. A bundle :func:`stream_bundle` wrote is read an entry at a time (:class:`StreamedBundle`), and its plans
    are read again as they are iterated (each entry checked to be the bytes verified), so memory holds one."""
    if _is_streamed(path):
        streamed = StreamedBundle(path, trusted)
        for plan in streamed.plans():
            if visit:
                visit(plan)
        return streamed.header(), streamed.plans(again=True)
    raw, doc = read_bundle(path)
    plans = verify_bundle(raw, doc, trusted)
    if visit is not None:
        for plan in plans:
            visit(plan)
    return doc.header, plans


def _import_actions(store: Store, environment: Environment, briefs: list[tuple[str, int, str]]
                    ) -> tuple[list[str], int, int]:
    """What an import does with each entry, given as (graph key, revision, blob sha256): ``skip`` (older than the
    stored record or a withdrawal), ``replace`` (the stored plan signed again) or ``put``; and how many of those
    put are stored already, and how many are skipped. :class:`Conflict` for another plan stored."""
    withdrawn = store.get_withdrawals(environment, [key for key, _, _ in briefs])
    actions, unchanged, older = [], 0, 0
    for index, (key, revision, blob_sha256) in enumerate(briefs):
        stored = store.get_plan(key, environment)
        withdrawal = withdrawn.get(key)
        if (stored is not None and stored.revision > revision
                or withdrawal is not None and withdrawal.revision >= revision):
            older += 1  # an older record never replaces a newer one, nor comes back after a withdrawal: skipped
            actions.append("skip")
            continue
        if stored is not None and stored.blob_sha256 != blob_sha256:
            raise Conflict(f"bundle entry {index} (graph key {key[:16]}): the store holds another plan (blob "
                           f"{stored.blob_sha256[:16]}) for this graph key on {environment.describe()}")
        if stored is not None and stored.revision < revision:
            actions.append("replace")
        else:
            unchanged += stored is not None
            actions.append("put")
    return actions, unchanged, older




def _is_streamed(path: Path | str) -> bool:
    """Whether ``path`` is a regular file that begins as :func:`stream_bundle` writes."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as fh:
            return fh.read(len(_STREAMED_HEAD)) == _STREAMED_HEAD
    except OSError:
        return False  # read_bundle names the problem


class StreamedBundle:
    """A bundle :func:`stream_bundle` wrote, read and verified an entry at a time: memory holds one entry, and a
    digest of each entry read (to check a second read against the first)."""

    def __init__(self, path: Path | str, trusted: TrustedKeys | None) -> None:
        self.path, self.trusted = path, trusted
        self._lines: list[bytes] = []
        self._header: BundleHeader | None = None

    def header(self) -> BundleHeader:
        """The header, once :meth:`plans` has read the whole file."""
        assert self._header is not None, "read the plans first"
        return self._header

    def _malformed(self, problem: str) -> VerificationError:
        return VerificationError(Reason.MALFORMED, f"{self.path}: invalid bundle: {problem}")

    def plans(self, *, again: bool = False) -> Iterator[BundlePlan]:
        """Every entry verified (as :func:`verify_bundle` does), one at a time; the header and the envelope are
        checked after the last. ``again``: a second read, each entry checked to be the bytes of the first."""
        digest, seen, environment = hashlib.sha256(b"["), dict[str, int](), None
        with open(self.path, "rb") as fh:
            fh.readline(len(_STREAMED_HEAD) + 1)
            index = 0
            while True:
                line = fh.readline(MAX_BUNDLE_BYTES + 1)
                if len(line) > MAX_BUNDLE_BYTES:
                    raise OSError(errno.EFBIG, f"a line of over {MAX_BUNDLE_BYTES} bytes", str(self.path))
                if not line:
                    raise self._malformed(f"cut off after {index} entries")
                if line.startswith(b"]"):
                    break
                line_sha256 = hashlib.sha256(line).digest()
                if again and (index >= len(self._lines) or self._lines[index] != line_sha256):
                    raise self._malformed(f"entry {index} changed while it was imported; run the import again")
                if not again:
                    self._lines.append(line_sha256)
                text = line.rstrip(b"\n")
                raw = self._json(text[:-1] if text.endswith(b",") else text, f"entry {index}")
                try:
                    entry = BundleEntry.model_validate(raw)
                except ValidationError as exc:
                    problems = [{**p, "loc": ("entries", index, *p["loc"])} for p in exc.errors(include_input=False)]
                    raise self._malformed(validation_message(problems, 1)) from None
                digest.update((b"," if index else b"") + canonical_json(raw).encode())
                key = entry.record.graph_key
                if key in seen:
                    raise VerificationError(Reason.MALFORMED, f"{_entry_name(index, entry)}: graph key repeats entry "
                                                              f"{seen[key]}")
                seen[key] = index
                environment = environment or entry.record.environment
                yield _verify_entry(index, entry, environment, self.trusted)
                index += 1
        digest.update(b"]")
        self._check_tail(self._json(b"{" + line[2:], "the header"), index, environment, digest.hexdigest())

    def _json(self, text: bytes, what: str) -> Any:
        try:
            return json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise self._malformed(f"{what} is not JSON ({type(exc).__name__})") from None

    def _check_tail(self, tail: Any, count: int, environment: Environment | None, entries_sha256: str) -> None:
        if not isinstance(tail, dict) or set(tail) != {"header", "envelope"}:
            raise self._malformed("after the entries, a header and an envelope")
        try:
            header = BundleHeader.model_validate(tail["header"])
            envelope = None if tail["envelope"] is None else Envelope.model_validate(tail["envelope"])
        except ValidationError as exc:
            raise self._malformed(validation_message(exc.errors(), 1)) from None
        if header.env_id != header.environment.env_id:
            raise VerificationError(Reason.ENVIRONMENT, f"bundle header env_id {header.env_id} is not the id of its "
                                                        f"environment ({header.environment.env_id})")
        if header.entries != count:
            raise VerificationError(Reason.MALFORMED, f"bundle header counts {header.entries} entries, it holds {count}")
        if environment is not None and environment.env_id != header.environment.env_id:
            raise VerificationError(Reason.ENVIRONMENT, f"bundle entries are for {environment.describe()}, its header "
                                                        f"for {header.environment.describe()}")
        if self.trusted and (self.trusted.open(envelope, BUNDLE_PREDICATE, what="bundle")
                             != bundle_statement(tail["header"], entries_sha256)):
            raise SignatureError(Reason.BAD_SIGNATURE, "bundle: its header or entries do not match its signed statement")
        self._header = header
