"""Signed static indexes: an environment's plan records as static files beside the content-addressed blobs.

A client that reads them starts with no API call: the index and the blobs are plain GETs that any HTTP cache or CDN
serves (:mod:`plancache.client.index`). Layout under a blob store's root (a folder, a bucket's prefix)::

    ab/cd/<sha256>                        plan blobs: the blob store's own layout
    index/<env_id>/root.json              the environment's signed root (rewritten by each publish)
    index/<env_id>/shards/<sha256>.json   shards, named by the sha256 of their bytes (never rewritten)

The root (:class:`IndexRoot`, like TUF's snapshot or a Nix binary cache's narinfo) is one UTF-8 JSON document::

    {"format": "plancache-index",
     "header": {"version": V, "environment": {...}, "env_id": "...", "published_at": "...", "expires": "...",
                "prefix_length": L, "shards": N},
     "shards": [{"prefix": "3f", "sha256": "...", "size": 1234, "plans": 40}, ...,
                {"prefix": "", "set": "llm-serving", "sha256": "...", "size": 91234, "plans": 49}, ...],
     "envelope": <DSSE envelope>}

The envelope (:mod:`plancache.signing`) carries an in-toto statement (:func:`index_statement`) whose predicate
(:data:`INDEX_PREDICATE`) is the header and the sha256 of the canonical JSON of ``shards``: a trusted key's
signature covers every shard's digest, so a shard is checked by its sha256 alone. A shard (:class:`IndexShard`) holds
the signed plan records of the graph keys that start with its ``prefix`` (the first ``prefix_length`` hex digits;
the publisher picks the length that keeps shards at most ``shard_plans`` records), so a start-up reads the root and
the shards of its own keys. A named set (``--set NAME=KEYS``: the graphs of one model or capture) is one more shard
holding the records of those keys: a client that names it (``PLANCACHE_INDEX_SETS``) reads the root and that shard,
kilobytes, however many plans the environment has; a key outside its sets is looked up by prefix.

A root is refused (:func:`open_root`, a :class:`~plancache.errors.VerificationError`) unless its envelope verifies by a
trusted key and states this document (``bad_signature`` and the other signature reasons), it is for the reader's
environment (``environment``), ``expires`` is still ahead (``expired``: a frozen or replayed index stops working at
that bound), and its ``version`` is not below the highest version the reader accepted before (``revision``: an older
index is never taken back). Each record of a shard is then verified as any record (size, sha256, signature, graph key,
environment, revision: :mod:`plancache.verify`), so an index never lowers a key's revision below what a host has seen.

This module needs no SQLAlchemy: :func:`publish_index` takes a store object (:class:`plancache.store.Store`) from the
caller and a :class:`Target` that writes named files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import Field, ValidationError

from .canonical import canonical_json
from .environment import ENV_ID_PATTERN, Environment
from .errors import BlobStoreUnavailable, NotFound, Reason, SignatureError, VerificationError
from .protocol import SHA256_PATTERN, Envelope, PlanRecord
from .signing import Signer, TrustedKeys, next_revision, statement
from .validation import INT64_MAX, Int, StrictModel, validation_message

if TYPE_CHECKING:
    from .blobs import BlobStore
    from .store import Store

T = TypeVar("T")

INDEX_FORMAT = "plancache-index"
SHARD_FORMAT = "plancache-index-shard"
#: The predicate type of an index root's statement.
INDEX_PREDICATE = "https://plancache.dev/index/v1"
#: Where the index files live under a blob store's root.
INDEX_FOLDER = "index"
#: The longest shard prefix (16**4 shards).
MAX_PREFIX_LENGTH = 4
#: Records per shard the publisher aims at, by default.
DEFAULT_SHARD_PLANS = 64
#: The most a reader reads of a root (65,536 shards of about 110 bytes) and of a shard.
MAX_ROOT_BYTES = 16 << 20
MAX_SHARD_BYTES = 64 << 20
#: A set's name.
SET_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Records read from the store per query while publishing.
READ_BATCH = 1000
#: How long a root stays valid by default, and at most.
DEFAULT_EXPIRY = timedelta(days=7)
MAX_EXPIRY = timedelta(days=366)


class ShardRef(StrictModel):
    """A shard as the root names it: the graph keys starting with ``prefix`` (or those of the named ``set``, whose
    prefix is empty), in a file of ``size`` bytes whose sha256 is ``sha256``, holding ``plans`` records."""

    prefix: str = Field(pattern=rf"^[0-9a-f]{{0,{MAX_PREFIX_LENGTH}}}$")
    set: str | None = Field(default=None, pattern=SET_NAME_PATTERN)
    sha256: str = Field(pattern=SHA256_PATTERN)
    size: Int = Field(ge=1, le=MAX_SHARD_BYTES)
    plans: Int = Field(ge=1, le=INT64_MAX)


class IndexHeader(StrictModel):
    version: Int = Field(ge=1, le=INT64_MAX)
    environment: Environment
    env_id: str = Field(pattern=ENV_ID_PATTERN)
    published_at: datetime
    expires: datetime
    prefix_length: int = Field(ge=0, le=MAX_PREFIX_LENGTH)
    shards: int = Field(ge=0, le=2 * 16 ** MAX_PREFIX_LENGTH)


class IndexRoot(StrictModel):
    """The signed root of one environment's index (see the module docstring)."""

    format: Literal["plancache-index"]
    header: IndexHeader
    shards: list[ShardRef] = Field(max_length=2 * 16 ** MAX_PREFIX_LENGTH)
    envelope: Envelope | None = None

    def shard_for(self, graph_key: str) -> ShardRef | None:
        """The prefix shard that holds ``graph_key`` if the index has it; None when no shard has its prefix."""
        prefix = graph_key[:self.header.prefix_length]
        return next((s for s in self.shards if s.prefix == prefix and s.set is None), None)

    def set_named(self, name: str) -> ShardRef | None:
        """The shard of the set ``name``; None when the index has no such set."""
        return next((s for s in self.shards if s.set == name), None)


