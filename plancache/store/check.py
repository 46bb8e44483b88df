"""Consistency of the database with its blob store, for ``plancache db check`` (after a restore, before trusting a
backup): records whose blob is missing or whose bytes do not match, and blobs no record names.

:func:`check` reads; it changes nothing. Records are read :data:`BATCH` at a time (by id) and each blob is read as
a stream, so memory stays bounded whatever the store holds. Each problem is handed to ``report`` as it is found:

- ``missing``: a record's blob has no bytes in the blob store (a bucket restored to an earlier point than the
  database, or the wrong ``PLANCACHE_BLOB_STORE``);
- ``mismatch``: its bytes are there but are not the record's (another size, or they hash to another digest);
- ``unnamed``: a catalog row no record names (``plans gc`` deletes it after its grace), or a file or object of the
  folder or bucket that no catalog row names (a database restored to an earlier point than the bucket).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

import sqlalchemy as sa

from ..blobs import ObjectStoreBlobs
from ..errors import IntegrityError
from .blobs import ContentBlobs
from .models import blobs, plans

if TYPE_CHECKING:
    from . import Store

#: Records (and listed files or objects) looked at per transaction.
BATCH = 500

ProblemKind = Literal["missing", "mismatch", "unnamed"]


@dataclass(frozen=True)
class Problem:
    """One inconsistency: its kind, the blob's sha256, what names it (a record's graph key and environment id, or
    where an unnamed blob is) and what was found."""

    kind: ProblemKind
    sha256: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind:8} {self.sha256} {self.where}: {self.detail}"


@dataclass
class CheckReport:
    """What :func:`check` looked at and the problems of each kind."""

    records: int = 0
    blobs: int = 0
    problems: dict[str, int] = field(default_factory=lambda: {"missing": 0, "mismatch": 0, "unnamed": 0})

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())


def check(store: Store, report: Callable[[Problem], None], *, read_bytes: bool = True) -> CheckReport:
    """Every record's blob (present, of the record's size and, with ``read_bytes``, hashing to its name), then every
    blob no record names; each problem to ``report``."""
    out = CheckReport()

    def found(problem: Problem) -> None:
        out.problems[problem.kind] += 1
        report(problem)

    seen: set[str] = set()  # blobs already read this run (a blob shared by records is read once)
    for batch in _records(store):
        for graph_key, env_id, sha256, size in batch:
            out.records += 1
            where = f"record {graph_key} on {env_id}"
            if sha256 in seen:
                continue
            seen.add(sha256)
            out.blobs += 1
            detail = _blob_problem(store, sha256, size, read_bytes)
            if detail is not None:
                found(Problem("missing" if detail.startswith("no bytes") else "mismatch", sha256, where, detail))
    with store.db.read() as conn:
        for sha256 in conn.execute(sa.select(blobs.c.sha256).where(
                ~sa.exists().where(plans.c.blob_sha256 == blobs.c.sha256)).order_by(blobs.c.sha256)).scalars():
            found(Problem("unnamed", sha256, "catalog", "a catalog row no record names (`plans gc` deletes it)"))
    for sha256, where in _uncatalogued(store):
        found(Problem("unnamed", sha256, where, "bytes no catalog row names"))
    return out


def _records(store: Store) -> Iterator[list[tuple[str, str, str, int]]]:
    """(graph key, environment id, blob sha256, blob size) of every record, :data:`BATCH` at a time by id."""
    last = 0
    while True:
        with store.db.read() as conn:
            rows = conn.execute(sa.select(plans.c.id, plans.c.graph_key, plans.c.env_id, plans.c.blob_sha256,
                                          plans.c.blob_size).where(plans.c.id > last)
                                .order_by(plans.c.id).limit(BATCH)).all()
        if not rows:
            return
        last = rows[-1].id
        yield [(r.graph_key, r.env_id, r.blob_sha256, int(r.blob_size)) for r in rows]


def _blob_problem(store: Store, sha256: str, size: int, read_bytes: bool) -> str | None:
    """What is wrong with the bytes of blob ``sha256`` that a record says are ``size`` long; None when nothing is."""
    with store.db.read() as conn:
        stored = store.blob_store.size(conn, sha256)
        if stored is None:
            return f"no bytes in {store.blob_store.url}"
        if stored != size:
            return f"{stored} bytes in {store.blob_store.url}, the record says {size}"
        if not read_bytes:
            return None
        stream = store.blob_store.open(sha256)
        if stream is None:  # the database store: bytes in the catalog row
            data = store.blob_store.get(conn, sha256) or b""
            actual = hashlib.sha256(data).hexdigest()
            return None if actual == sha256 else f"the bytes hash to {actual}"
    with stream:
        try:
            for _ in stream:
                pass
        except IntegrityError as exc:
            return exc.message
    return None


def _uncatalogued(store: Store) -> Iterator[tuple[str, str]]:
    """(sha256, where) of each blob file or object of a folder or bucket that no catalog row names."""
    from .retention import named_blobs

    blob_store = store.blob_store
    if isinstance(blob_store, ContentBlobs) and blob_store.folder is not None:
        pages: Iterator[list[str]] = _pages(f.sha256 for f in blob_store.folder.files() if not f.temporary)
    elif isinstance(blob_store, ContentBlobs) and isinstance(blob_store.content, ObjectStoreBlobs):
        listing = blob_store.content.objects_older_than(datetime.max.replace(tzinfo=UTC))  # every object
        pages = ([o.sha256 for o in page] for page in listing)
    else:
        return
    for page in pages:
        with store.db.read() as conn:
            named = named_blobs(conn, page)
        yield from ((sha256, blob_store.url) for sha256 in sorted(set(page) - named))


def _pages(digests: Iterator[str]) -> Iterator[list[str]]:
    page: list[str] = []
    for digest in digests:
        page.append(digest)
        if len(page) == BATCH:
            yield page
            page = []
    if page:
        yield page
