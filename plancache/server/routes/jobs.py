"""The job queue over HTTP: listing and detail, and the worker protocol (claim, heartbeat, complete, fail)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from ...errors import LeaseLost
from ...protocol import (
    GRAPH_KEY_PATTERN,
    ClaimRequest,
    ClaimResponse,
    CompleteRequest,
    FailRequest,
    Job,
    JobList,
    JobStatus,
    LeaseRequest,
    PlanRecord,
)
from ..auth import Admin, Worker
from ..bodies import CheckedRoute
from ..deps import MetricsDep, SettingsDep, StoreDep
from ..errors import documented_errors
from ..uploads import accept_upload

# Routes are matched in order: /v1/jobs/claim comes before /v1/jobs/{job_id}, so a wrong method on it
# is answered 405 with its own Allow header.
router = APIRouter(route_class=CheckedRoute, tags=["jobs"])

JobId = Annotated[int, Path(ge=1, le=2**31 - 1)]
_LEASE_ERRORS = documented_errors(401, 403, 404, 409, 422, 503)


@router.get("/v1/jobs", response_model=JobList, summary="Jobs, newest first", responses=documented_errors(401, 403, 422, 503))
def list_jobs(store: StoreDep, _: Admin, status: JobStatus | None = None,
              graph_key: Annotated[str | None, Query(pattern=GRAPH_KEY_PATTERN)] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100,
              offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0) -> JobList:
    return JobList(jobs=store.list_jobs(status=status, graph_key=graph_key, limit=limit, offset=offset))


@router.post("/v1/jobs/claim", response_model=ClaimResponse, summary="Lease the best job this environment can run",
             responses={204: {"description": "no job for this environment"}, **documented_errors(401, 403, 422, 503)})
def claim(req: ClaimRequest, store: StoreDep, settings: SettingsDep, _: Worker) -> ClaimResponse | Response:
    job = store.claim(req.environment, req.worker_id, lease_seconds=settings.lease_seconds)
    if job is None:
        return Response(status_code=204)
    spec = store.get_spec(job.graph_key)
    if spec is None:  # jobs reference specs by foreign key: a job without one is a broken store
        raise RuntimeError(f"job {job.id} references graph key {job.graph_key}, which has no stored spec")
    assert job.lease_expires_at is not None
    return ClaimResponse(job=job, spec=spec, lease_token=job.fencing_token, lease_expires_at=job.lease_expires_at)


@router.get("/v1/jobs/{job_id}", response_model=Job, summary="One job", responses=documented_errors(401, 403, 404, 422, 503))
def read_job(job_id: JobId, store: StoreDep, _: Worker) -> Job:
    return store.get_job(job_id)


@router.post("/v1/jobs/{job_id}/heartbeat", response_model=Job, summary="Extend a held lease", responses=_LEASE_ERRORS)
def heartbeat(job_id: JobId, req: LeaseRequest, store: StoreDep, settings: SettingsDep, _: Worker) -> Job:
    return store.heartbeat(job_id, req.worker_id, req.lease_token, lease_seconds=settings.lease_seconds)


@router.post("/v1/jobs/{job_id}/complete", response_model=PlanRecord, summary="Publish the job's plan and finish it",
             responses={**_LEASE_ERRORS, **documented_errors(413)})
def complete(job_id: JobId, req: CompleteRequest, store: StoreDep, settings: SettingsDep, metrics: MetricsDep,
             principal: Worker) -> PlanRecord:
    """One transaction publishes the plan and marks the job succeeded; a worker whose lease was taken
    over gets 409 ``lease_lost``. The same holder repeating a completion that went through gets the record."""
    plan = req.plan
    blob = accept_upload(plan, principal, store, settings, loc=("body", "plan"))
    try:
        record = store.publish_plan(plan, blob, job_id=job_id, worker_id=req.worker_id, lease_token=req.lease_token,
                                    replace=plan.replace)
    except LeaseLost:
        job = store.get_job(job_id)
        done = store.get_plan(plan.graph_key, plan.environment) if job.status == "succeeded" else None
        if (done is None or done.job_id != job_id or done.blob_sha256 != plan.blob_sha256
                or job.lease_owner != req.worker_id or job.fencing_token != req.lease_token):
            raise
        return done
    metrics.tuning_seconds.observe(plan.tuning_seconds)
    return record


@router.post("/v1/jobs/{job_id}/fail", response_model=Job, summary="Report a failed attempt", responses=_LEASE_ERRORS)
def fail(job_id: JobId, req: FailRequest, store: StoreDep, _: Worker) -> Job:
    """Back to ``queued`` when ``retryable`` and attempts are left, else ``failed``."""
    return store.fail(job_id, req.worker_id, req.lease_token, req.error, retryable=req.retryable)
