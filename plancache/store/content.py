"""Content-addressed rows: specs (graph key → canonical spec) and blobs (sha256 → bytes, via :mod:`.blobs`)."""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import errors
from ..blobs.base import CHUNK_BYTES, Data, check_name, chunks
from ..canonical import canonical_json
from ..spec import GraphSpec, parse_spec
from ..spec import graph_key as compute_graph_key
from .blobs import CatalogBlobs, ContentBlobs
from .db import Database, upsert_insert
from .models import blobs, specs


def insert_blob_row(conn: Connection, sha256: str, size: int, now: Any) -> None:
    """Insert a blob's catalog row, without its bytes (:mod:`.blobs`), unless one exists (safe against
    concurrent inserts). It locks the catalog against gc: write the bytes after it, in the same transaction."""
    conn.execute(
        upsert_insert(conn, blobs)
        .values(sha256=sha256, size=size, data=b"", created_at=now)
        .on_conflict_do_nothing(index_elements=["sha256"])
    )


def touch_blob_row(conn: Connection, sha256: str, size: int, now: Any) -> None:
    """Insert a blob's catalog row, or make the one there as new as ``now`` (committed before the bytes are written:
    gc spares an unreferenced row younger than its grace period, so the upload's publish finds it)."""
    stmt = upsert_insert(conn, blobs).values(sha256=sha256, size=size, data=b"", created_at=now)
    conn.execute(stmt.on_conflict_do_update(index_elements=["sha256"], set_={"created_at": now}))


def settle_blob_size(conn: Connection, sha256: str, size: int) -> None:
    """After the bytes of ``sha256`` were written and checked: its catalog row says their size. A failed upload that
    declared another size may have made the row, and an upload that finds a row only makes it new."""
    conn.execute(sa.update(blobs).where(blobs.c.sha256 == sha256, blobs.c.size != size).values(size=size))


def hold_blob_row(conn: Connection, sha256: str, size: int, in_row: bool, now: Any) -> bool:
    """In a publish's transaction: whether the catalog row of ``sha256`` exists with ``size`` (and, ``in_row``, its
    bytes), updating it so that it is locked against gc (``ROW EXCLUSIVE``, as :func:`insert_blob_row` takes)."""
    where = [blobs.c.sha256 == sha256, blobs.c.size == size]
    if in_row:
        where.append(sa.func.length(blobs.c.data) > 0)
    return conn.execute(sa.update(blobs).where(*where).values(created_at=now)).rowcount == 1


class _Sized(io.RawIOBase):
    """``data`` read as a stream; :class:`errors.IntegrityError` as soon as it runs past ``size`` bytes, or at its
    end when it is shorter."""

    def __init__(self, data: Data, size: int) -> None:
        self._pieces, self._pending, self._size, self._seen = chunks(data), b"", size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._pending:
            self._pending = next(self._pieces, b"")
            self._seen += len(self._pending)
            if self._seen > self._size:
                raise errors.IntegrityError(f"the blob has more than the {self._size} bytes declared")
            if not self._pending and self._seen != self._size:
                raise errors.IntegrityError(f"the blob has {self._seen} bytes, not the {self._size} declared")
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _sized(data: Data, size: int) -> io.BufferedReader:
    return io.BufferedReader(_Sized(data, size), CHUNK_BYTES)


