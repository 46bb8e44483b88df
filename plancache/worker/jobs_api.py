"""The job protocol (claim, heartbeat, complete, fail), plan upload and the admin's job calls, on the shared
HTTP layer (:mod:`plancache.http`). A refusal arrives as its error class (``409 lease_lost`` →
:class:`~plancache.errors.LeaseLost`); a server that cannot answer as
:class:`~plancache.errors.ServerUnavailable`, once the client's :class:`~plancache.http.Retry` gives up.
"""

from __future__ import annotations

import secrets
import time

from .._httpx import httpx
from ..environment import Environment
from ..errors import PlanCacheError
from ..http import HttpClient, Retry, json_as
from ..protocol import (
    LEASE_TOKEN_BYTES,
    CancelRequest,
    ClaimRequest,
    ClaimResponse,
    CompleteRequest,
    FailRequest,
    Job,
    JobList,
    JobStatus,
    LeaseRequest,
    PlanRecord,
    PlanUpload,
    TuneRequest,
)
from ..validation import from_answer

#: Job calls carry plan uploads (up to the server's ``max_blob_bytes``): they wait longer for an answer
#: than the client's resolve does.
READ_TIMEOUT = 30.0


class JobsApi:
    """The job calls of a worker or an admin command, on ``http``."""

    def __init__(self, http: HttpClient) -> None:
        self.http = http

    @classmethod
    def open(cls, server_url: str, token: str | None, *, retry: Retry = Retry()) -> JobsApi:
        """On a new :class:`~plancache.http.HttpClient` with ``retry``, the settings' connect timeout and a
        :data:`READ_TIMEOUT` read timeout."""
        return cls(HttpClient(server_url, token, agent="worker", policies=[retry], read_timeout=READ_TIMEOUT))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> JobsApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def claim(self, environment: Environment, worker_id: str) -> ClaimResponse | None:
        """A job for ``environment`` with a lease, or ``None`` when the queue has none. The claim proposes its own
        lease token, so that the same claim sent again after a lost answer gets the job it leased then."""
        body = ClaimRequest(environment=environment, worker_id=worker_id,
                            lease_token=secrets.token_urlsafe(LEASE_TOKEN_BYTES)).model_dump(mode="json")
        return self.http.read("POST", "/v1/jobs/claim", _claimed, body=body)

    # heartbeat, complete and fail carry the claim's secret lease token: they only work from the API token
    # that claimed the job (403 ``not_lease_holder`` → :class:`~plancache.errors.NotLeaseHolder` otherwise).

    def heartbeat(self, job_id: int, lease: LeaseRequest, *, timeout: float | None = None) -> None:
        """Extend the lease: one attempt (the caller beats again on its own schedule), its whole answer within
        twice ``timeout`` (connect and answer): an answer trickled byte by byte cannot hold the beat past it."""
        self.http.request("POST", f"/v1/jobs/{job_id}/heartbeat", body=lease.model_dump(mode="json"), timeout=timeout,
                          retry=False, deadline=None if timeout is None else time.monotonic() + 2 * timeout)

    def complete(self, job_id: int, req: CompleteRequest) -> None:
        self.http.request("POST", f"/v1/jobs/{job_id}/complete", body=req.model_dump(mode="json"))

    def fail(self, job_id: int, req: FailRequest) -> None:
        # defaults left out: ``released`` reaches only servers that know it (an older one refuses unknown fields)
        self.http.request("POST", f"/v1/jobs/{job_id}/fail", body=req.model_dump(mode="json", exclude_defaults=True))

    def put_plan(self, upload: PlanUpload) -> PlanRecord:
        """``PUT /v1/plans``: an admin's plan, outside the job queue (a job's plan goes with :meth:`complete`)."""
        return self.http.read("PUT", "/v1/plans", json_as(PlanRecord), body=upload.model_dump(mode="json"))

    def blob_size(self, sha256: str) -> int | None:
        """``HEAD /v1/blobs/{sha256}``: the stored blob's size, None when the server has none."""
        try:
            return self.http.read("HEAD", f"/v1/blobs/{sha256}", lambda r: int(r.headers["content-length"]))
        except PlanCacheError as exc:
            if exc.http_status == 404:
                return None
            raise

    def put_blob(self, sha256: str, data: bytes, *, job_id: int | None = None, lease: LeaseRequest | None = None
                 ) -> None:
        """``PUT /v1/blobs/{sha256}`` with the raw bytes, unless ``HEAD`` says the server has them. A worker token
        sends the ``job_id`` and ``lease`` it holds (the server checks them as heartbeat does); an admin needs none."""
        if self.blob_size(sha256) == len(data):
            return
        headers = {} if job_id is None or lease is None else {
            "X-Plancache-Job": str(job_id), "X-Plancache-Worker": lease.worker_id, "X-Plancache-Lease": lease.lease_token}
        self.http.request("PUT", f"/v1/blobs/{sha256}", content=data, headers=headers)

    def enqueue(self, req: TuneRequest) -> list[Job]:
        return self.http.read("POST", "/v1/admin/tune", json_as(JobList), body=req.model_dump(mode="json")).jobs

    def job(self, job_id: int) -> Job:
        return self.http.read("GET", f"/v1/jobs/{job_id}", json_as(Job))

    def jobs(self, *, status: JobStatus | None = None, limit: int = 100) -> list[Job]:
        """``GET /v1/jobs`` (admin): jobs, newest first."""
        query = f"?limit={limit}" + (f"&status={status}" if status else "")
        return self.http.read("GET", f"/v1/jobs{query}", json_as(JobList)).jobs

    def cancel(self, job_id: int, reason: str = "") -> Job:
        """``POST /v1/admin/jobs/{job_id}/cancel``: end a queued or running job (admin)."""
        return self.http.read("POST", f"/v1/admin/jobs/{job_id}/cancel", json_as(Job),
                              body=CancelRequest(reason=reason).model_dump(mode="json"))


def _claimed(resp: httpx.Response) -> ClaimResponse | None:
    return None if resp.status_code == 204 else from_answer(ClaimResponse, resp.content)
