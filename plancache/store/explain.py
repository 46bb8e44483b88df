"""Why graph keys have no plan on an environment: a withdrawal, registration, the newest job for it, plans elsewhere."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..environment import VALIDITY_FIELDS, Environment
from ..protocol import MissReason, Withdrawal, WithdrawalRecord
from .db import Database
from .environments import same_env
from .jobs import row_to_job
from .models import jobs, plans, specs, withdrawals
from .plans import row_to_withdrawal

#: Job errors are quoted in a reason up to this many characters.
ERROR_CHARS = 300


class Explanations:
    db: Database

    def explain_misses(self, env: Environment, graph_keys: list[str]) -> dict[str, MissReason]:
        """A :class:`~plancache.protocol.MissReason` for each distinct key: four queries whatever the count."""
        keys = list(dict.fromkeys(graph_keys))
        if not keys:
            return {}
        validity = env.validity()
        with self.db.read() as conn:
            registered = set(conn.execute(sa.select(specs.c.graph_key).where(specs.c.graph_key.in_(keys))).scalars())
            newest: dict[str, Any] = {}
            for row in conn.execute(sa.select(jobs).where(jobs.c.graph_key.in_(keys)).order_by(jobs.c.id.desc())):
                job = row_to_job(row)
                if job.graph_key not in newest and job.target.matches(env):
                    newest[job.graph_key] = job
            elsewhere: dict[str, list[list[str]]] = {}
            columns = [plans.c.graph_key, *(plans.c[f] for f in VALIDITY_FIELDS)]
            for row in conn.execute(sa.select(*columns).where(plans.c.graph_key.in_(keys))):
                m = row._mapping
                elsewhere.setdefault(m["graph_key"], []).append([f for f in VALIDITY_FIELDS if m[f] != validity[f]])
            withdrawn = {row.graph_key: row_to_withdrawal(row) for row in conn.execute(
                sa.select(withdrawals).where(withdrawals.c.graph_key.in_(keys), *same_env(withdrawals, env)))}
        return {k: _reason(k, newest.get(k), elsewhere.get(k, []), k in registered, env, withdrawn.get(k))
                for k in keys}


def _reason(key: str, job: Any, elsewhere: list[list[str]], registered: bool, env: Environment,
            withdrawal: WithdrawalRecord | None) -> MissReason:
    here = env.describe()
    nearest = min(elsewhere, key=len) if elsewhere else None
    if nearest is not None and not nearest:
        return MissReason(reason="planned", message=f"a tuned plan exists for {here}")
    if withdrawal is not None:
        queued = f"; job {job.id} is {job.status} to tune it again" if job is not None and job.status in (
            "running", "queued") else ""
        signed = Withdrawal.model_validate(withdrawal.model_dump(include=set(Withdrawal.model_fields)))
        return MissReason(reason="withdrawn", withdrawal=signed, job_id=job.id if queued else None,
                          message=f"the plan for {here} (revision {withdrawal.withdrawn_revision}) was withdrawn by an "
                                  f"admin on {withdrawal.created_at:%Y-%m-%d %H:%M} UTC: "
                                  f"{withdrawal.reason[:ERROR_CHARS]}{queued}")
    if job is not None and job.status in ("running", "queued"):
        verb = "being tuned" if job.status == "running" else "queued for tuning"
        return MissReason(reason=job.status, message=f"{verb} (job {job.id}) for {here}", job_id=job.id)
    if job is not None and job.status == "failed":
        error = (job.error or "no error recorded")[:ERROR_CHARS]
        return MissReason(reason="failed", job_id=job.id,
                          message=f"tuning failed (job {job.id}, {job.attempts} of {job.max_attempts} attempts): {error}")
    if nearest is not None:
        fields = ", ".join(f"{f} {getattr(env, f)}" for f in nearest)
        return MissReason(reason="other_environments", differs=nearest,
                          message=f"tuned only for other environments; the nearest differs in {', '.join(nearest)} "
                                  f"(this one has {fields}): enqueue it for this environment")
    if registered:
        return MissReason(reason="not_queued", message="the spec is registered but was never queued for tuning on "
                                                       f"{here}: an admin enqueues it (POST /v1/admin/tune/misses)")
    return MissReason(reason="not_registered", message="the server has never seen this graph's spec: a client that "
                                                       "misses it registers it (a reader token may POST /v1/specs)")
