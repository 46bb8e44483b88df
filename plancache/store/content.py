"""Content-addressed rows: specs (graph key → canonical spec) and blobs (sha256 → bytes)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import errors
from ..spec import graph_key as compute_graph_key
from ..spec import canonical_json, parse_spec
from .db import Database, upsert_insert
from .models import blobs, specs


def insert_blob(conn: Connection, data: bytes, sha256: str, now: Any) -> None:
    """Insert a blob unless a row with this digest exists (safe against concurrent inserts)."""
    conn.execute(
        upsert_insert(conn, blobs)
        .values(sha256=sha256, size=len(data), data=data, created_at=now)
        .on_conflict_do_nothing(index_elements=["sha256"])
    )


def spec_exists(conn: Connection, graph_key: str) -> bool:
    return conn.execute(sa.select(sa.literal(1)).where(specs.c.graph_key == graph_key)).first() is not None


class SpecsAndBlobs:
    db: Database

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
            insert_blob(conn, data, digest, self.db.now())
        return digest

    def get_blob(self, sha256: str) -> bytes | None:
        with self.db.read() as conn:
            data = conn.execute(sa.select(blobs.c.data).where(blobs.c.sha256 == sha256)).scalar()
        return None if data is None else bytes(data)

    def blob_size(self, sha256: str) -> int | None:
        with self.db.read() as conn:
            return conn.execute(sa.select(blobs.c.size).where(blobs.c.sha256 == sha256)).scalar()
