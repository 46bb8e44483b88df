"""Retention: drop plan records of environments no longer in use, then blobs that no record references.

:func:`gc` runs two steps, one transaction each:

1. with ``keep_env_ids``, delete the plan records whose environment is not among them;
2. delete the blobs that no plan record references and that were stored longer than ``grace`` ago:
   their catalog rows, then their bytes in the blob store (:mod:`.blobs`), before the commit;
3. delete what crashes left in a folder or a bucket that is older than ``grace``: a folder's temporary files of
   writers, and blob files or objects that no catalog row names (those under the lock of step 2, in a transaction
   of their own; a bucket is listed and swept a page of objects at a time).

With a bucket that cannot be listed now (down, frozen), step 1 still runs; steps 2 and 3 are skipped (a dry run
still counts step 2 from the catalog) and the report says why: a blob's row and its bytes go together or not at all.

A blob still referenced is never deleted, and a publish running at the same time neither fails nor
loses its blob. The DELETE re-checks that no record points at a blob, and the foreign key from
``plans.blob_sha256`` to ``blobs`` makes the database refuse to delete a blob a record points at. On
Postgres each step also locks its table against writers (``SHARE ROW EXCLUSIVE``: reads go on): a
publish finds an existing blob or record with ``ON CONFLICT DO NOTHING``, which takes no row lock, so
without the table lock gc could delete that blob or record between the publish's check and its insert
of the record. With it, a step waits for publishes already writing that table to commit, and later
publishes wait for the step (blob uploads pause for as long as the step runs, file deletions
included). SQLite serialises all writers anyway. :mod:`.blobs` explains why a file store's bytes are
safe too. The grace period keeps a blob stored moments ago by an upload whose record is still on its way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..blobs import ObjectStoreBlobs
from ..blobs.folder import StoredFile
from ..errors import BlobStoreUnavailable
from .blobs import ContentBlobs
from .db import lock_against_writers
from .models import blobs, plans

if TYPE_CHECKING:
    from . import Store

#: Unreferenced blobs deleted per transaction (and per request to a bucket: S3 deletes at most 1,000 at a time).
GC_BATCH = 500


@dataclass(frozen=True)
class GcReport:
    """What :func:`gc` deleted (or, with ``dry_run``, would delete)."""

    dry_run: bool
    records_deleted: int
    records_by_env: dict[str, int] = field(default_factory=dict)
    blobs_deleted: int = 0
    blob_bytes_freed: int = 0
    temporaries_deleted: int = 0  # a file blob store's files of crashed writers
    orphans_deleted: int = 0  # a folder's blob files or a bucket's objects that no catalog row names
    leftover_bytes_freed: int = 0  # by those two
    #: Why the bucket's steps were skipped (it could not be listed), or None when they ran.
    bucket_unavailable: str | None = None


def _check_keep(store: Store, keep_env_ids: set[str]) -> None:
    """Refuse an empty keep set (it would delete every record) and ids that no record has (a typo would too)."""
    if not keep_env_ids:
        raise ValueError("keep_env_ids is empty: that would delete every plan record (pass None to keep them all)")
    with store.db.read() as conn:
        known = set(conn.execute(sa.select(plans.c.env_id).where(plans.c.env_id.in_(keep_env_ids)).distinct()).scalars())
    unknown = sorted(keep_env_ids - known)
    if unknown:
        raise ValueError(f"no plan records have environment id {', '.join(unknown)}: refusing to treat every other "
                         "environment as unused (check the ids with `plancache plans list`)")


def _unreferenced(cutoff: Any, surviving_records: Any = None) -> list[Any]:
    """WHERE clauses on ``blobs``: older than ``cutoff`` and referenced by no (surviving) record."""
    referenced = sa.exists().where(plans.c.blob_sha256 == blobs.c.sha256)
    if surviving_records is not None:
        referenced = referenced.where(surviving_records)
    return [blobs.c.created_at < cutoff, ~referenced]


def gc(store: Store, *, grace: timedelta, keep_env_ids: set[str] | None = None, dry_run: bool = False) -> GcReport:
    """Delete records of environments outside ``keep_env_ids`` (when given), then blobs no record references
    that are older than ``grace``. With ``dry_run`` nothing is deleted and the report says what would be."""
    if grace < timedelta(0):
        raise ValueError(f"the grace period cannot be negative ({grace})")
    if keep_env_ids is not None:
        _check_keep(store, keep_env_ids)
    doomed_records = None if keep_env_ids is None else plans.c.env_id.not_in(keep_env_ids)
    by_env: dict[str, int] = {}
    if doomed_records is not None:
        if dry_run:
            with store.db.read() as conn:
                count_by_env = sa.select(plans.c.env_id, sa.func.count()).where(doomed_records).group_by(plans.c.env_id)
                by_env = {env_id: n for env_id, n in conn.execute(count_by_env)}
        else:
            with store.db.write() as conn:
                lock_against_writers(conn, plans)
                for env_id in conn.execute(sa.delete(plans).where(doomed_records).returning(plans.c.env_id)).scalars():
                    by_env[env_id] = by_env.get(env_id, 0) + 1
    cutoff = store.db.now() - grace
    bucket = _bucket(store)
    unavailable = None
    if bucket is not None:
        try:
            bucket.check_listable()
        except BlobStoreUnavailable as exc:
            unavailable = str(exc)
    n = size = 0
    orphan_objects = object_bytes = 0
    if dry_run:
        surviving = None if doomed_records is None else sa.not_(doomed_records)
        with store.db.read() as conn:
            n, size = conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(blobs.c.size), 0))
                .where(*_unreferenced(cutoff, surviving))
            ).one()
    elif unavailable is None:
        try:
            n, size = _delete_blobs(store, cutoff)
        except BlobStoreUnavailable as exc:  # the bucket went down meanwhile: that batch was rolled back
            unavailable = str(exc)
    if not dry_run and (by_env or n):
        store.analyze()  # a bulk change
    temporaries, orphans = _leftover_files(store, cutoff, dry_run=dry_run)
    if bucket is not None and unavailable is None:
        try:
            orphan_objects, object_bytes = _leftover_objects(store, bucket, cutoff, dry_run=dry_run)
        except BlobStoreUnavailable as exc:  # the pages swept before it stay swept
            unavailable = str(exc)
    return GcReport(dry_run=dry_run, records_deleted=sum(by_env.values()), records_by_env=by_env,
                    blobs_deleted=int(n), blob_bytes_freed=int(size), temporaries_deleted=len(temporaries),
                    orphans_deleted=len(orphans) + orphan_objects,
                    leftover_bytes_freed=sum(f.size for f in temporaries + orphans) + object_bytes,
                    bucket_unavailable=unavailable)


def _bucket(store: Store) -> ObjectStoreBlobs | None:
    """The object store holding ``store``'s blob bytes, if they are in one."""
    if isinstance(store.blob_store, ContentBlobs) and isinstance(store.blob_store.content, ObjectStoreBlobs):
        return store.blob_store.content
    return None


