"""Where blob bytes live: :class:`CatalogBlobs`, the bytes of the ``blobs`` catalog's rows.

Every blob has a row in the ``blobs`` table (sha256, size, created_at) on every backend: the catalog
that plan records reference by foreign key and that :mod:`.retention` collects. Its bytes live in the
blob store that ``PLANCACHE_BLOB_STORE`` names:

- ``database`` (default, :class:`DatabaseBlobs`): the catalog row's ``data`` column.
- ``file:///path`` (:class:`ContentBlobs` over :class:`plancache.blobs.FolderBlobs`): one file per blob,
  ``path/ab/cd/<sha256>``, in a local folder or a volume every replica mounts (atomic, fsynced, hashed on every
  read, so a damaged or swapped file is never served and the next publish replaces it).
- ``s3://bucket/prefix`` (also ``gs://``, ``az://``; :class:`ContentBlobs` over
  :class:`plancache.blobs.ObjectStoreBlobs`): one object per blob, ``prefix/ab/cd/<sha256>``, hashed on
  every read; credentials and endpoint from the ``AWS_*`` variables (docs/DEPLOYMENT.md).

A catalog row whose bytes are elsewhere holds empty ``data`` (a blob is never empty). Not NULL:
SQLite cannot drop the column's NOT NULL without rebuilding ``blobs``, which the foreign key from
``plans`` forbids inside the migration's transaction.

Ordering, the same on both backends, so that no record ever points at a missing blob:

1. Upload (``PUT /v1/blobs``, and the first step of an inline publish to a folder or bucket,
   :func:`~.content.write_blob`): insert the catalog row, or set its ``created_at`` to now when it exists, and
   commit; then write the bytes (:meth:`plancache.blobs.BlobStore.put`, digest checked while writing) with no
   database transaction open. The database backend writes row and bytes in one transaction instead.
2. Publish: check that the bytes are stored with the record's size (before the transaction: no file or network
   I/O under the database's write lock), then, in one write transaction, UPDATE the catalog row (it must exist with
   that size, else the publish is refused: gc took it meanwhile) and insert the record, then commit. An inline
   publish to the database backend inserts the row and writes its bytes in this transaction.
3. GC, in one write transaction holding the catalog against writers (Postgres: ``SHARE ROW
   EXCLUSIVE`` on ``blobs``; SQLite has one writer anyway): delete the catalog rows no record
   references and older than the grace period (the DELETE re-checks, the foreign key backs it), then their
   bytes, then commit.

Step 2's UPDATE takes ``ROW EXCLUSIVE`` on ``blobs`` and the row's lock. So a publish either found the row
before gc took its lock (then gc waits, and its DELETE finds the row referenced and leaves it), or finds it gone
after gc committed and is refused; it never commits a record whose row gc deleted. Step 1 makes an uploaded
blob's row younger than the grace period, so gc leaves it to the record that follows it (an upload that finds the
bytes present makes the row new before gc could take them). What remains: gc deleting files and then failing
before its commit, between a publish's presence check and its transaction; its rows stay, and the next upload of
those bytes writes them again. A failed publish leaves the uploaded blob unreferenced; gc collects it after the
grace period.

Gc also collects what crashes leave: in a folder (:meth:`plancache.blobs.FolderBlobs.files_older_than` lists it)
temporary files of a writer that died before its rename, and in a folder or bucket
(:meth:`plancache.blobs.ObjectStoreBlobs.objects_older_than` lists a page at a time) blob files or objects no
catalog row names (a publish that crashed between its put and its commit). Both go once older than the grace
period, the latter under the same lock, so a publish that meanwhile inserted a row for those bytes keeps them
(:mod:`.retention`).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..blobs import BlobStore, BlobStream, FolderBlobs, blob_url_kind, open_blobs
from ..errors import BlobStoreMismatch, IntegrityError
from .db import Database, lock_against_writers
from .models import blobs, plans

# The catalog row holds the bytes (database backend) rather than naming bytes kept elsewhere.
_IN_ROW = sa.func.length(blobs.c.data) > 0


def _check(sha256: str, data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise IntegrityError(f"blob bytes hash to {digest}, not {sha256}")


class CatalogBlobs(ABC):
    """The bytes of the catalog's blobs, by sha256. Each call takes the caller's transaction on the store's database: the
    database backend works in it, the file backend needs none. :meth:`put` expects the catalog row."""

    url: str

    @abstractmethod
    def put(self, conn: Connection, sha256: str, data: bytes) -> None:
        """Store ``data`` under ``sha256`` (:class:`IntegrityError` if it hashes otherwise); idempotent."""

    @abstractmethod
    def get(self, conn: Connection, sha256: str) -> bytes | None: ...

    @abstractmethod
    def size(self, conn: Connection, sha256: str) -> int | None: ...

    @abstractmethod
    def delete(self, conn: Connection, sha256: str) -> None:
        """Drop the bytes (not the catalog row); nothing to do when absent."""

    def delete_many(self, conn: Connection, digests: list[str]) -> None:
        """:meth:`delete` each of ``digests``; a backend with a bulk delete (a bucket) makes few requests."""
        for sha256 in digests:
            self.delete(conn, sha256)

    def has(self, conn: Connection, sha256: str) -> bool:
        return self.size(conn, sha256) is not None

    def get_up_to(self, conn: Connection, sha256: str, limit: int) -> tuple[int, bytes | None] | None:
        """``(size, bytes)``, the bytes None (not read) when over ``limit``; None when absent."""
        size = self.size(conn, sha256)
        return None if size is None else (size, self.get(conn, sha256) if size <= limit else None)

    def get_many(self, conn: Connection, digests: Collection[str]) -> dict[str, bytes]:
        """The stored bytes of ``digests`` (absent ones left out)."""
        return {d: data for d in digests if (data := self.get(conn, d)) is not None}

    def open(self, sha256: str) -> BlobStream | None:
        """The bytes as a checked stream (:class:`plancache.blobs.BlobStream`), for streaming a large blob; None when
        absent or kept in the database (read those with :meth:`get`)."""
        return None


class DatabaseBlobs(CatalogBlobs):
    """Bytes in the catalog row's ``data`` column."""

    url = "database"

    def put(self, conn: Connection, sha256: str, data: bytes) -> None:
        _check(sha256, data)
        conn.execute(sa.update(blobs).where(blobs.c.sha256 == sha256, ~_IN_ROW).values(data=data))

    def get(self, conn: Connection, sha256: str) -> bytes | None:
        data = conn.execute(sa.select(blobs.c.data).where(blobs.c.sha256 == sha256, _IN_ROW)).scalar()
        return None if data is None else bytes(data)

    def get_many(self, conn: Connection, digests: Collection[str]) -> dict[str, bytes]:
        if not digests:
            return {}
        rows = conn.execute(sa.select(blobs.c.sha256, blobs.c.data).where(blobs.c.sha256.in_(digests), _IN_ROW))
        return {sha256: bytes(data) for sha256, data in rows}

    def size(self, conn: Connection, sha256: str) -> int | None:
        return conn.execute(sa.select(blobs.c.size).where(blobs.c.sha256 == sha256, _IN_ROW)).scalar()

    def get_up_to(self, conn: Connection, sha256: str, limit: int) -> tuple[int, bytes | None] | None:
        row = conn.execute(sa.select(blobs.c.size, sa.case((blobs.c.size <= limit, blobs.c.data)))
                           .where(blobs.c.sha256 == sha256, _IN_ROW)).first()
        return None if row is None else (row[0], None if row[1] is None else bytes(row[1]))

    def delete(self, conn: Connection, sha256: str) -> None:
        conn.execute(sa.update(blobs).where(blobs.c.sha256 == sha256).values(data=b""))