class IndexShard(StrictModel):
    """The records of the graph keys that start with ``prefix`` (or of the set ``set``) on ``env_id``, sorted by
    graph key."""

    format: Literal["plancache-index-shard"]
    env_id: str = Field(pattern=ENV_ID_PATTERN)
    prefix: str = Field(pattern=rf"^[0-9a-f]{{0,{MAX_PREFIX_LENGTH}}}$")
    set: str | None = Field(default=None, pattern=SET_NAME_PATTERN)
    plans: list[PlanRecord]


def root_path(env_id: str) -> str:
    """The root's name under a blob store's root."""
    return f"{INDEX_FOLDER}/{env_id}/root.json"


def shard_path(env_id: str, sha256: str) -> str:
    """A shard's name under a blob store's root."""
    return f"{INDEX_FOLDER}/{env_id}/shards/{sha256}.json"


def prefix_length(plans: int, shard_plans: int) -> int:
    """The shortest prefix length (at most :data:`MAX_PREFIX_LENGTH`) that keeps ``plans`` spread evenly over
    shards of at most ``shard_plans`` records."""
    length = 0
    while length < MAX_PREFIX_LENGTH and plans > shard_plans * 16 ** length:
        length += 1
    return length


def index_statement(doc: dict[str, Any]) -> dict[str, Any]:
    """The in-toto statement the envelope of root ``doc`` (the document as it appears in the file) signs."""
    digest = hashlib.sha256(canonical_json(doc["shards"]).encode()).hexdigest()
    return statement([(root_path(doc["header"]["env_id"]), digest)], INDEX_PREDICATE,
                     {"header": doc["header"], "shards_sha256": digest})


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def build_index(environment: Environment, records: Iterable[PlanRecord], signer: Signer, *, version: int,
                now: datetime | None = None, expires_in: timedelta = DEFAULT_EXPIRY,
                shard_plans: int = DEFAULT_SHARD_PLANS,
                sets: dict[str, list[str]] | None = None) -> tuple[bytes, dict[str, bytes]]:
    """The root's bytes and the shards' (by name, :func:`shard_path`) of ``records`` on ``environment``, signed by
    ``signer``, at ``version``, valid for ``expires_in`` from ``now``; ``sets``: named sets of graph keys, each a
    shard of the records of its keys (keys without a record left out)."""
    if not timedelta(0) < expires_in <= MAX_EXPIRY:
        raise ValueError(f"an index expires after more than 0 and at most {MAX_EXPIRY.days} days, not {expires_in}")
    if shard_plans < 1:
        raise ValueError("shard_plans must be >= 1")
    now = now or datetime.now(UTC)
    by_key = {r.graph_key: r for r in records}
    length = prefix_length(len(by_key), shard_plans)
    groups: dict[str, list[PlanRecord]] = {}
    for key in sorted(by_key):
        groups.setdefault(key[:length], []).append(by_key[key])
    named = {name: [by_key[k] for k in sorted(set(keys)) if k in by_key] for name, keys in (sets or {}).items()}
    refs, files = [], {}
    for (prefix, name), group in [*(((p, None), g) for p, g in groups.items()),
                                  *((("", n), g) for n, g in sorted(named.items()) if g)]:
        named_part = {} if name is None else {"set": name}
        data = _json({"format": SHARD_FORMAT, "env_id": environment.env_id, "prefix": prefix, **named_part,
                      "plans": [r.file_json() for r in group]})
        sha = hashlib.sha256(data).hexdigest()
        files[shard_path(environment.env_id, sha)] = data
        refs.append({"prefix": prefix, **named_part, "sha256": sha, "size": len(data), "plans": len(group)})
    header = IndexHeader(version=version, environment=environment, env_id=environment.env_id, published_at=now,
                         expires=now + expires_in, prefix_length=length, shards=len(refs))
    doc: dict[str, Any] = {"format": INDEX_FORMAT, "header": header.model_dump(mode="json"), "shards": refs}
    doc["envelope"] = signer.envelope(index_statement(doc)).model_dump()
    return _json(doc), files


