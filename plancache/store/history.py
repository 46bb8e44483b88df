"""Retention of history: delete finished jobs, misses and withdrawals older than a bound, a batch per transaction.

Each kind is kept for good unless its bound is given. A finished job that a plan record names (the job that tuned it)
is kept as long as the record. Deleting a withdrawal forgets it: explain no longer hands it to clients that still hold
the withdrawn plan, and a plan of a revision at or below the withdrawn one may be published again. Deleted jobs leave
the tallies of ended jobs (``job_counts``), and table statistics are refreshed after a deletion. Who counted a
miss (``miss_callers``) is deleted once it counts no more (:data:`.misses.DISTINCT_MISS_PERIOD`), or with the misses
when their bound is shorter.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..protocol import FINISHED_JOB_STATUSES
from .jobs import tally_finished
from .misses import DISTINCT_MISS_PERIOD
from .models import jobs, miss_callers, misses, plans, withdrawals

if TYPE_CHECKING:
    from . import Store

#: Rows deleted per transaction: writers wait for a batch, not for the whole history.
HISTORY_BATCH = 5000


@dataclass(frozen=True)
class PruneReport:
    """What :func:`prune_history` deleted (or, with ``dry_run``, would delete)."""

    dry_run: bool
    jobs_deleted: int = 0
    misses_deleted: int = 0
    withdrawals_deleted: int = 0


def _check(name: str, age: timedelta | None) -> None:
    if age is not None and age <= timedelta(0):
        raise ValueError(f"{name} must be a positive age, not {age}: it would delete what was written just now")


def prune_history(store: Store, *, jobs_older_than: timedelta | None = None,
                  misses_older_than: timedelta | None = None, withdrawals_older_than: timedelta | None = None,
                  dry_run: bool = False) -> PruneReport:
    """Delete the jobs that finished, the misses last seen and the withdrawals made longer ago than each bound (None:
    keep them all); a finished job that a plan record names is kept."""
    _check("jobs_older_than", jobs_older_than)
    _check("misses_older_than", misses_older_than)
    _check("withdrawals_older_than", withdrawals_older_than)
    now = store.db.now()
    counts = {}
    if jobs_older_than is not None:
        counts["jobs"] = _prune(store, jobs, [jobs.c.id], dry_run, jobs.c.status.in_(FINISHED_JOB_STATUSES),
                                jobs.c.finished_at < now - jobs_older_than,
                                ~sa.exists().where(plans.c.job_id == jobs.c.id))
    if misses_older_than is not None:
        counts["misses"] = _prune(store, misses, [misses.c.graph_key, misses.c.env_id], dry_run,
                                  misses.c.last_seen < now - misses_older_than)
    if not dry_run:
        callers_age = min(misses_older_than or DISTINCT_MISS_PERIOD, DISTINCT_MISS_PERIOD)
        mc = miss_callers.c
        counts["miss_callers"] = _prune(store, miss_callers, [mc.env_id, mc.caller, mc.graph_key, mc.process], False,
                                        mc.counted_at < now - callers_age)
    if withdrawals_older_than is not None:
        counts["withdrawals"] = _prune(store, withdrawals, [withdrawals.c.id], dry_run,
                                       withdrawals.c.created_at < now - withdrawals_older_than)
    if not dry_run and any(counts.values()):
        store.analyze()
    return PruneReport(dry_run, jobs_deleted=counts.get("jobs", 0), misses_deleted=counts.get("misses", 0),
                       withdrawals_deleted=counts.get("withdrawals", 0))


def _prune(store: Store, table: sa.Table, key: list[Any], dry_run: bool, *where: Any) -> int:
    """Delete the rows of ``table`` matching ``where``, :data:`HISTORY_BATCH` of them (by primary ``key``) per
    transaction; how many (with ``dry_run``: counted, not deleted)."""
    if dry_run:
        with store.db.read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar_one())
    deleted = 0
    while True:
        with store.db.write() as conn:
            batch = conn.execute(sa.select(*key).where(*where).order_by(*key).limit(HISTORY_BATCH)).all()
            if batch:
                chosen = key[0].in_([row[0] for row in batch]) if len(key) == 1 else sa.tuple_(*key).in_(batch)
                gone = conn.execute(sa.delete(table).where(chosen, *where)
                                    .returning(*([table.c.status] if table is jobs else key))).all()
                if table is jobs:
                    tally_finished(conn, {s: -n for s, n in Counter(row[0] for row in gone).items()})
                deleted += len(gone)
        if len(batch) < HISTORY_BATCH:
            return deleted
        store.db.let_writers_in()