class ContentBlobs(CatalogBlobs):
    """Bytes in a store of :mod:`plancache.blobs` (a folder, object storage); the connection is not used."""

    def __init__(self, content: BlobStore) -> None:
        self.content = content
        self.url = content.url

    def put(self, conn: Connection, sha256: str, data: bytes) -> None:
        self.content.put(sha256, data)

    def get(self, conn: Connection, sha256: str) -> bytes | None:
        return self.content.get(sha256)

    def size(self, conn: Connection, sha256: str) -> int | None:
        return self.content.size(sha256)

    def delete(self, conn: Connection, sha256: str) -> None:
        self.content.delete(sha256)

    def delete_many(self, conn: Connection, digests: list[str]) -> None:
        self.content.delete_many(digests)

    def open(self, sha256: str) -> BlobStream | None:
        return self.content.open(sha256)

    @property
    def folder(self) -> FolderBlobs | None:
        """The folder holding the bytes, None when they are in object storage."""
        return self.content if isinstance(self.content, FolderBlobs) else None


def check_blob_store_url(url: str) -> None:
    """ValueError naming the problem unless ``url`` is a ``PLANCACHE_BLOB_STORE`` value: ``database``, a folder
    (``file:///absolute/path``) or object storage (``s3://bucket/prefix``, ``gs://``, ``az://``). Nothing is touched."""
    if url == "database":
        return
    try:
        kind = blob_url_kind(url)
    except ValueError as exc:
        raise ValueError(f"{exc}; a server's blob store is 'database', file:///absolute/path or s3://bucket/prefix"
                         ) from None
    if kind not in ("file", "object"):
        raise ValueError(f"blob store {url!r}: a server keeps blobs durably and writes them: use 'database', "
                         "file:///absolute/path or s3://bucket/prefix")


