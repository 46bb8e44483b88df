"""The tuning job queue: de-duplicated enqueue, leased claims with fencing tokens, heartbeats, retries.

A job is ``queued`` → ``running`` (claimed: attempts and fencing token incremented, lease set) →
``succeeded`` (its plan published, see :mod:`plancache.store.plans`) or ``failed``. A running job
whose lease expired is claimable again; the new claim increments the fencing token, so the old
holder's heartbeat, failure or completion is refused with :class:`errors.LeaseLost`. Claims are
one ``UPDATE … RETURNING`` over a ``FOR UPDATE SKIP LOCKED`` candidate on Postgres, and run in a
``BEGIN IMMEDIATE`` transaction on SQLite, so a job is never handed to two workers.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from .. import errors
from ..environment import VALIDITY_FIELDS, Environment
from ..protocol import Job, JobStatus, TargetEnvironment
from .content import spec_exists
from .db import INT64_MAX, Database, check_int, check_page, upsert_insert
from .environments import check_validity
from .models import ACTIVE_JOB_STATUSES, UTCDateTime, jobs

JOB_STATUSES: tuple[JobStatus, ...] = ("queued", "running", "succeeded", "failed")
_ACTIVE_PREDICATE = sa.text("status IN ('queued', 'running')")  # must equal the partial index's WHERE


def target_key(target: TargetEnvironment) -> str:
    """The de-duplication key of a target: its canonical JSON, wildcards (null) included."""
    return json.dumps(target.model_dump(), sort_keys=True, separators=(",", ":"))


def row_to_job(row: Row[Any]) -> Job:
    m = row._mapping
    return Job(
        id=m["id"],
        graph_key=m["graph_key"],
        target=TargetEnvironment(**{f: m[f] for f in VALIDITY_FIELDS}),
        status=m["status"],
        priority=m["priority"],
        attempts=m["attempts"],
        max_attempts=m["max_attempts"],
        lease_owner=m["lease_owner"],
        lease_expires_at=m["lease_expires_at"],
        fencing_token=m["fencing_token"],
        error=m["error"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        finished_at=m["finished_at"],
    )


def _lease(lease_seconds: float, now: datetime) -> datetime:
    if not (isinstance(lease_seconds, (int, float)) and math.isfinite(lease_seconds) and lease_seconds > 0):
        raise errors.InvalidValue(f"lease_seconds must be a positive number of seconds, not {lease_seconds!r}")
    return now + timedelta(seconds=lease_seconds)


def held_job(conn: Connection, job_id: int, worker_id: str | None, lease_token: int | None) -> Row[Any]:
    """Lock and return job ``job_id`` if ``worker_id`` holds its current lease; else NotFound / LeaseLost.

    A lease that expired but was not taken over by another claim is still held.
    """
    row = None if not 0 < job_id <= INT64_MAX else conn.execute(
        sa.select(jobs).where(jobs.c.id == job_id).with_for_update()).first()
    if row is None:
        raise errors.NotFound(f"no job {job_id}")
    if worker_id is None or lease_token is None:
        raise errors.LeaseLost(f"job {job_id}: a worker id and lease token are needed to act on it")
    if row.status != "running":
        raise errors.LeaseLost(f"job {job_id} is {row.status}, not running")
    if row.lease_owner != worker_id or row.fencing_token != lease_token:
        raise errors.LeaseLost(
            f"job {job_id}: lease {lease_token} of {worker_id!r} was taken over "
            f"(now held by {row.lease_owner!r} with lease {row.fencing_token})"
        )
    return row


def complete_held_job(conn: Connection, job_id: int, worker_id: str | None, lease_token: int | None,
                      graph_key: str, env: Environment, now: datetime) -> None:
    """Mark a held job succeeded, inside the caller's (plan-publishing) transaction."""
    row = held_job(conn, job_id, worker_id, lease_token)
    if row.graph_key != graph_key:
        raise errors.Conflict(f"job {job_id} is for graph key {row.graph_key}, not {graph_key}")
    target = row_to_job(row).target
    if not target.matches(env):
        raise errors.EnvironmentMismatch(f"job {job_id} targets {target.model_dump(exclude_none=True)}, not {env.describe()}")
    conn.execute(
        sa.update(jobs).where(jobs.c.id == job_id)
        .values(status="succeeded", lease_expires_at=None, error=None, updated_at=now, finished_at=now)
    )


