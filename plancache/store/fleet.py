"""What the whole fleet looks like per GPU environment, for the server's metrics: queued and running jobs by
target, missed graph keys by environment, and when workers of each environment last claimed.

Every figure is read from the database, so every server replica reports the same one; each family is grouped
by environment and cut at :data:`MAX_GROUPS` groups (the largest first), so a scrape costs one grouped query per
family whatever the fleet accumulates in groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ..environment import VALIDITY_FIELDS
from ..protocol import ACTIVE_JOB_STATUSES
from .db import Database
from .models import jobs, misses, worker_environments

#: Groups one family reports at most (environments, or job targets and statuses).
MAX_GROUPS = 200

#: An environment's validity fields; a job's target leaves a field None for "any".
Validity = tuple[Any, ...]


@dataclass
class FleetCounts:
    """One reading of :meth:`Fleet.fleet_counts`; each key is the validity fields in :data:`VALIDITY_FIELDS` order."""

    #: (target validity, status) -> active jobs (``queued`` and ``running``)
    jobs: dict[tuple[Validity, str], int] = field(default_factory=dict)
    #: environment -> (distinct graph keys missed, misses recorded)
    misses: dict[Validity, tuple[int, int]] = field(default_factory=dict)
    #: environment -> when a worker of it last claimed (a job handed out or not)
    workers: dict[Validity, datetime] = field(default_factory=dict)


class Fleet:
    """The fleet's per-environment figures (mixed into :class:`~plancache.store.Store`)."""

    db: Database

    def fleet_counts(self) -> FleetCounts:
        """Active jobs per target and status, misses and the last claim per environment, in one read transaction."""
        out = FleetCounts()
        job_env = [jobs.c[f] for f in VALIDITY_FIELDS]
        miss_env = [misses.c[f] for f in VALIDITY_FIELDS]
        n = sa.func.count().label("n")
        with self.db.read() as conn:
            for row in conn.execute(sa.select(*job_env, jobs.c.status, n)
                                    .where(jobs.c.status.in_(ACTIVE_JOB_STATUSES))
                                    .group_by(*job_env, jobs.c.status).order_by(n.desc()).limit(MAX_GROUPS)):
                out.jobs[(tuple(row[:-2]), row.status)] = int(row.n)
            keys = sa.func.count().label("keys")
            for row in conn.execute(sa.select(*miss_env, keys, sa.func.sum(misses.c.count).label("events"))
                                    .group_by(*miss_env).order_by(keys.desc()).limit(MAX_GROUPS)):
                out.misses[tuple(row[:-2])] = (int(row.keys), int(row.events or 0))
            for row in conn.execute(sa.select(*[worker_environments.c[f] for f in VALIDITY_FIELDS],
                                              worker_environments.c.last_claim_at)
                                    .order_by(worker_environments.c.last_claim_at.desc()).limit(MAX_GROUPS)):
                out.workers[tuple(row[:-1])] = row.last_claim_at
        return out