def open_blob_store(url: str) -> CatalogBlobs:
    """The blob store a ``PLANCACHE_BLOB_STORE`` value names (:func:`check_blob_store_url`)."""
    check_blob_store_url(url)
    if url == "database":
        return DatabaseBlobs()
    return ContentBlobs(open_blobs(url))


def check_blob_store(db: Database, blob_store: CatalogBlobs) -> None:
    """Refuse a blob store of the wrong kind: one catalog row tells whether the database's blobs are in it
    (:func:`migrate_blobs` moves them all in one transaction). Only the database is read, so a command that needs
    no blob works while a bucket is unreachable; :func:`probe_blob_store` asks the blob store itself."""
    with db.read() as conn:
        # whether any row holds bytes (a migration into the database leaves empty the rows whose bytes the source
        # lacked: the first row alone could be one of those); None when there are no rows at all
        any_bytes, any_row = conn.execute(sa.select(sa.exists().where(_IN_ROW), sa.exists().select_from(blobs))).one()
    in_rows = bool(any_bytes) if any_row else None
    where = db.url.render_as_string(hide_password=True)
    if in_rows is not None and bool(in_rows) != isinstance(blob_store, DatabaseBlobs):
        if in_rows:
            raise BlobStoreMismatch(f"the blobs of {where} are in the database, not in {blob_store.url}: move them "
                                    f"with `plancache db migrate-blobs {blob_store.url}` first")
        raise BlobStoreMismatch(f"the blobs of {where} are not in the database: set PLANCACHE_BLOB_STORE to the "
                                "file:// or s3:// store holding them")


def probe_blob_store(db: Database, blob_store: CatalogBlobs, sha256: str | None = None) -> str | None:
    """What is wrong with the blob store, None when nothing seen: whether it holds ``sha256``, by default one blob
    a plan record references (the right folder mounted, the right bucket), and can be reached. Never raises for
    the blob store: a server starting during an outage reports it and serves what needs no blob."""
    with db.read() as conn:
        referenced = sha256 or conn.execute(sa.select(plans.c.blob_sha256).limit(1)).scalar()
        if referenced is None:
            return None
        try:
            present = blob_store.has(conn, referenced)
        except OSError as exc:
            return f"{blob_store.url} cannot be read now ({exc})"
    if not present:
        where = db.url.render_as_string(hide_password=True)
        return (f"{blob_store.url} lacks blob {referenced}, which {where} holds: is it the right folder (the volume "
                "mounted) or bucket?")
    return None


class Migration(NamedTuple):
    """What :func:`migrate_blobs` did: blobs copied, their bytes, catalog rows whose bytes the source lacked, and
    the last blob copied (None: none was)."""

    moved: int
    size: int
    missing: int
    last_copied: str | None = None


def migrate_blobs(db: Database, source: CatalogBlobs, target: CatalogBlobs, *, batch: int = 100) -> Migration:
    """Copy the bytes of every blob in the catalog from ``source`` (where they are now) to ``target`` (any two of
    the database, a folder, object storage), each checked against its digest on the way.

    One transaction holding off writers: every copy is durable before the catalog says the bytes left the database
    (rows emptied) or came into it (rows filled), and either all rows change or none (run it again after a failure:
    copies already there are kept). Bytes in a folder or bucket left behind are not deleted.
    """
    if source.url == target.url:
        raise ValueError(f"the blobs are in {source.url} already")
    copied = Migration(0, 0, 0)
    last = ""
    with db.write() as conn:
        lock_against_writers(conn, blobs)
        page = sa.select(blobs.c.sha256).order_by(blobs.c.sha256).limit(batch)
        if isinstance(source, DatabaseBlobs):
            page = page.where(_IN_ROW)
        while rows := conn.execute(page.where(blobs.c.sha256 > last)).scalars().all():
            for sha256 in rows:
                data = source.get(conn, sha256)
                if data is None:
                    copied = copied._replace(missing=copied.missing + 1)
                    continue
                target.put(conn, sha256, data)
                copied = copied._replace(moved=copied.moved + 1, size=copied.size + len(data), last_copied=sha256)
            last = rows[-1]
        if isinstance(source, DatabaseBlobs):
            conn.execute(sa.update(blobs).where(_IN_ROW).values(data=b""))
    return copied