def _claim_statements() -> tuple[Any, Any]:
    """The two statements of a claim, built once (bound parameters: now, expires, worker, env_<field>)."""
    cand = jobs.alias("candidate")
    now = sa.bindparam("now", type_=UTCDateTime)
    expired = sa.and_(cand.c.status == "running", cand.c.lease_expires_at < now)
    exhausted = sa.select(cand.c.id).where(expired, cand.c.attempts >= cand.c.max_attempts).with_for_update(skip_locked=True)
    fail_exhausted = (
        sa.update(jobs).where(jobs.c.id.in_(exhausted))
        .values(status="failed", lease_expires_at=None, updated_at=now, finished_at=now,
                error=sa.literal("lease expired after ") + sa.cast(jobs.c.attempts, sa.String) + sa.literal(" attempts"))
    )
    env_match = [sa.or_(cand.c[f].is_(None), cand.c[f] == sa.bindparam(f"env_{f}", type_=cand.c[f].type))
                 for f in VALIDITY_FIELDS]
    best = (
        sa.select(cand.c.id)
        .where(*env_match, sa.or_(cand.c.status == "queued", sa.and_(expired, cand.c.attempts < cand.c.max_attempts)))
        .order_by(cand.c.priority.desc(), cand.c.id.asc())
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    claim = (
        sa.update(jobs).where(jobs.c.id == best)
        .values(status="running", attempts=jobs.c.attempts + 1, fencing_token=jobs.c.fencing_token + 1,
                lease_owner=sa.bindparam("worker", type_=jobs.c.lease_owner.type),
                lease_expires_at=sa.bindparam("expires", type_=UTCDateTime), updated_at=now)
        .returning(*jobs.c)
    )
    return fail_exhausted, claim


_FAIL_EXHAUSTED, _CLAIM = _claim_statements()


class Jobs:
    db: Database
    job_max_attempts: int

    def enqueue(self, graph_key: str, target: TargetEnvironment, *, priority: int = 0,
                max_attempts: int | None = None) -> tuple[Job, bool]:
        """Queue a tuning job; a queued or running job for the same key and target is returned instead
        (``False``). The spec must be stored (:class:`errors.NotFound`)."""
        attempts_allowed = check_int("max_attempts", self.job_max_attempts if max_attempts is None else max_attempts, minimum=1)
        check_int("priority", priority)
        check_validity(target.model_dump())
        key = target_key(target)
        active = sa.select(jobs).where(jobs.c.graph_key == graph_key, jobs.c.target_key == key,
                                       jobs.c.status.in_(ACTIVE_JOB_STATUSES))
        for _ in range(3):  # only a concurrent enqueue + completion in between makes this loop
            with self.db.write() as conn:
                if not spec_exists(conn, graph_key):
                    raise errors.NotFound(f"no spec stored for graph key {graph_key}; upload it first")
                now = self.db.now()
                row = conn.execute(
                    upsert_insert(conn, jobs)
                    .values(graph_key=graph_key, **target.model_dump(), target_key=key, status="queued",
                            priority=priority, attempts=0, max_attempts=attempts_allowed, fencing_token=0,
                            created_at=now, updated_at=now)
                    .on_conflict_do_nothing(index_elements=["graph_key", "target_key"], index_where=_ACTIVE_PREDICATE)
                    .returning(*jobs.c)
                ).first()
                if row is not None:
                    return row_to_job(row), True
                row = conn.execute(active).first()
                if row is not None:
                    return row_to_job(row), False
        raise errors.Conflict(f"could not enqueue graph key {graph_key}: the active job kept changing")

    def claim(self, env: Environment, worker_id: str, *, lease_seconds: float) -> Job | None:
        """Lease the best job this environment can run (highest priority, then oldest), or None.

        Running jobs whose lease expired are taken over; those with no attempts left end ``failed``.
        """
        check_validity(env.validity())
        now = self.db.now()
        params = {"now": now, "expires": _lease(lease_seconds, now), "worker": worker_id,
                  **{f"env_{f}": getattr(env, f) for f in VALIDITY_FIELDS}}
        with self.db.write() as conn:
            conn.execute(_FAIL_EXHAUSTED, params)
            row = conn.execute(_CLAIM, params).first()
        return None if row is None else row_to_job(row)

    def heartbeat(self, job_id: int, worker_id: str, lease_token: int, *, lease_seconds: float) -> Job:
        """Extend the lease of a job this worker holds (:class:`errors.LeaseLost` if it does not)."""
        now = self.db.now()
        expires = _lease(lease_seconds, now)
        with self.db.write() as conn:
            held_job(conn, job_id, worker_id, lease_token)
            row = conn.execute(
                sa.update(jobs).where(jobs.c.id == job_id)
                .values(lease_expires_at=expires, updated_at=now).returning(*jobs.c)
            ).one()
        return row_to_job(row)

    def fail(self, job_id: int, worker_id: str, lease_token: int, error: str, *, retryable: bool = True) -> Job:
        """Record a failed attempt: back to ``queued`` if retryable with attempts left, else ``failed``."""
        now = self.db.now()
        with self.db.write() as conn:
            row = held_job(conn, job_id, worker_id, lease_token)
            requeue = retryable and row.attempts < row.max_attempts
            row = conn.execute(
                sa.update(jobs).where(jobs.c.id == job_id)
                .values(status="queued" if requeue else "failed", error=error, updated_at=now,
                        lease_expires_at=None, lease_owner=None if requeue else row.lease_owner,
                        finished_at=None if requeue else now)
                .returning(*jobs.c)
            ).one()
        return row_to_job(row)

    def get_job(self, job_id: int) -> Job:
        with self.db.read() as conn:
            row = None if not 0 < job_id <= INT64_MAX else conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).first()
        if row is None:
            raise errors.NotFound(f"no job {job_id}")
        return row_to_job(row)

    def list_jobs(self, *, status: JobStatus | None = None, graph_key: str | None = None,
                  limit: int = 100, offset: int = 0) -> list[Job]:
        """Jobs, newest first."""
        check_page(limit, offset)
        if status is not None and status not in JOB_STATUSES:
            raise errors.InvalidValue(f"unknown job status {status!r}; one of {', '.join(JOB_STATUSES)}")
        q = sa.select(jobs).order_by(jobs.c.id.desc()).limit(limit).offset(offset)
        if status is not None:
            q = q.where(jobs.c.status == status)
        if graph_key is not None:
            q = q.where(jobs.c.graph_key == graph_key)
        with self.db.read() as conn:
            return [row_to_job(r) for r in conn.execute(q)]

    def job_counts(self) -> dict[str, int]:
        """Number of jobs in each status (every status present, zeros included)."""
        with self.db.read() as conn:
            counts = dict(conn.execute(sa.select(jobs.c.status, sa.func.count()).group_by(jobs.c.status)).all())
        return {s: int(counts.get(s, 0)) for s in JOB_STATUSES}