def open_root(data: bytes, trusted: TrustedKeys, environment: Environment, *, min_version: int = 0,
              now: datetime | None = None, what: str = "index root") -> IndexRoot:
    """The root in ``data`` once every check of the module docstring passed; else :class:`VerificationError` naming
    ``what`` and the problem (``malformed``, a signature reason, ``no_trusted_keys``, ``environment``, ``expired``,
    ``revision``)."""
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT:
            raise ValueError(f"no \"format\": \"{INDEX_FORMAT}\"")
        root = IndexRoot.model_validate(raw)
    except ValidationError as exc:
        raise VerificationError(Reason.MALFORMED, f"{what}: invalid: {validation_message(exc.errors(), 1)}") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise VerificationError(Reason.MALFORMED, f"{what}: not a plancache index: {exc}") from None
    if not trusted:
        raise VerificationError(Reason.NO_TRUSTED_KEYS, f"{what}: no trusted keys are configured "
                                                        "(PLANCACHE_TRUSTED_KEYS), so its signature cannot be verified")
    if trusted.open(root.envelope, INDEX_PREDICATE, what=what) != index_statement(raw):
        raise SignatureError(Reason.BAD_SIGNATURE, f"{what}: its header or shard list does not match its signed "
                                                   "statement")
    header = root.header
    if header.env_id != environment.env_id or header.environment.validity() != environment.validity():
        raise VerificationError(Reason.ENVIRONMENT, f"{what}: it is for {header.environment.describe()} (env id "
                                                    f"{header.env_id}), expected {environment.describe()}")
    now = now or datetime.now(UTC)
    if header.expires <= now:
        raise VerificationError(Reason.EXPIRED, f"{what}: version {header.version} expired at "
                                                f"{header.expires.isoformat()}: the index is no longer published "
                                                "(plancache index publish re-signs it) or an old copy is served")
    if header.version < min_version:
        raise VerificationError(Reason.REVISION, f"{what}: version {header.version} is older than version "
                                                 f"{min_version} accepted before (a replayed or stale copy)")
    by_prefix = [s for s in root.shards if s.set is None]
    named = [s for s in root.shards if s.set is not None]
    if header.shards != len(root.shards) or any(len(s.prefix) != header.prefix_length for s in by_prefix) \
            or len({s.prefix for s in by_prefix}) != len(by_prefix) or any(s.prefix for s in named) \
            or len({s.set for s in named}) != len(named):
        raise VerificationError(Reason.MALFORMED, f"{what}: its shards do not match its header")
    return root


def open_shard(data: bytes, ref: ShardRef, root: IndexRoot, *, what: str = "index shard") -> IndexShard:
    """The shard in ``data``, which the root names as ``ref``: its sha256 is checked first (``sha256``), then that it
    is a shard of ``ref``'s prefix (or set) on the root's environment whose records all have that prefix
    (``malformed``)."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise VerificationError(Reason.SHA256, f"{what} {ref.prefix!r}: sha256 {digest}, its root says {ref.sha256}")
    try:
        shard = IndexShard.model_validate_json(data)
    except ValidationError as exc:
        raise VerificationError(Reason.MALFORMED, f"{what} {ref.prefix!r}: invalid: "
                                                  f"{validation_message(exc.errors(), 1)}") from None
    if shard.env_id != root.header.env_id or shard.prefix != ref.prefix or shard.set != ref.set \
            or any(not r.graph_key.startswith(ref.prefix) for r in shard.plans):
        raise VerificationError(Reason.MALFORMED, f"{what} {ref.prefix!r}: not the shard its root names")
    return shard


class Target(Protocol):
    """Where an index is published: a blob store's root that also holds named files."""

    blobs: BlobStore

    def read(self, name: str, max_bytes: int) -> bytes | None:
        """The file ``name`` under the root; None when absent."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Write the file ``name`` under the root whole, replacing it."""
        ...


class FolderTarget:
    """A folder (``file:///path``): blobs in its blob-store layout, index files written atomically."""

    def __init__(self, root: Path) -> None:
        from .blobs import FolderBlobs

        self.root = root
        self.blobs: BlobStore = FolderBlobs(root)

    def read(self, name: str, max_bytes: int) -> bytes | None:
        from .files import read_limited

        try:
            return read_limited(self.root / name, max_bytes)
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        from .files import atomic_write

        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, mode=0o644)


