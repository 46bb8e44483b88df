"""Re-tune campaigns: enqueue every known graph key for a target, so a fleet upgrade (new cuDNN, driver or GPU)
does not start with an empty cache.

"Known" means every graph key whose spec is stored. When the target names one exact environment (every
validity field set), keys that already have a plan there are skipped. Each key goes through
:meth:`Store.enqueue <plancache.store.jobs.Jobs.enqueue>`, so a key with a queued or running job for the
same target is not queued twice and running a campaign again is harmless (it is not one transaction: an
interrupted campaign is finished by running it again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

from ..environment import VALIDITY_FIELDS, environment_id
from ..protocol import TargetEnvironment
from .models import plans, specs

if TYPE_CHECKING:
    from . import Store


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


def run_campaign(store: Store, target: TargetEnvironment, *, priority: int = 0,
                 max_attempts: int | None = None) -> CampaignResult:
    """Enqueue a tuning job on ``target`` for every stored spec (see the module docstring)."""
    env_id = exact_env_id(target)
    planned = (sa.exists().where(plans.c.graph_key == specs.c.graph_key, plans.c.env_id == env_id)
               if env_id is not None else sa.false())
    with store.db.read() as conn:
        rows = conn.execute(sa.select(specs.c.graph_key, planned.label("planned")).order_by(specs.c.graph_key)).all()
    keys = [key for key, has_plan in rows if not has_plan]
    known = len(rows)
    created = sum(store.enqueue(key, target, priority=priority, max_attempts=max_attempts, source="campaign")[1] for key in keys)
    return CampaignResult(known=known, already_planned=known - len(keys), enqueued=created,
                          already_queued=len(keys) - created)