def write_blob(db: Database, blob_store: CatalogBlobs, sha256: str, size: int, data: Data) -> bool:
    """Store the blob ``sha256`` of ``size`` bytes streamed from ``data`` (bytes or a binary stream), its digest
    and size checked while it is written (:class:`errors.IntegrityError`, nothing stored, when they differ); True
    when it was not there before.

    No database transaction is open while a folder or object store writes the bytes (:mod:`.blobs`): the
    catalog row is inserted, or made new, and committed first (:func:`touch_blob_row`), then the bytes are
    written. A row whose bytes never came is unreferenced and goes with ``plans gc`` after its grace. The
    database backend reads the bytes whole and writes them with their row."""
    check_name(sha256)
    with db.read() as conn:
        present = blob_store.size(conn, sha256) is not None
    if isinstance(blob_store, ContentBlobs):
        with db.write() as conn:
            touch_blob_row(conn, sha256, size, db.now(conn))
        blob_store.content.put(sha256, _sized(data, size))
        with db.write() as conn:
            settle_blob_size(conn, sha256, size)
        return not present
    whole = _sized(data, size).read()
    with db.write() as conn:
        touch_blob_row(conn, sha256, size, db.now(conn))
        blob_store.put(conn, sha256, whole)
        settle_blob_size(conn, sha256, size)
    return not present


def spec_exists(conn: Connection, graph_key: str) -> bool:
    return conn.execute(sa.select(sa.literal(1)).where(specs.c.graph_key == graph_key)).first() is not None


class SpecsAndBlobs:
    db: Database
    blob_store: CatalogBlobs

    def put_spec(self, graph_key: str, spec: GraphSpec | dict[str, Any]) -> bool:
        """Store a spec under its graph key; True if newly stored.

        The spec is validated and its key recomputed (:class:`errors.IntegrityError` if it differs);
        what is stored is its canonical document (canonical uids: what workers build). A spec whose
        canonical form differs from the one stored under the key is :class:`errors.Conflict`.
        """
        parsed = parse_spec(spec)
        actual = compute_graph_key(parsed, fresh=True)
        if actual != graph_key:
            raise errors.IntegrityError(f"graph key {graph_key!r} does not match the spec, whose key is {actual}")
        document = canonical_json(parsed.canonical_document().to_json())
        with self.db.write() as conn:
            inserted = conn.execute(
                upsert_insert(conn, specs)
                .values(graph_key=graph_key, canonical_json=document, created_at=self.db.now())
                .on_conflict_do_nothing(index_elements=["graph_key"])
                .returning(specs.c.graph_key)
            ).first()
            if inserted is not None:
                return True
            stored = conn.execute(sa.select(specs.c.canonical_json).where(specs.c.graph_key == graph_key)).scalar_one()
        try:
            same = parse_spec(stored).canonical_json() == parsed.canonical_json()
        except errors.SpecError:
            same = False  # stored by a version that wrote another format
        if not same:
            raise errors.Conflict(f"graph key {graph_key} is already stored with a different canonical spec")
        return False

    def get_spec(self, graph_key: str) -> dict[str, Any] | None:
        """The canonical document stored under ``graph_key`` (parseable by :func:`plancache.spec.parse_spec`)."""
        with self.db.read() as conn:
            text = conn.execute(sa.select(specs.c.canonical_json).where(specs.c.graph_key == graph_key)).scalar()
        return None if text is None else json.loads(text)

    def put_blob(self, data: bytes) -> str:
        """Store bytes if absent; return their sha256 hex digest."""
        if not data:
            raise errors.IntegrityError("a blob cannot be empty")
        digest = hashlib.sha256(data).hexdigest()
        with self.db.write() as conn:
            insert_blob_row(conn, digest, len(data), self.db.now())
            self.blob_store.put(conn, digest, data)
        return digest

    def store_blob(self, sha256: str, size: int, data: Data) -> bool:
        """:func:`write_blob` into this store."""
        return write_blob(self.db, self.blob_store, sha256, size, data)

    def get_blob(self, sha256: str) -> bytes | None:
        with self.db.query() as conn:
            return self.blob_store.get(conn, sha256)

    def blob_size(self, sha256: str) -> int | None:
        with self.db.query() as conn:
            return self.blob_store.size(conn, sha256)

    def get_blob_up_to(self, sha256: str, limit: int) -> tuple[int, bytes | None] | None:
        """:meth:`CatalogBlobs.get_up_to`: a blob's size and, unless over ``limit`` bytes, its bytes (one query)."""
        with self.db.query() as conn:
            return self.blob_store.get_up_to(conn, sha256, limit)
