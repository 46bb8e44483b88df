"""The autotune policy: graph keys missed often on an environment that a worker serves are enqueued for it,
without a person.

One step (:func:`run_autotune`), for every environment a worker claimed for within ``worker_window`` (a claim
with or without a job records it, :func:`.jobs.record_claimer`):

- the budget left is ``jobs_per_hour`` less the ``auto`` jobs created for exactly that environment in the last hour;
- the candidates are keys missed at least ``min_misses`` times there whose spec is stored, that have no plan there,
  no queued or running job whose target matches the environment (wildcards included) and no job ever for exactly
  that environment (a failed one is left to an admin: explain says why it failed);
- the most-missed candidates, up to the budget, are enqueued for exactly that environment with source ``auto`` and
  priority :data:`AUTO_PRIORITY`, below every admin or campaign job (priority 0 unless set), so those are claimed
  first.

A key's miss count is of distinct callers and processes, and one caller's share of the keys it alone raises is
bounded (:mod:`.misses`), so no one token takes the budget. Each step also deletes up to :data:`EXPIRE_BATCH` rows
of who counted a miss that count no more, so that table holds about a week of counted misses.

The step is one write transaction, serialized across replicas (Postgres: a transaction-scoped advisory lock;
SQLite: ``BEGIN IMMEDIATE``), so two replicas running it at once neither enqueue a key twice (the unique index of
active jobs would refuse it anyway) nor overrun a budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import sqlalchemy as sa

from .. import errors
from ..environment import VALIDITY_FIELDS
from ..protocol import ACTIVE_JOB_STATUSES, PRIORITY_MAX, Job, TargetEnvironment
from .jobs import insert_job, target_key
from .misses import expire_miss_callers
from .models import jobs, misses, plans, specs, worker_environments

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from . import Store

#: Postgres advisory lock key of the autotune step ("auto" in ASCII); the migration lock's differs.
_PG_AUTOTUNE_LOCK = 0x6175746F
#: The priority of automatic jobs: the lowest there is, so every admin or campaign job is claimed before them.
AUTO_PRIORITY = -PRIORITY_MAX
#: Expired rows of who counted a miss deleted per step.
EXPIRE_BATCH = 5000
#: The period of the per-environment job budget.
BUDGET_PERIOD = timedelta(hours=1)


@dataclass(frozen=True)
class AutotunePolicy:
    """The bounds of the policy (``PLANCACHE_AUTOTUNE_*``)."""

    min_misses: int = 3
    jobs_per_hour: int = 20
    worker_window: timedelta = timedelta(hours=1)

    def __post_init__(self) -> None:
        if self.min_misses < 1:
            raise errors.InvalidValue(f"autotune min_misses must be at least 1, not {self.min_misses}")
        if self.jobs_per_hour < 0:
            raise errors.InvalidValue(f"autotune jobs_per_hour must be 0 or more, not {self.jobs_per_hour}")
        if self.worker_window <= timedelta(0):
            raise errors.InvalidValue(f"autotune worker_window must be positive, not {self.worker_window}")


def hold_off_autotune(conn: Connection) -> None:
    """Postgres: wait for a running autotune step and keep new ones from starting until commit (any number of
    transactions may hold it off at once). For one that inserts several jobs in another order than the step, which
    could otherwise wait for the step while the step waits for it. SQLite needs nothing: writers run one at a time."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": _PG_AUTOTUNE_LOCK})


def run_autotune(store: Store, policy: AutotunePolicy) -> list[Job]:
    """One step of the policy (see the module docstring); the jobs it created, per environment most-missed first."""
    created: list[Job] = []
    with store.db.write() as conn:
        if not store.db.is_sqlite:
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_AUTOTUNE_LOCK})
        now = store.db.now(conn)
        expire_miss_callers(conn, now, EXPIRE_BATCH)
        served = conn.execute(
            sa.select(worker_environments).where(worker_environments.c.last_claim_at >= now - policy.worker_window)
            .order_by(worker_environments.c.env_id)
        ).mappings().all()
        for env in served:
            target = TargetEnvironment(**{f: env[f] for f in VALIDITY_FIELDS})
            exact = target_key(target)
            used = conn.execute(
                sa.select(sa.func.count()).select_from(jobs)
                .where(jobs.c.source == "auto", jobs.c.target_key == exact, jobs.c.created_at > now - BUDGET_PERIOD)
            ).scalar_one()
            left = policy.jobs_per_hour - used
            if left <= 0:
                continue
            covering_job = sa.exists().where(
                jobs.c.graph_key == misses.c.graph_key,
                sa.or_(jobs.c.target_key == exact,
                       sa.and_(jobs.c.status.in_(ACTIVE_JOB_STATUSES),
                               *(sa.or_(jobs.c[f].is_(None), jobs.c[f] == env[f]) for f in VALIDITY_FIELDS))))
            keys = conn.execute(
                sa.select(misses.c.graph_key)
                .where(misses.c.env_id == env["env_id"], misses.c.count >= policy.min_misses,
                       sa.exists().where(specs.c.graph_key == misses.c.graph_key),
                       ~sa.exists().where(plans.c.graph_key == misses.c.graph_key, plans.c.env_id == misses.c.env_id),
                       ~covering_job)
                .order_by(misses.c.count.desc(), misses.c.last_seen.desc(), misses.c.graph_key)
                .limit(left)
            ).scalars().all()
            for key in keys:
                job, new = insert_job(conn, key, target, now=now, priority=AUTO_PRIORITY,
                                      max_attempts=store.job_max_attempts, source="auto")
                if job is not None and new:
                    created.append(job)
    return created