def _leftover_files(store: Store, cutoff: Any, *, dry_run: bool) -> tuple[list[StoredFile], list[StoredFile]]:
    """On a file blob store, delete the temporary files and the blob files without a catalog row that were last
    modified before ``cutoff``; the files deleted (with ``dry_run``: those that would be). The folder is listed
    first; the rows are looked up and the files deleted holding the catalog against writers, so a publish that
    inserted a row for an old file's bytes meanwhile (and found them present) keeps them."""
    folder = store.blob_store.folder if isinstance(store.blob_store, ContentBlobs) else None
    if folder is None:
        return [], []
    old = list(folder.files_older_than(cutoff.timestamp()))
    temporaries = [f for f in old if f.temporary]  # no row ever names one; a live writer's is younger
    candidates = {f.sha256: f for f in old if not f.temporary}
    with store.db.read() if dry_run else store.db.write() as conn:
        if not dry_run:
            lock_against_writers(conn, blobs)
        named = named_blobs(conn, list(candidates))
        orphans = [f for sha256, f in candidates.items() if sha256 not in named]
        if not dry_run:
            for f in temporaries + orphans:
                f.path.unlink(missing_ok=True)
    return temporaries, orphans


def _leftover_objects(store: Store, bucket: ObjectStoreBlobs, cutoff: Any, *, dry_run: bool) -> tuple[int, int]:
    """In ``bucket``, delete the blob objects without a catalog row last modified before ``cutoff``;
    how many were deleted (with ``dry_run``: would be) and their bytes. The bucket is listed a page at a time; each
    page's rows are looked up and its orphans deleted in a transaction of its own holding the catalog against
    writers, so a publish that inserted a row for an old object's bytes meanwhile keeps them, and memory and the
    lock's time stay bounded however many objects there are."""
    count = size = 0
    for page in bucket.objects_older_than(cutoff):
        with store.db.read() if dry_run else store.db.write() as conn:
            if not dry_run:
                lock_against_writers(conn, blobs)
            named = named_blobs(conn, [o.sha256 for o in page])
            orphans = [o for o in page if o.sha256 not in named]
            if not dry_run and orphans:
                bucket.delete_many([o.sha256 for o in orphans])
        count, size = count + len(orphans), size + sum(o.size for o in orphans)
    return count, size


def named_blobs(conn: Any, digests: list[str]) -> set[str]:
    """Those of ``digests`` that have a catalog row (looked up 500 at a time)."""
    named = set[str]()
    for start in range(0, len(digests), 500):
        batch = digests[start:start + 500]
        named.update(conn.execute(sa.select(blobs.c.sha256).where(blobs.c.sha256.in_(batch))).scalars())
    return named


def _delete_blobs(store: Store, cutoff: Any) -> tuple[int, int]:
    """Delete unreferenced blobs older than ``cutoff``, :data:`GC_BATCH` at a time, each batch in one transaction:
    catalog rows first, then bytes (under the lock, so no publish can meanwhile find them present; a bucket's in one
    request per batch); the count and bytes freed. One transaction for them all held every upload and publish (on
    SQLite every write) for as long as one DELETE request per object took: 14,000 blobs on a local S3 server, 35 s,
    and a server's write then failed with 'database is locked' after SQLite's 30 s busy timeout."""
    count = size = 0
    while True:
        with store.db.write() as conn:
            lock_against_writers(conn, blobs)
            batch = conn.execute(sa.select(blobs.c.sha256).where(*_unreferenced(cutoff)).order_by(blobs.c.sha256)
                                 .limit(GC_BATCH)).scalars().all()
            doomed = conn.execute(sa.delete(blobs).where(blobs.c.sha256.in_(batch), *_unreferenced(cutoff))
                                  .returning(blobs.c.sha256, blobs.c.size)).all() if batch else []
            # (the database blob store's bytes went with their rows)
            store.blob_store.delete_many(conn, [sha256 for sha256, _ in doomed])
        count, size = count + len(doomed), size + sum(s for _, s in doomed)
        if len(batch) < GC_BATCH:
            return count, size
