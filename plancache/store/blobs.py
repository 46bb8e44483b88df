"""Where blob bytes live: a content-addressed :class:`BlobStore` under the ``blobs`` catalog.

Every blob has a row in the ``blobs`` table (sha256, size, created_at) on every backend: the catalog
that plan records reference by foreign key and that :mod:`.retention` collects. Its bytes live in the
blob store that ``PLANCACHE_BLOB_STORE`` names:

- ``database`` (default, :class:`DatabaseBlobs`): the catalog row's ``data`` column.
- ``file:///path`` (:class:`FileBlobs`): one file per blob, ``path/ab/cd/<sha256>``, in a local
  folder or a volume every replica mounts. Written atomically (temp file, fsync, rename, fsync of
  the folder) after checking the bytes against the digest.

A catalog row whose bytes are elsewhere holds empty ``data`` (a blob is never empty). Not NULL:
SQLite cannot drop the column's NOT NULL without rebuilding ``blobs``, which the foreign key from
``plans`` forbids inside the migration's transaction.

Ordering, the same on both backends, so that no record ever points at a missing blob:

1. Publish, in one write transaction: insert the catalog row (``ON CONFLICT DO NOTHING``), then the
   record, then :meth:`BlobStore.put` (nothing to do when the bytes are already there), then commit.
   The bytes are durable before the record is visible. A failure rolls back row and record; at worst
   it leaves a file no row names (a crash between the put and the commit), never the reverse.
2. GC, in one write transaction holding the catalog against writers (Postgres: ``SHARE ROW
   EXCLUSIVE`` on ``blobs``; SQLite has one writer anyway): delete the catalog rows no record
   references (the DELETE re-checks, the foreign key backs it), then their bytes, then commit.

Step 1's insert takes ``ROW EXCLUSIVE`` on ``blobs`` even when the row exists, before the put looks
for the bytes. So a publish either committed before gc took its lock (then its record keeps the row
and gc leaves it), or waits until gc commits and then inserts the row again and writes bytes gc has
deleted. Gc never deletes bytes that a publish in flight found present. If gc fails after deleting
files, its rows stay (unreferenced) and the next publish of those bytes writes them again.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Collection
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import BlobStoreMismatch, IntegrityError
from ..files import atomic_write, fsync_dir
from ..protocol import SHA256_PATTERN
from .db import Database, lock_against_writers
from .models import blobs, plans

_SHA256 = re.compile(SHA256_PATTERN)
# The catalog row holds the bytes (database backend) rather than naming bytes kept elsewhere.
_IN_ROW = sa.func.length(blobs.c.data) > 0


def _check(sha256: str, data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise IntegrityError(f"blob bytes hash to {digest}, not {sha256}")


class BlobStore(ABC):
    """Blob bytes by sha256. Each call takes the caller's transaction on the store's database: the
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

    def has(self, conn: Connection, sha256: str) -> bool:
        return self.size(conn, sha256) is not None

    def get_many(self, conn: Connection, digests: Collection[str]) -> dict[str, bytes]:
        """The stored bytes of ``digests`` (absent ones left out)."""
        return {d: data for d in digests if (data := self.get(conn, d)) is not None}

    def local_file(self, sha256: str) -> Path | None:
        """The file holding the bytes, for streaming (it may be gone by now); None when not kept in files."""
        return None


class DatabaseBlobs(BlobStore):
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

    def delete(self, conn: Connection, sha256: str) -> None:
        conn.execute(sa.update(blobs).where(blobs.c.sha256 == sha256).values(data=b""))


