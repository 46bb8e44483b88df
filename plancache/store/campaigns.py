"""Re-tune campaigns: enqueue every known graph key for a target, so a fleet upgrade (new cuDNN, driver or GPU)
does not start with an empty cache.

"Known" means every graph key whose spec is stored. When the target names one exact environment (every
validity field set), keys that already have a plan there are skipped. Keys are enqueued in pages of
:data:`CAMPAIGN_PAGE_KEYS`, in key order, one short write transaction each (:func:`~.jobs.insert_jobs`), so other
writers (claims, publishes) go on between pages (:meth:`~.db.Database.let_writers_in`) and memory holds one page.
A key with a queued or running job for the same target is not queued twice (the unique index of active jobs
decides, also against concurrent campaigns and enqueues), so running a campaign again is harmless. It is not one
transaction: an interrupted campaign is finished by running it again, and a spec stored while it runs is included
if its key is above the page reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

from ..environment import VALIDITY_FIELDS, environment_id
from ..protocol import JobSource, TargetEnvironment
from .autotune import hold_off_autotune
from .db import check_int
from .jobs import insert_jobs
from .models import plans, specs

if TYPE_CHECKING:
    from . import Store


#: Keys a campaign reads and enqueues per write transaction (tens of milliseconds on SQLite's write lock;
#: docs/DEPLOYMENT.md, "Re-tune campaigns on upgrades", has the figures).
CAMPAIGN_PAGE_KEYS = 500


@dataclass(frozen=True)
class CampaignResult:
    known: int
    already_planned: int
    enqueued: int
    already_queued: int


def exact_env_id(target: TargetEnvironment) -> str | None:
    """The environment id a target names when it sets every validity field, else None."""
    fields = target.model_dump()
    return None if any(fields[f] is None for f in VALIDITY_FIELDS) else environment_id(fields)


def run_campaign(store: Store, target: TargetEnvironment, *, priority: int = 0, max_attempts: int | None = None,
                 page_keys: int = CAMPAIGN_PAGE_KEYS) -> CampaignResult:
    """Enqueue a tuning job on ``target`` for every stored spec (see the module docstring)."""
    check_int("page_keys", page_keys, minimum=1)
    source: JobSource = "campaign"
    attempts = store.checked_job_request(target, priority=priority, max_attempts=max_attempts, source=source)
    env_id = exact_env_id(target)
    planned = (sa.exists().where(plans.c.graph_key == specs.c.graph_key, plans.c.env_id == env_id)
               if env_id is not None else sa.false())
    page = sa.select(specs.c.graph_key, planned.label("planned")).order_by(specs.c.graph_key).limit(page_keys)
    known = already_planned = enqueued = 0
    after: str | None = None
    while True:
        with store.db.write() as conn:
            hold_off_autotune(conn)
            rows = conn.execute(page if after is None else page.where(specs.c.graph_key > after)).all()
            keys = [key for key, has_plan in rows if not has_plan]
            enqueued += insert_jobs(conn, keys, target, now=store.db.now(conn), priority=priority,
                                    max_attempts=attempts, source=source)
        known += len(rows)
        already_planned += len(rows) - len(keys)
        if len(rows) < page_keys:
            return CampaignResult(known=known, already_planned=already_planned, enqueued=enqueued,
                                  already_queued=known - already_planned - enqueued)
        after = rows[-1].graph_key
        store.db.let_writers_in()
