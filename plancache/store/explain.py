"""Why graph keys have no plan on an environment: a withdrawal, registration, the newest job for it, plans elsewhere,
and for a registered key never queued, what the autotune policy will do about it."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from ..environment import VALIDITY_FIELDS, Environment
from ..protocol import MissReason, TargetEnvironment, Withdrawal, WithdrawalRecord
from .autotune import AutotunePolicy
from .db import Database
from .environments import by_keys, key_params
from .jobs import env_target_keys, row_to_job
from .models import jobs, misses, plans, specs, worker_environments
from .plans import WITHDRAWALS_OF_KEYS, row_to_withdrawal

#: Why a key never registered has no plan: asked by ``explain``, and in a resolve answer, whose client registers it
#: after the miss.
NOT_REGISTERED = ("the server has never seen this graph's spec: a client that misses it registers it (a reader token "
                  "may POST /v1/specs)")
REGISTERED_BY_CLIENT = (
    "the server had never seen this graph's spec: the client that missed it registers it; autotune queues it once it "
    "missed PLANCACHE_AUTOTUNE_MIN_MISSES times here (where the server runs autotune and a worker serves this GPU), "
    "or an admin enqueues it (POST /v1/admin/tune/misses, plancache enqueue)")
#: Job errors are quoted in a reason up to this many characters.
ERROR_CHARS = 300
#: The miss counts of some graph keys on one environment, and the validity fields of every plan of some graph keys, by
#: dialect (:func:`~.environments.by_keys`).
_MISSES = {postgres: by_keys(misses, [misses.c.graph_key, misses.c.count], postgres) for postgres in (False, True)}
_ELSEWHERE = {postgres: by_keys(plans, [plans.c.graph_key, *(plans.c[f] for f in VALIDITY_FIELDS)], postgres,
                                on_env=False) for postgres in (False, True)}


def _newest_jobs(postgres: bool) -> sa.Select[Any]:
    """The id of the newest job of each of some graph keys whose target is one of ``targets`` (those an environment
    matches), read from the index of graph_key, target_key and id: :func:`~.environments.by_keys`."""
    q = by_keys(jobs, [sa.func.max(jobs.c.id)], postgres, on_env=False,
                where=(jobs.c.target_key.in_(sa.bindparam("targets", expanding=True)),))
    return q if postgres else q.group_by(jobs.c.graph_key)


_NEWEST_JOBS = {postgres: _newest_jobs(postgres) for postgres in (False, True)}


class Explanations:
    db: Database

    def explain_misses(self, env: Environment, graph_keys: list[str], *, autotune: AutotunePolicy | None = None,
                       job_errors: bool = True, resolving: bool = False) -> dict[str, MissReason]:
        """A :class:`~plancache.protocol.MissReason` for each distinct key: seven queries whatever the count.
        ``autotune``: the server's policy when it is on (a registered key never queued is then explained by it). A
        queued job on an environment no worker claimed for within the policy's worker window (default when off)
        says so: nothing will run it. ``job_errors``: quote a failed job's error (a worker's text: paths, host
        names), for an admin; else say where an admin reads it. ``resolving``: the reasons of a resolve answer, whose
        client registers a key never registered next (:data:`REGISTERED_BY_CLIENT` says what follows)."""
        keys = list(dict.fromkeys(graph_keys))
        if not keys:
            return {}
        validity = env.validity()
        with self.db.read() as conn:
            postgres = conn.dialect.name == "postgresql"
            counts: dict[str, int] = dict(conn.execute(_MISSES[postgres], key_params(keys, env)).all())
            served_at = conn.execute(sa.select(worker_environments.c.last_claim_at).where(
                worker_environments.c.env_id == env.env_id)).scalar()
            window = (autotune or AutotunePolicy()).worker_window
            served = served_at is not None and served_at >= self.db.now(conn) - window
            registered = set(conn.execute(sa.select(specs.c.graph_key).where(specs.c.graph_key.in_(keys))).scalars())
            ids = [i for i in conn.execute(_NEWEST_JOBS[postgres], {**key_params(keys), "targets": list(
                env_target_keys(env))}).scalars() if i is not None]
            newest = {row.graph_key: row_to_job(row) for row in conn.execute(sa.select(jobs).where(jobs.c.id.in_(ids)))}
            elsewhere: dict[str, list[list[str]]] = {}
            for row in conn.execute(_ELSEWHERE[postgres], key_params(keys)):
                m = row._mapping
                elsewhere.setdefault(m["graph_key"], []).append([f for f in VALIDITY_FIELDS if m[f] != validity[f]])
            withdrawn = {row.graph_key: row_to_withdrawal(row) for row in conn.execute(
                WITHDRAWALS_OF_KEYS[postgres], key_params(keys, env))}
        unserved = "" if served else _unserved(window, served_at)
        queueing = {k: _not_queued(env, counts.get(k, 0), autotune, unserved) for k in keys}
        unregistered = REGISTERED_BY_CLIENT if resolving else NOT_REGISTERED
        return {k: _reason(k, newest.get(k), elsewhere.get(k, []), k in registered, env, withdrawn.get(k), queueing[k],
                           unserved, job_errors, unregistered) for k in keys}


def _unserved(window: timedelta, last_claim: datetime | None) -> str:
    """That no worker claimed jobs for the environment within ``window`` (the last claim, if any)."""
    last = "never" if last_claim is None else f"last at {last_claim:%Y-%m-%d %H:%M} UTC"
    return (f"no worker claimed jobs for this environment in the last {window.total_seconds() / 3600:g} h ({last}): "
            "start a worker on this GPU")


def _not_queued(env: Environment, missed: int, autotune: AutotunePolicy | None, unserved: str) -> str:
    """Why a registered key with no job on ``env`` is not queued, and what will queue it."""
    here = env.describe()
    by_hand = "an admin enqueues it (POST /v1/admin/tune/misses, plancache enqueue)"
    times = f"missed {missed} time{'s' if missed != 1 else ''} on {here}"
    if autotune is None:
        return f"the spec is registered but was never queued for tuning on {here} (autotune is off): {by_hand}"
    if unserved:
        return f"the spec is registered, {times}; autotune does not queue it: {unserved}, or {by_hand}"
    if missed < autotune.min_misses:
        return (f"the spec is registered, {times}; autotune queues it at {autotune.min_misses} misses "
                f"(PLANCACHE_AUTOTUNE_MIN_MISSES), or {by_hand}")
    return (f"the spec is registered, {times}; autotune queues it at its next step, within "
            f"{autotune.jobs_per_hour} automatic jobs per hour for this environment (most-missed first)")


def _reason(key: str, job: Any, elsewhere: list[list[str]], registered: bool, env: Environment,
            withdrawal: WithdrawalRecord | None, not_queued: str, unserved: str, job_errors: bool = True,
            unregistered: str = "") -> MissReason:
    """``unserved``: empty, or why no worker will run a queued job for ``env``; ``unregistered``: the message of a key
    never registered (default :data:`NOT_REGISTERED`)."""
    here = env.describe()
    nearest = min(elsewhere, key=len) if elsewhere else None
    if nearest is not None and not nearest:
        return MissReason(reason="planned", message=f"a tuned plan exists for {here}")
    if withdrawal is not None:
        queued = f"; job {job.id} is {job.status} to tune it again" if job is not None and job.status in (
            "running", "queued") else ""
        if job is not None and job.status == "queued" and unserved:
            queued += f", but {unserved}"
        signed = Withdrawal.model_validate(withdrawal.model_dump(include=set(Withdrawal.model_fields)))
        return MissReason(reason="withdrawn", withdrawal=signed, job_id=job.id if queued else None,
                          message=f"the plan for {here} (revision {withdrawal.withdrawn_revision}) was withdrawn by an "
                                  f"admin on {withdrawal.created_at:%Y-%m-%d %H:%M} UTC: "
                                  f"{withdrawal.reason[:ERROR_CHARS]}{queued}")
    if job is not None and job.status in ("running", "queued"):
        verb = "being tuned" if job.status == "running" else "queued for tuning"
        idle = f", but {unserved}" if job.status == "queued" and unserved else ""
        return MissReason(reason=job.status, message=f"{verb} (job {job.id}) for {here}{idle}", job_id=job.id)
    if job is not None and job.status == "failed":
        error = ((job.error or "no error recorded")[:ERROR_CHARS] if job_errors
                 else f"an admin reads its error (GET /v1/jobs/{job.id}, plancache explain with an admin token)")
        return MissReason(reason="failed", job_id=job.id,
                          message=f"tuning failed (job {job.id}, {job.attempts} of {job.max_attempts} attempts): {error}")
    if nearest is not None:
        fields = ", ".join(f"{f} {getattr(env, f)}" for f in nearest)
        return MissReason(reason="other_environments", differs=nearest,
                          message=f"tuned only for other environments; the nearest differs in {', '.join(nearest)} "
                                  f"(this one has {fields}): enqueue it for this environment")
    if job is not None and job.status == "succeeded" and job.target == TargetEnvironment.exactly(env):
        return MissReason(reason="not_queued", job_id=job.id, message=(
            f"tuned for {here} by job {job.id}, but its plan is no longer stored (plans gc deletes the records of "
            "environments it does not keep); autotune does not queue a graph once tuned for an environment: an admin "
            "enqueues it again (POST /v1/admin/tune, plancache enqueue)"))
    if registered:
        return MissReason(reason="not_queued", message=not_queued)
    return MissReason(reason="not_registered", message=unregistered or NOT_REGISTERED)