class FileBlobs(BlobStore):
    """Bytes in files ``root/ab/cd/<sha256>``, written atomically and durably."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.url = root.as_uri()

    def _path(self, sha256: str) -> Path:
        if not _SHA256.match(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
        return self.root / sha256[:2] / sha256[2:4] / sha256

    def put(self, conn: Connection, sha256: str, data: bytes) -> None:
        _check(sha256, data)
        path = self._path(sha256)
        if self.size(conn, sha256) == len(data):  # a file only ever appears whole, by rename
            return
        for folder in (path.parent.parent, path.parent):
            if not folder.is_dir():
                folder.mkdir(exist_ok=True)
                fsync_dir(folder.parent)
        atomic_write(path, data, mode=0o644)  # readable by every replica sharing the folder

    def get(self, conn: Connection, sha256: str) -> bytes | None:
        try:
            return self._path(sha256).read_bytes()
        except FileNotFoundError:
            return None

    def size(self, conn: Connection, sha256: str) -> int | None:
        try:
            return self._path(sha256).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, conn: Connection, sha256: str) -> None:
        self._path(sha256).unlink(missing_ok=True)

    def local_file(self, sha256: str) -> Path | None:
        return self._path(sha256)


def blob_folder(url: str) -> Path | None:
    """The folder a ``PLANCACHE_BLOB_STORE`` value names (None for ``database``); ValueError for any other value.
    Nothing is touched on disk."""
    if url == "database":
        return None
    parts = urlsplit(url)
    if parts.scheme == "file" and parts.netloc in ("", "localhost") and parts.path.startswith("/") \
            and not (parts.query or parts.fragment):
        return Path(url2pathname(parts.path))
    raise ValueError(f"blob store {url!r}: use 'database' or a folder as file:///absolute/path")


def open_blob_store(url: str) -> BlobStore:
    """The blob store a ``PLANCACHE_BLOB_STORE`` value names: ``database`` or ``file:///absolute/path``."""
    folder = blob_folder(url)
    return DatabaseBlobs() if folder is None else FileBlobs(folder)


def check_blob_store(db: Database, blob_store: BlobStore) -> None:
    """Refuse a blob store that is not where the database's blobs are. One catalog row tells which kind
    (:func:`migrate_blobs` moves them all in one transaction), one referenced blob that it is the right folder."""
    with db.read() as conn:
        in_rows = conn.execute(sa.select(_IN_ROW).select_from(blobs).limit(1)).scalar()
        referenced = conn.execute(sa.select(plans.c.blob_sha256).limit(1)).scalar()
        present = referenced is None or blob_store.has(conn, referenced)
    where = db.url.render_as_string(hide_password=True)
    if in_rows is not None and bool(in_rows) != isinstance(blob_store, DatabaseBlobs):
        if in_rows:
            raise BlobStoreMismatch(f"the blobs of {where} are in the database, not in {blob_store.url}: move them "
                                    f"with `plancache db migrate-blobs {blob_store.url}` first")
        raise BlobStoreMismatch(f"the blobs of {where} are not in the database: set PLANCACHE_BLOB_STORE to the "
                                "file:// store holding them")
    if not present:
        raise BlobStoreMismatch(f"{blob_store.url} lacks blob {referenced}, which a plan record of {where} "
                                "references: is it the right folder (the volume mounted)?")


def migrate_blobs(db: Database, target: BlobStore, *, batch: int = 100) -> tuple[int, int]:
    """Move the bytes of every blob held in the database into ``target``; the count and bytes moved.

    One transaction holding off writers: every file is durable before the rows are emptied, and either
    all rows are emptied or none (run it again after a failure: files already there are kept).
    """
    if isinstance(target, DatabaseBlobs):
        raise ValueError("blobs can only be moved to a file:// store")
    moved = size = 0
    last = ""
    with db.write() as conn:
        lock_against_writers(conn, blobs)
        page = sa.select(blobs.c.sha256, blobs.c.data).where(_IN_ROW).order_by(blobs.c.sha256).limit(batch)
        while rows := conn.execute(page.where(blobs.c.sha256 > last)).all():
            for sha256, data in rows:
                target.put(conn, sha256, bytes(data))
                moved, size = moved + 1, size + len(data)
            last = rows[-1].sha256
        conn.execute(sa.update(blobs).where(_IN_ROW).values(data=b""))
    return moved, size
