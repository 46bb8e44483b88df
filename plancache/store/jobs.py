"""The tuning job queue: de-duplicated enqueue, leased claims with fencing tokens, heartbeats, retries.

A job is ``queued`` → ``running`` (claimed: attempts incremented, lease set) → ``succeeded`` (its plan
published, see :mod:`plancache.store.plans`) or ``failed``. A running job whose lease expired is
claimable again. Claims are one ``UPDATE … RETURNING`` over a ``FOR UPDATE SKIP LOCKED`` candidate on
Postgres, and run in a ``BEGIN IMMEDIATE`` transaction on SQLite, so a job is never handed to two workers.

Leases are bound to their holder. Each claim draws a new secret lease token (the fencing token,
``secrets.token_urlsafe``), returned to the claimer only (:class:`Claim`); the store keeps its sha256
and the API token that claimed (``holder``). A heartbeat, failure or completion must present the
current lease's token (compared in constant time; a token of a lease taken over, or a guess, is
:class:`errors.LeaseLost`) from the same API token (else :class:`errors.NotLeaseHolder`).

Lease times are the database's: every operation reads the time once, on its own transaction
(:meth:`~.db.Database.now`), so replicas with skewed clocks agree on when a lease expires.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import math
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from .. import errors
from ..canonical import canonical_json
from ..environment import VALIDITY_FIELDS, Environment
from ..protocol import (
    ACTIVE_JOB_STATUSES,
    JOB_STATUSES,
    LEASE_TOKEN_BYTES,
    Job,
    JobSource,
    JobStatus,
    TargetEnvironment,
    is_job_id,
)
from .content import spec_exists
from .db import Database, check_int, check_page, equal_in_index_order, indexed_alias, upsert_insert
from .environments import check_validity
from .models import ACTIVE_JOBS, FINISHED_JOBS, JOB_SOURCES, UTCDateTime, job_tallies, jobs, worker_environments

_ACTIVE_PREDICATE = sa.text(ACTIVE_JOBS)  # the partial indexes' WHERE, word for word
#: 'running' as a literal of the statement, not a parameter: only then may a planner use the index of running jobs.
_RUNNING: sa.ColumnElement[str] = sa.literal_column("'running'")
#: How often a claim refreshes the time its environment was last claimed for (``worker_environments``).
CLAIMER_REFRESH = timedelta(seconds=10)
#: Longest ``holder`` (the claiming API token's identity) the store keeps.
MAX_HOLDER_LENGTH = 64
#: Shortest lease token a worker may propose for its claim (``secrets.token_urlsafe(32)`` gives 43 characters).
MIN_PROPOSED_TOKEN_LENGTH = 32
#: How the error of a job whose last lease expired with no attempts left begins (its holder may still complete it).
LEASE_EXPIRED_ERROR = "lease expired after "
#: How the error of a job an admin cancelled begins.
CANCELLED_ERROR = "cancelled by "


@dataclass(frozen=True)
class Claim:
    """A claimed job and its lease token: the secret that heartbeat, complete and fail need. The store
    keeps only its hash, so this is the one time it is seen."""

    job: Job
    lease_token: str = field(repr=False)


def hash_lease_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def target_key(target: TargetEnvironment) -> str:
    """The de-duplication key of a target: its canonical JSON, wildcards (null) included."""
    return canonical_json(target.model_dump())


@functools.lru_cache(maxsize=1024)
def _target_keys(validity: tuple[Any, ...]) -> tuple[str, ...]:
    fields = dict(zip(VALIDITY_FIELDS, validity, strict=True))
    return tuple(sorted(target_key(TargetEnvironment(**{f: fields[f] for f in chosen}))
                        for n in range(len(VALIDITY_FIELDS) + 1) for chosen in itertools.combinations(VALIDITY_FIELDS, n)))


def env_target_keys(env: Environment) -> tuple[str, ...]:
    """The target keys of every target that matches ``env``: each validity field its value or any (32 keys)."""
    return _target_keys(tuple(getattr(env, f) for f in VALIDITY_FIELDS))


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
        lease_holder=m["lease_holder"],
        lease_expires_at=m["lease_expires_at"],
        error=m["error"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        finished_at=m["finished_at"],
        source=m["source"],
    )


def _check_lease_seconds(lease_seconds: float) -> timedelta:
    if not (isinstance(lease_seconds, (int, float)) and math.isfinite(lease_seconds) and lease_seconds > 0):
        raise errors.InvalidValue(f"lease_seconds must be a positive number of seconds, not {lease_seconds!r}")
    return timedelta(seconds=lease_seconds)


def _lease_token_matches(row: Row[Any], lease_token: Any) -> bool:
    stored = row.lease_token_hash
    return (isinstance(lease_token, str) and stored is not None
            and hmac.compare_digest(stored, hash_lease_token(lease_token)))


def held_job(conn: Connection, job_id: int, worker_id: str | None, lease_token: str | None,
             holder: str | None = None, *, completing: bool = False) -> Row[Any]:
    """Lock and return job ``job_id`` if the caller holds its current lease: ``lease_token`` is that lease's
    token, ``holder`` the API token that claimed it and ``worker_id`` its worker. Else :class:`errors.NotFound`,
    :class:`errors.LeaseLost` (not running; a token of a lease taken over, or no lease token of this job;
    another worker id) or :class:`errors.NotLeaseHolder` (the right lease token from another API token).
    Refusals name no holder and no token.

    A lease that expired but was not taken over by another claim is still held. So, for ``completing`` (publishing
    its result: the blob's upload, the completion), is the last lease of a job failed because it expired with no
    attempts left: a worker that lost the server for longer than its lease delivers its spooled result then.
    """
    row = None if not is_job_id(job_id) else conn.execute(
        sa.select(jobs).where(jobs.c.id == job_id).with_for_update()).first()
    if row is None:
        raise errors.NotFound(f"no job {job_id}")
    if not worker_id or not lease_token:
        raise errors.LeaseLost(f"job {job_id}: a worker id and lease token are needed to act on it")
    expired_last = completing and row.status == "failed" and (row.error or "").startswith(LEASE_EXPIRED_ERROR)
    if row.status != "running" and not expired_last:
        raise errors.LeaseLost(f"job {job_id} is {row.status}, not running")
    if not _lease_token_matches(row, lease_token):
        raise errors.LeaseLost(f"job {job_id}: that is not the lease token of its current lease (the lease "
                               "was taken over by a later claim, or was never held with it)")
    if row.lease_holder != holder:
        raise errors.NotLeaseHolder(f"job {job_id} was claimed with another API token; only the token that "
                                    "claimed a job may heartbeat, complete or fail it")
    if row.lease_owner != worker_id:
        raise errors.LeaseLost(f"job {job_id}: its lease is not held by worker {worker_id!r}")
    return row


def tally_finished(conn: Connection, deltas: dict[str, int]) -> None:
    """Add ``deltas`` (by final status) to the tallies of ended jobs, in the caller's transaction, which ends or deletes
    those jobs. In status order, so that transactions that change both never wait for each other in a cycle."""
    for status in sorted(deltas):
        if deltas[status]:
            conn.execute(sa.update(job_tallies).where(job_tallies.c.status == status)
                         .values(count=job_tallies.c.count + deltas[status]))


def complete_held_job(conn: Connection, job_id: int, worker_id: str | None, lease_token: str | None,
                      graph_key: str, env: Environment, now: datetime, *, holder: str | None = None) -> Row[Any]:
    """Mark a held job succeeded, inside the caller's (plan-publishing) transaction (``now``: its time); the job's
    row as it was before, for :func:`tally_completion`."""
    row = held_job(conn, job_id, worker_id, lease_token, holder, completing=True)
    if row.graph_key != graph_key:
        raise errors.Conflict(f"job {job_id} is for graph key {row.graph_key}, not {graph_key}")
    target = row_to_job(row).target
    if not target.matches(env):
        raise errors.EnvironmentMismatch(f"job {job_id} targets {target.model_dump(exclude_none=True)}, not {env.describe()}")
    conn.execute(
        sa.update(jobs).where(jobs.c.id == job_id)
        .values(status="succeeded", lease_expires_at=None, error=None, updated_at=now, finished_at=now)
    )
    return row


def tally_completion(conn: Connection, row: Row[Any]) -> None:
    """Count the completion of the job ``row`` (as :func:`complete_held_job` returned it) in the tallies: last in its
    transaction, since on Postgres every other transaction that ends a job waits for the tally's row until the commit."""
    tally_finished(conn, {"succeeded": 1, "failed": -1 if row.status == "failed" else 0})


def _claim_statements() -> tuple[Any, Any]:
    """The two statements of a claim, built once (bound parameters: now, expires, stale, worker, token_hash,
    holder, targets: :func:`env_target_keys`)."""
    cand = indexed_alias(jobs, "candidate", "ix_jobs_running")
    seek = indexed_alias(jobs, "candidate", "uq_jobs_active_target")
    now = sa.bindparam("now", type_=UTCDateTime)
    # A lease granted or extended more than a lease length in the future was granted by a clock that has since been
    # stepped back (SQLite's is the server host's): it counts as expired, or a dead worker's job would wait out the
    # step. (Its last write's time, not its end: a lease granted when leases were longer is not stale.)
    stale = sa.bindparam("stale", type_=UTCDateTime)

    def expired(c: Any) -> Any:
        return sa.and_(c.c.status == _RUNNING, sa.or_(c.c.lease_expires_at < now, c.c.updated_at > stale))

    exhausted = (sa.select(cand.c.id).where(expired(cand), cand.c.attempts >= cand.c.max_attempts)
                 .with_for_update(skip_locked=True))
    fail_exhausted = (
        sa.update(jobs).where(jobs.c.id.in_(exhausted))
        .values(status="failed", lease_expires_at=None, updated_at=now, finished_at=now,
                error=sa.literal(LEASE_EXPIRED_ERROR) + sa.cast(jobs.c.attempts, sa.String) + sa.literal(" attempts"))
    )
    # The environment's jobs are the active ones of the target keys it matches (env_target_keys), read through their
    # index (its literal status term is the partial index's; SQLite is told to), so the cost is that of this
    # environment's queue, whatever other environments queued or how many jobs ended.
    best = (
        sa.select(seek.c.id)
        .where(seek.c.target_key.in_(sa.bindparam("targets", expanding=True)),
               _ACTIVE_PREDICATE,
               sa.or_(seek.c.status == "queued", sa.and_(expired(seek), seek.c.attempts < seek.c.max_attempts)))
        .order_by(seek.c.priority.desc(), seek.c.id.asc())
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    claim = (
        sa.update(jobs).where(jobs.c.id == best)
        .values(status="running", attempts=jobs.c.attempts + 1, fencing_token=jobs.c.fencing_token + 1,
                lease_owner=sa.bindparam("worker", type_=jobs.c.lease_owner.type),
                lease_token_hash=sa.bindparam("token_hash", type_=jobs.c.lease_token_hash.type),
                lease_holder=sa.bindparam("holder", type_=jobs.c.lease_holder.type),
                lease_expires_at=sa.bindparam("expires", type_=UTCDateTime), updated_at=now)
        .returning(*jobs.c)
    )
    return fail_exhausted, claim


_FAIL_EXHAUSTED, _CLAIM = _claim_statements()
#: Per active status, the partial index that holds its jobs and that index's WHERE, as a literal of the statement
#: (the ended ones: ``ix_jobs_finished``, :func:`_job_list`).
_STATUS_INDEX = {"queued": ("uq_jobs_active_target", _ACTIVE_PREDICATE),
                 "running": ("ix_jobs_running", sa.text("status = 'running'"))}


def _job_list(conn: Connection, status: str | None, graph_key: str | None) -> sa.Select[Any]:
    """The jobs :meth:`Jobs.list_jobs` lists, newest first, read on ``conn``: those of a status through the partial
    index that holds them, not every job newest first."""
    if graph_key is not None:
        return sa.select(jobs).where(jobs.c.graph_key == graph_key, *([] if status is None else [jobs.c.status == status])
                                     ).order_by(jobs.c.id.desc())
    if status is None:
        return sa.select(jobs).order_by(jobs.c.id.desc())
    if status in _STATUS_INDEX:
        index, predicate = _STATUS_INDEX[status]
        table = indexed_alias(jobs, "listed", index)
        return sa.select(table).where(predicate, table.c.status == status).order_by(table.c.id.desc())
    # Ended jobs: the (status, id) index walked backwards from the newest, never every job newest first (past a
    # fleet's recent successes, listing its failures) nor every job of the status sorted.
    table = indexed_alias(jobs, "listed", "ix_jobs_finished")
    return sa.select(table).where(sa.text(FINISHED_JOBS), *equal_in_index_order(conn, table.c.status, status)
                                  ).order_by(table.c.status.desc(), table.c.id.desc())


#: How many jobs are active, and how many of them running: each counted in its partial index, in one statement.
_COUNT_ACTIVE = sa.select(
    sa.select(sa.func.count()).select_from(indexed_alias(jobs, "active", "uq_jobs_active_target"))
    .where(_ACTIVE_PREDICATE).scalar_subquery(),
    sa.select(sa.func.count()).select_from(running := indexed_alias(jobs, "running", "ix_jobs_running"))
    .where(running.c.status == _RUNNING).scalar_subquery())


def _insert_active(conn: Connection) -> Any:
    """An INSERT of jobs that skips a key and target with a queued or running job (the unique index of active jobs
    decides, on every replica; on Postgres it waits for a concurrent transaction that inserted the same one)."""
    return upsert_insert(conn, jobs).on_conflict_do_nothing(index_elements=["graph_key", "target_key"],
                                                           index_where=_ACTIVE_PREDICATE)


def _new_job(graph_key: str, target: TargetEnvironment, *, now: datetime, priority: int, max_attempts: int,
             source: JobSource) -> dict[str, Any]:
    """The row of a newly queued job."""
    return dict(graph_key=graph_key, **target.model_dump(), target_key=target_key(target), status="queued",
                priority=priority, attempts=0, max_attempts=max_attempts, fencing_token=0, created_at=now,
                updated_at=now, source=source)


def insert_job(conn: Connection, graph_key: str, target: TargetEnvironment, *, now: datetime, priority: int,
               max_attempts: int, source: JobSource) -> tuple[Job | None, bool]:
    """Queue a job in the caller's write transaction: ``(job, True)``, or the queued or running job of the same key
    and target with ``False`` (see :func:`_insert_active`), or ``(None, False)`` when that job finished in between
    (try again)."""
    row = conn.execute(_insert_active(conn).values(_new_job(graph_key, target, now=now, priority=priority,
                                                            max_attempts=max_attempts, source=source))
                       .returning(*jobs.c)).first()
    if row is not None:
        return row_to_job(row), True
    row = conn.execute(sa.select(jobs).where(jobs.c.graph_key == graph_key, jobs.c.target_key == target_key(target),
                                             jobs.c.status.in_(ACTIVE_JOB_STATUSES))).first()
    return (None, False) if row is None else (row_to_job(row), False)


def insert_jobs(conn: Connection, graph_keys: list[str], target: TargetEnvironment, *, now: datetime, priority: int,
                max_attempts: int, source: JobSource) -> int:
    """Queue a job for each of ``graph_keys`` (stored specs, ascending) in the caller's write transaction, a few
    statements for all of them; keys with a queued or running job for ``target`` are skipped (see
    :func:`_insert_active`). The number queued.

    Ascending keys keep such callers on Postgres free of deadlocks with each other: each waits only for a key above
    every one it inserted. One that may race the autotune step (whose order is another) holds it off first
    (:func:`~.autotune.hold_off_autotune`)."""
    if not graph_keys:
        return 0
    rows = [_new_job(key, target, now=now, priority=priority, max_attempts=max_attempts, source=source)
            for key in graph_keys]
    return len(conn.execute(_insert_active(conn).returning(jobs.c.id), rows).all())


def record_claimer(conn: Connection, env: Environment, now: datetime) -> None:
    """Remember that a worker claimed for ``env`` at ``now`` (whether or not a job was handed out). The row is
    written at most every :data:`CLAIMER_REFRESH` (so workers polling one environment rarely wait on its lock)."""
    last = conn.execute(sa.select(worker_environments.c.last_claim_at)
                        .where(worker_environments.c.env_id == env.env_id)).scalar()
    if last is not None and now - CLAIMER_REFRESH <= last <= now:
        return
    stmt = upsert_insert(conn, worker_environments).values(env_id=env.env_id, **env.validity(), last_claim_at=now)
    conn.execute(stmt.on_conflict_do_update(index_elements=["env_id"], set_={"last_claim_at": stmt.excluded.last_claim_at}))


class Jobs:
    db: Database
    job_max_attempts: int

    def checked_job_request(self, target: TargetEnvironment, *, priority: int, max_attempts: int | None,
                            source: JobSource) -> int:
        """The ``max_attempts`` of a job requested so (None: the store's default), once the request is checked
        (:class:`errors.InvalidValue`)."""
        attempts_allowed = check_int("max_attempts", self.job_max_attempts if max_attempts is None else max_attempts, minimum=1)
        check_int("priority", priority)
        check_validity(target.model_dump())
        if source not in JOB_SOURCES:
            raise errors.InvalidValue(f"unknown job source {source!r}; one of {', '.join(JOB_SOURCES)}")
        return attempts_allowed

    def enqueue(self, graph_key: str, target: TargetEnvironment, *, priority: int = 0,
                max_attempts: int | None = None, source: JobSource = "admin") -> tuple[Job, bool]:
        """Queue a tuning job; a queued or running job for the same key and target is returned instead
        (``False``). The spec must be stored (:class:`errors.NotFound`). ``source``: who asks for it."""
        attempts_allowed = self.checked_job_request(target, priority=priority, max_attempts=max_attempts, source=source)
        for _ in range(3):  # only a concurrent enqueue + completion in between makes this loop
            with self.db.write() as conn:
                if not spec_exists(conn, graph_key):
                    raise errors.NotFound(f"no spec stored for graph key {graph_key}; upload it first")
                job, created = insert_job(conn, graph_key, target, now=self.db.now(conn), priority=priority,
                                          max_attempts=attempts_allowed, source=source)
                if job is not None:
                    return job, created
        raise errors.Conflict(f"could not enqueue graph key {graph_key}: the active job kept changing")

    def claim(self, env: Environment, worker_id: str, *, lease_seconds: float, holder: str | None = None,
              lease_token: str | None = None) -> Claim | None:
        """Lease the best job this environment can run (highest priority, then oldest) to ``worker_id``
        and the API token ``holder`` (the server passes the caller's identity), or None.

        Running jobs whose lease expired are taken over; those with no attempts left end ``failed``. Every claim,
        answered with a job or not, records that a worker serves ``env`` (the autotune policy's window).

        ``lease_token``: the worker's own token for this claim (at least :data:`MIN_PROPOSED_TOKEN_LENGTH`
        characters of a secret), else the store draws one. The same claim sent again with it (its answer was lost)
        gets the job it leased then, not a second job: a lost answer leaves no job leased to nobody.
        """
        check_validity(env.validity())
        duration = _check_lease_seconds(lease_seconds)
        if holder is not None and len(holder) > MAX_HOLDER_LENGTH:
            raise errors.InvalidValue(f"a lease holder is at most {MAX_HOLDER_LENGTH} characters")
        if lease_token is not None and len(lease_token) < MIN_PROPOSED_TOKEN_LENGTH:
            raise errors.InvalidValue(f"a proposed lease token has at least {MIN_PROPOSED_TOKEN_LENGTH} characters")
        token = lease_token or secrets.token_urlsafe(LEASE_TOKEN_BYTES)
        token_hash = hash_lease_token(token)
        with self.db.write() as conn:
            if lease_token is not None:
                again = conn.execute(sa.select(jobs).where(jobs.c.status == _RUNNING,
                                                           jobs.c.lease_token_hash == token_hash)).first()
                if again is not None:
                    if again.lease_holder != holder or again.lease_owner != worker_id:
                        raise errors.Conflict("that lease token is in use by another claim; propose a new one")
                    return Claim(row_to_job(again), token)
            now = self.db.now(conn)
            params = {"now": now, "expires": now + duration, "stale": now + duration, "worker": worker_id,
                      "token_hash": token_hash, "holder": holder, "targets": list(env_target_keys(env))}
            tally_finished(conn, {"failed": conn.execute(_FAIL_EXHAUSTED, params).rowcount})
            row = conn.execute(_CLAIM, params).first()
            record_claimer(conn, env, now)
        return None if row is None else Claim(row_to_job(row), token)

    def heartbeat(self, job_id: int, worker_id: str, lease_token: str, *, lease_seconds: float,
                  holder: str | None = None) -> Job:
        """Extend the lease of a job this caller holds (:func:`held_job` says what is refused)."""
        duration = _check_lease_seconds(lease_seconds)
        with self.db.write() as conn:
            held_job(conn, job_id, worker_id, lease_token, holder)
            now = self.db.now(conn)
            row = conn.execute(
                sa.update(jobs).where(jobs.c.id == job_id)
                .values(lease_expires_at=now + duration, updated_at=now).returning(*jobs.c)
            ).one()
        return row_to_job(row)

    def check_held(self, job_id: int, worker_id: str | None, lease_token: str | None, *, holder: str | None,
                   completing: bool = False) -> None:
        """Nothing when the caller holds job ``job_id``'s lease (``completing``: to publish its result); what
        :func:`held_job` raises otherwise."""
        with self.db.write() as conn:  # its row lock, as heartbeat takes it; nothing is written
            held_job(conn, job_id, worker_id, lease_token, holder, completing=completing)

    def cancel_job(self, job_id: int, *, by: str, reason: str = "") -> Job:
        """End a queued or running job as ``failed`` (error ``cancelled by <by>: <reason>``): no worker claims it
        again, and its lease, if any, ends (the holder's next heartbeat is refused, and it stops tuning).
        :class:`errors.NotFound`, or :class:`errors.Conflict` when the job has ended already."""
        with self.db.write() as conn:
            row = None if not is_job_id(job_id) else conn.execute(
                sa.select(jobs).where(jobs.c.id == job_id).with_for_update()).first()
            if row is None:
                raise errors.NotFound(f"no job {job_id}")
            if row.status not in ACTIVE_JOB_STATUSES:
                raise errors.Conflict(f"job {job_id} has ended already ({row.status}); only a queued or running job "
                                      "can be cancelled")
            now = self.db.now(conn)
            error = f"{CANCELLED_ERROR}{by}" + (f": {reason}" if reason else "")
            row = conn.execute(
                sa.update(jobs).where(jobs.c.id == job_id)
                .values(status="failed", error=error, lease_expires_at=None, lease_token_hash=None, updated_at=now,
                        finished_at=now)
                .returning(*jobs.c)
            ).one()
            tally_finished(conn, {"failed": 1})
        return row_to_job(row)

    def fail(self, job_id: int, worker_id: str, lease_token: str, error: str, *, retryable: bool = True,
             holder: str | None = None, released: bool = False) -> Job:
        """Record a failed attempt of a job this caller holds: back to ``queued`` (lease cleared) if retryable
        with attempts left, else ``failed``. ``released``: the worker stopped before the attempt ended; the job is
        queued again and the attempt not counted."""
        with self.db.write() as conn:
            row = held_job(conn, job_id, worker_id, lease_token, holder)
            now = self.db.now(conn)
            requeue = released or (retryable and row.attempts < row.max_attempts)
            lease: dict[str, Any] = {"lease_owner": None, "lease_holder": None, "lease_token_hash": None} if requeue else {}
            if released:
                lease["attempts"] = jobs.c.attempts - 1  # its claim counted it; a held job has attempts >= 1
            row = conn.execute(
                sa.update(jobs).where(jobs.c.id == job_id)
                .values(status="queued" if requeue else "failed", error=error, updated_at=now,
                        lease_expires_at=None, finished_at=None if requeue else now, **lease)
                .returning(*jobs.c)
            ).one()
            tally_finished(conn, {"failed": 0 if requeue else 1})
        return row_to_job(row)

    def completed_with(self, job_id: int, worker_id: str, lease_token: str, holder: str | None = None) -> bool:
        """Whether job ``job_id`` succeeded under exactly this lease (worker, lease token and API token): a
        completion repeated by its holder (whose first answer was lost) is then answered, not refused."""
        with self.db.read() as conn:
            row = None if not is_job_id(job_id) else conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).first()
        return (row is not None and row.status == "succeeded" and row.lease_owner == worker_id
                and row.lease_holder == holder and _lease_token_matches(row, lease_token))

    def get_job(self, job_id: int) -> Job:
        with self.db.read() as conn:
            row = None if not is_job_id(job_id) else conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).first()
        if row is None:
            raise errors.NotFound(f"no job {job_id}")
        return row_to_job(row)

    def list_jobs(self, *, status: JobStatus | None = None, graph_key: str | None = None,
                  limit: int = 100, offset: int = 0) -> list[Job]:
        """Jobs, newest first."""
        check_page(limit, offset)
        if status is not None and status not in JOB_STATUSES:
            raise errors.InvalidValue(f"unknown job status {status!r}; one of {', '.join(JOB_STATUSES)}")
        with self.db.read() as conn:
            q = _job_list(conn, status, graph_key).limit(limit).offset(offset)
            return [row_to_job(r) for r in conn.execute(q)]

    def job_counts(self) -> dict[str, int]:
        """Number of jobs in each status (every status present, zeros included): the active ones counted in their
        index (as many as are queued or running), the ended ones from their tallies."""
        with self.db.read() as conn:
            active, running = conn.execute(_COUNT_ACTIVE).one()
            counts: dict[str, int] = {"queued": active - running, "running": running}
            counts.update(conn.execute(sa.select(job_tallies.c.status, job_tallies.c.count)).all())
        return {s: int(counts.get(s, 0)) for s in JOB_STATUSES}

    def worker_environments(self, limit: int = 100) -> tuple[datetime, list[tuple[Environment, datetime]]]:
        """The database's clock now, and the environments workers claimed for (a job handed out or not), the most
        recently claimed first, each with the time of its last claim (refreshed every ``CLAIMER_REFRESH``)."""
        check_page(limit, 0)
        q = sa.select(worker_environments).order_by(worker_environments.c.last_claim_at.desc(),
                                                    worker_environments.c.env_id).limit(limit)
        with self.db.read() as conn:
            now = self.db.now(conn)
            rows = conn.execute(q).mappings().all()
        return now, [(Environment(**{f: r[f] for f in VALIDITY_FIELDS}), r["last_claim_at"]) for r in rows]
