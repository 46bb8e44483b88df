"""The job queue over HTTP: listing and detail, and the worker protocol (claim, heartbeat, complete, fail).

A lease belongs to the API token that claimed it and is proved by the secret ``lease_token`` of the claim's
answer (never shown again): heartbeat, complete and fail need both (409 ``lease_lost`` for a token that is
not the current lease's, 403 ``not_lease_holder`` for the right one from another API token).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from ...protocol import (
    GRAPH_KEY_PATTERN,
    ClaimRequest,
    ClaimResponse,
    CompleteRequest,
    FailRequest,
    Job,
    JobId,
    JobList,
    JobStatus,
    LeaseRequest,
    PlanRecord,
)
from ...validation import INT32_MAX
from ..auth import Admin, Principal, Worker
from ..bodies import CheckedRoute
from ..deps import MetricsDep, SettingsDep, StoreDep
from ..errors import documented_errors
from ..uploads import accept_upload, publish_job_plan

# /v1/jobs/{job_id:int} matches digits only, so a wrong method on /v1/jobs/claim is answered 405 with its own
# Allow header (not a malformed job id, 422); a job id that is not a number is 404.
router = APIRouter(route_class=CheckedRoute, tags=["jobs"])

JobIdPath = Annotated[JobId, Path()]
_LEASE_ERRORS = documented_errors(401, 403, 404, 409, 422, 503)


@router.get("/v1/jobs", response_model=JobList, summary="Jobs, newest first", responses=documented_errors(401, 403, 422, 503))
def list_jobs(store: StoreDep, _: Admin, status: JobStatus | None = None,
              graph_key: Annotated[str | None, Query(pattern=GRAPH_KEY_PATTERN)] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100,
              offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0) -> JobList:
    return JobList(jobs=store.list_jobs(status=status, graph_key=graph_key, limit=limit, offset=offset))


@router.post("/v1/jobs/claim", response_model=ClaimResponse, response_model_exclude_unset=True,
             summary="Lease the best job this environment can run",
             responses={204: {"description": "no job for this environment"}, **documented_errors(401, 403, 422, 503)})
def claim(req: ClaimRequest, store: StoreDep, settings: SettingsDep, principal: Worker) -> ClaimResponse | Response:
    """The answer's ``lease_token`` is the lease's secret, shown this once (or the one the worker proposed); only this
    API token may use it. A claim sent again with the ``lease_token`` it proposed, its answer lost, gets the job it
    leased then. ``min_revision``: the published plan's revision must be above it (a withdrawal's)."""
    claimed = store.claim(req.environment, req.worker_id, lease_seconds=settings.lease_seconds,
                          holder=principal.identity, lease_token=req.lease_token)
    if claimed is None:
        return Response(status_code=204)
    job = claimed.job
    spec = store.get_spec(job.graph_key)
    if spec is None:  # jobs reference specs by foreign key: a job without one is a broken store
        raise RuntimeError(f"job {job.id} references graph key {job.graph_key}, which has no stored spec")
    assert job.lease_expires_at is not None
    answer = ClaimResponse(job=job_view(job, principal), spec=spec, lease_token=claimed.lease_token,
                           lease_expires_at=job.lease_expires_at)
    floor = store.revision_floor(job.graph_key, req.environment)
    if floor:  # sent only when there is one: a worker of an earlier release refuses a field it does not know
        answer.min_revision = floor
    return answer


def job_view(job: Job, principal: Principal) -> Job:
    """``job`` as ``principal`` may see it: an admin sees whose lease it is (worker id and API token), the
    lease's holder its own worker id, anyone else neither. No one is shown a lease token."""
    if principal.may("admin"):
        return job
    mine = job.lease_holder is not None and job.lease_holder == principal.identity
    return job.model_copy(update={"lease_holder": None, "lease_owner": job.lease_owner if mine else None})


@router.get("/v1/jobs/{job_id:int}", response_model=Job, summary="One job", responses=documented_errors(401, 403, 404, 422, 503))
def read_job(job_id: JobIdPath, store: StoreDep, principal: Worker) -> Job:
    """Status and progress; the lease's owner only for admins and the lease's holder."""
    return job_view(store.get_job(job_id), principal)


@router.post("/v1/jobs/{job_id}/heartbeat", response_model=Job, summary="Extend a held lease", responses=_LEASE_ERRORS)
def heartbeat(job_id: JobIdPath, req: LeaseRequest, store: StoreDep, settings: SettingsDep, principal: Worker) -> Job:
    job = store.heartbeat(job_id, req.worker_id, req.lease_token, lease_seconds=settings.lease_seconds,
                          holder=principal.identity)
    return job_view(job, principal)


@router.post("/v1/jobs/{job_id}/complete", response_model=PlanRecord, summary="Publish the job's plan and finish it",
             responses={**_LEASE_ERRORS, **documented_errors(413)})
def complete(job_id: JobIdPath, req: CompleteRequest, store: StoreDep, settings: SettingsDep, metrics: MetricsDep,
             principal: Worker) -> PlanRecord:
    """One transaction publishes the plan and marks the job succeeded; a worker whose lease was taken
    over gets 409 ``lease_lost``, another API token 403 ``not_lease_holder``. The same holder repeating a
    completion that went through gets the record. ``plan`` is the record alone, as for ``PUT /v1/plans``: its blob
    was uploaded with ``PUT /v1/blobs/{sha256}`` (404 otherwise; ``blob_b64`` is 422)."""
    plan = req.plan
    accept_upload(plan, principal, store, settings, job=(job_id, req.worker_id, req.lease_token))
    record, repeated = publish_job_plan(store, plan, job_id=job_id, worker_id=req.worker_id,
                                        lease_token=req.lease_token, principal=principal)
    if not repeated:
        metrics.tuning_seconds.observe(plan.tuning_seconds)
    return record


@router.post("/v1/jobs/{job_id}/fail", response_model=Job, summary="Report a failed attempt", responses=_LEASE_ERRORS)
def fail(job_id: JobIdPath, req: FailRequest, store: StoreDep, principal: Worker) -> Job:
    """Back to ``queued`` when ``retryable`` and attempts are left, else ``failed``."""
    job = store.fail(job_id, req.worker_id, req.lease_token, req.error, retryable=req.retryable,
                     holder=principal.identity, released=req.released)
    return job_view(job, principal)