class ObjectTarget:
    """A bucket's prefix (``s3://bucket/prefix``, ``gs://``, ``az://``) through obstore, as
    :class:`~plancache.blobs.ObjectStoreBlobs` reaches it."""

    def __init__(self, url: str) -> None:
        import obstore
        import obstore.store

        from .blobs import ObjectStoreBlobs

        self.blobs: BlobStore = ObjectStoreBlobs(url)
        self._obs = obstore
        self._store = obstore.store.from_url(url.rstrip("/"))

    def read(self, name: str, max_bytes: int) -> bytes | None:
        try:
            return bytes(self._call(lambda: self._obs.get(self._store, name).bytes()))[:max_bytes + 1]
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        self._call(lambda: self._obs.put(self._store, name, data))

    def _call(self, call: Callable[[], T]) -> T:
        """``call()``, obstore's errors other than not-found raised as :class:`BlobStoreUnavailable`."""
        try:
            return call()
        except self._obs.exceptions.BaseError as exc:
            raise BlobStoreUnavailable(f"index target {self.blobs.url}: {str(exc).splitlines()[0]}") from exc


def open_target(url: str) -> FolderTarget | ObjectTarget:
    """The publish target ``url`` names: ``file:///path`` or an object store's ``s3://bucket/prefix``."""
    from .blobs import FolderBlobs, blob_url_kind, open_blobs

    kind = blob_url_kind(url)
    if kind == "file":
        blobs = open_blobs(url)
        assert isinstance(blobs, FolderBlobs)
        return FolderTarget(blobs.root)
    if kind == "object":
        return ObjectTarget(url)
    raise ValueError(f"index target {url!r}: publish to a folder (file:///path) or a bucket (s3://bucket/prefix)")


class Published(StrictModel):
    """What :func:`publish_index` wrote."""

    version: int
    plans: int
    shards: int
    shards_written: int
    blobs_copied: int
    expires: datetime
    #: Graph keys of each named set without a plan on the environment (left out of its shard).
    sets_missing: dict[str, int] = {}


def publish_index(store: Store, environment: Environment, target: Target, signer: Signer, *,
                  expires_in: timedelta = DEFAULT_EXPIRY, shard_plans: int = DEFAULT_SHARD_PLANS,
                  sets: dict[str, list[str]] | None = None, now: datetime | None = None) -> Published:
    """Publish the index of every plan stored for ``environment`` to ``target`` (records read :data:`READ_BATCH` at a
    time): the blobs it lacks first, then the
    shards it lacks, then the root (so a reader never sees a root naming a file not yet there). ``sets``: named sets
    of graph keys (:func:`build_index`). The version is
    above the target's current root's (:func:`~plancache.signing.next_revision`). :class:`NotFound` when no plan is
    stored there."""
    keys = store.plan_graph_keys(environment.env_id)
    records = [record for start in range(0, len(keys), READ_BATCH)
               for _, record in store.plan_records(environment, keys[start:start + READ_BATCH]).values()]
    if not records:
        raise NotFound(f"no plans are stored for {environment.describe()} (env id {environment.env_id})")
    copied = 0
    for record in records:
        if not target.blobs.has(record.blob_sha256):
            blob = store.get_blob(record.blob_sha256)
            if blob is None:
                raise NotFound(f"plan {record.graph_key} on {environment.describe()}: its blob is not stored")
            target.blobs.put(record.blob_sha256, blob)
            copied += 1
    version = next_revision(_current_version(target, environment.env_id))
    root, shards = build_index(environment, records, signer, version=version, now=now, expires_in=expires_in,
                               shard_plans=shard_plans, sets=sets)
    stored = {r.graph_key for r in records}
    written = 0
    for name, data in shards.items():
        if target.read(name, MAX_SHARD_BYTES) != data:
            target.write(name, data)
            written += 1
    target.write(root_path(environment.env_id), root)
    header = json.loads(root)["header"]
    missing = {name: n for name, keys in (sets or {}).items() if (n := len(set(keys) - stored))}
    return Published(version=version, plans=len(records), shards=len(shards), shards_written=written,
                     blobs_copied=copied, expires=header["expires"], sets_missing=missing)


def _current_version(target: Target, env_id: str) -> int:
    """The version of the root ``target`` holds (unverified: only to publish above it); 0 for none."""
    data = target.read(root_path(env_id), MAX_ROOT_BYTES)
    try:
        version = json.loads(data or b"{}").get("header", {}).get("version", 0)
    except (ValueError, AttributeError):
        return 0
    return version if isinstance(version, int) and 0 <= version < INT64_MAX else 0
