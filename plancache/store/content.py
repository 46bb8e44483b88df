"""Content-addressed rows: specs (graph key → canonical spec) and blobs (sha256 → bytes, via :mod:`.blobs`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import errors
from ..canonical import canonical_json
from ..spec import graph_key as compute_graph_key
from ..spec import parse_spec
from .blobs import BlobStore
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


def spec_exists(conn: Connection, graph_key: str) -> bool:
    return conn.execute(sa.select(sa.literal(1)).where(specs.c.graph_key == graph_key)).first() is not None


class SpecsAndBlobs:
    db: Database
    blob_store: BlobStore

    def put_spec(self, graph_key: str, spec: dict[str, Any]) -> bool:
        """Store a spec under its graph key; True if newly stored.

        The spec is validated and its key recomputed (:class:`errors.IntegrityError` if it differs);
        what is stored is its canonical document (canonical uids: what workers build). A spec whose
        canonical form differs from the one stored under the key is :class:`errors.Conflict`.
        """
        parsed = parse_spec(spec)
        actual = compute_graph_key(parsed)
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

    def get_blob(self, sha256: str) -> bytes | None:
        with self.db.read() as conn:
            return self.blob_store.get(conn, sha256)

    def blob_size(self, sha256: str) -> int | None:
        with self.db.read() as conn:
            return self.blob_store.size(conn, sha256)
