"""Admin: enqueue tuning (by graph keys or specs, for one or more targets), misses and "tune the top N misses",
cancelling jobs, withdrawing plans."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError

from ...environment import ENV_ID_PATTERN
from ...errors import BadRequest, NotFound, PayloadTooLarge, SignatureError, SpecError
from ...protocol import (
    CancelRequest,
    EnqueueMissesRequest,
    Job,
    JobList,
    MissList,
    SignedWithdrawal,
    TargetEnvironment,
    TuneRequest,
    WithdrawalRecord,
)
from ...spec import graph_key
from ..auth import Admin
from ..bodies import CheckedRoute
from ..deps import StoreDep
from ..errors import documented_errors
from .jobs import JobIdPath

router = APIRouter(route_class=CheckedRoute, tags=["admin"])

#: Most jobs (graph keys × targets) one tune request may create.
MAX_TUNE_JOBS = 10_000


def _unique(jobs: list[Job]) -> list[Job]:
    return list({job.id: job for job in jobs}.values())


@router.post("/v1/admin/tune", response_model=JobList, summary="Enqueue tuning jobs: each graph key × each target",
             responses=documented_errors(401, 403, 404, 413, 422, 503))
def tune(req: TuneRequest, store: StoreDep, _: Admin) -> JobList:
    """Specs are validated and registered first; every graph key must have a stored spec (404 names the first
    that has none). A queued or running job for the same key and target is returned instead of a new one."""
    spec_keys = []
    for i, spec in enumerate(req.specs):
        try:
            spec_keys.append(graph_key(spec))
        except SpecError as exc:
            raise SpecError(f"specs[{i}]: {exc.message}") from None
    keys = list(dict.fromkeys([*req.graph_keys, *spec_keys]))
    if not keys:
        raise RequestValidationError([{"loc": ("body",), "msg": "give at least one of graph_keys or specs",
                                       "type": "value_error"}])
    if len(keys) * len(req.targets) > MAX_TUNE_JOBS:
        raise PayloadTooLarge(f"{len(keys)} graph keys × {len(req.targets)} targets is more than {MAX_TUNE_JOBS} jobs")
    unknown = [k for k in dict.fromkeys(req.graph_keys) if k not in spec_keys and store.get_spec(k) is None]
    if unknown:
        others = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise NotFound(f"no spec stored for graph key {unknown[0][:80]!r}{others}; register it or send it in specs")
    for key, spec in zip(spec_keys, req.specs):
        store.put_spec(key, spec)
    jobs = [store.enqueue(key, target, priority=req.priority, max_attempts=req.max_attempts, source=req.source)[0]
            for key in keys for target in req.targets]
    return JobList(jobs=_unique(jobs))


@router.post("/v1/admin/tune/misses", response_model=JobList, summary="Enqueue the most-missed graph keys of an environment",
             responses=documented_errors(401, 403, 422, 503))
def tune_misses(req: EnqueueMissesRequest, store: StoreDep, _: Admin) -> JobList:
    """The ``top`` keys missed most on ``environment`` that have a stored spec and still no plan there,
    each enqueued for exactly that environment."""
    target = TargetEnvironment.exactly(req.environment)
    keys = store.top_misses(req.environment, req.top, require_spec=True)
    return JobList(jobs=_unique([store.enqueue(key, target, priority=req.priority)[0] for key in keys]))


@router.post("/v1/admin/jobs/{job_id}/cancel", response_model=Job, summary="End a queued or running job",
             responses=documented_errors(401, 403, 404, 409, 422, 503))
def cancel_job(job_id: JobIdPath, store: StoreDep, principal: Admin, req: CancelRequest | None = None) -> Job:
    """The job ends ``failed`` with the error ``cancelled by <token name>[: reason]`` and is not claimed again; the
    worker holding it, if any, is refused its next heartbeat and stops tuning. 409 when the job has ended already.
    The body (``{"reason": "..."}``) is optional."""
    return store.cancel_job(job_id, by=principal.name, reason=req.reason if req is not None else "")


@router.get("/v1/misses", response_model=MissList, summary="Recorded misses, most counted first",
            responses=documented_errors(401, 403, 422, 503))
def list_misses(store: StoreDep, _: Admin,
                env_id: Annotated[str | None, Query(pattern=ENV_ID_PATTERN, description="an environment id")] = None,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> MissList:
    return MissList(misses=store.list_misses(env_id=env_id, limit=limit))


@router.post("/v1/admin/withdrawals", response_model=WithdrawalRecord, status_code=201,
             summary="Withdraw a plan: resolve stops serving it, clients that learn of it drop their copies",
             responses={200: {"model": WithdrawalRecord, "description": "this withdrawal was stored already"},
                        **documented_errors(400, 401, 403, 404, 409, 422, 503)})
def withdraw(withdrawal: SignedWithdrawal, store: StoreDep, request: Request, response: Response,
             _: Admin) -> WithdrawalRecord:
    """A withdrawal signed like a plan record (``plancache plans withdraw`` makes one; the server stores the envelope,
    clients verify it) naming the stored plan's revision and blob: the plan's record is deleted, so resolve no
    longer serves it, explain answers ``withdrawn`` with the signed withdrawal, and a client that verifies it against
    its trusted keys drops its disk copy and refuses that plan from then on. 404: no plan is stored for the key and
    environment; 409 ``stale_revision``: the stored plan is another revision (replaced meanwhile), or the
    withdrawal's revision is not above the stored plan's (or withdrawal's). Only a plan of a higher revision than the
    withdrawal's is accepted for the key and environment afterwards. 400 ``bad_request``: the withdrawal does not
    verify against the server's ``PLANCACHE_TRUSTED_KEYS`` (or the server has none), so no client would act on it
    while the plan would be gone for cold hosts."""
    trusted = request.app.state.trusted_keys
    if not len(trusted):
        raise BadRequest("this server has no PLANCACHE_TRUSTED_KEYS to verify a withdrawal with: set it to the public "
                         "keys the clients trust (those of `plancache plans withdraw --signing-key`)")
    try:
        trusted.verify_withdrawal(withdrawal, what=f"withdrawal of plan {withdrawal.graph_key[:12]}")
    except SignatureError as exc:
        raise BadRequest(f"{exc.message} ({exc.reason.value}): no client would act on it; sign it with a key in the "
                         "server's PLANCACHE_TRUSTED_KEYS") from None
    before = store.get_withdrawals(withdrawal.environment, [withdrawal.graph_key]).get(withdrawal.graph_key)
    record = store.withdraw_plan(withdrawal)
    if before is not None and before.revision == record.revision:
        response.status_code = 200
    return record
