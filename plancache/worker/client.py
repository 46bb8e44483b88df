"""HTTP calls of the job protocol and plan upload, with capped exponential backoff and jitter.

Transient failures (connection refused or reset, timeouts, 429 and 500/502/503/504) are retried
for as long as the caller allows; a 4xx answer is raised as the matching
:class:`~plancache.errors.PlanCacheError` (``409 lease_lost`` → :class:`LeaseLost`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ..environment import Environment
from ..errors import (
    Conflict,
    EnvironmentMismatch,
    Forbidden,
    IntegrityError,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    PlanCacheError,
    SpecError,
    Unauthorized,
)
from ..protocol import (
    ClaimRequest,
    ClaimResponse,
    CompleteRequest,
    FailRequest,
    Job,
    JobList,
    LeaseRequest,
    PlanRecord,
    PlanUpload,
    SpecCreated,
    TuneRequest,
)

log = logging.getLogger("plancache.worker")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_BY_CODE: dict[str, type[PlanCacheError]] = {
    cls.code: cls
    for cls in (SpecError, NotFound, Conflict, IntegrityError, LeaseLost, Unauthorized, Forbidden, PayloadTooLarge,
                EnvironmentMismatch)
}


class ServerUnavailable(PlanCacheError):
    """The server could not be reached (or kept answering 5xx/429) for as long as the caller was willing to retry."""

    code = "server_unavailable"
    http_status = 503


class RequestRefused(PlanCacheError):
    """The server refused a request with an error code this client has no class for."""

    def __init__(self, message: str, code: str, http_status: int) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: attempt ``n`` waits between half and all of ``min(cap, initial * factor**n)``."""

    initial: float = 0.2
    factor: float = 2.0
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        ceiling = min(self.cap, self.initial * self.factor ** min(attempt, 64))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


def error_from_response(resp: httpx.Response) -> PlanCacheError:
    """The domain error a 4xx/5xx response stands for, from its ``{"error": {"code", "message"}}`` body."""
    try:
        body = resp.json()["error"]
        code, message = str(body["code"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        code, message = f"http_{resp.status_code}", resp.text[:500] or resp.reason_phrase
    message = f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {code}: {message}"
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else RequestRefused(message, code, resp.status_code)


class JobClient:
    """A plancache server as seen by a worker or an admin command.

    ``retry_for`` on each call: ``None`` retries transient failures until ``stop`` is set,
    a number of seconds bounds the retrying, ``0`` makes a single attempt. Waits end early
    when ``stop`` is set; the call then raises :class:`ServerUnavailable`.
    """

    def __init__(self, server_url: str, token: str | None, *, backoff: Backoff = Backoff(),
                 connect_timeout: float = 2.0, read_timeout: float = 30.0, stop: threading.Event | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not server_url.startswith(("http://", "https://")):
            raise ValueError(f"server URL {server_url!r} must start with http:// or https://")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.server_url = server_url.rstrip("/")
        self.backoff = backoff
        self.stop = stop or threading.Event()
        self._http = httpx.Client(base_url=self.server_url, headers=headers, transport=transport,
                                  timeout=httpx.Timeout(read_timeout, connect=connect_timeout))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "JobClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ transport

    def request(self, method: str, path: str, *, body: Any = None, retry_for: float | None = None,
                timeout: float | None = None) -> httpx.Response:
        """Send, retrying transient failures; return a 2xx response or raise the mapped error.
        ``timeout`` overrides the client's timeouts for this call."""
        deadline = None if retry_for is None else time.monotonic() + retry_for
        extra: dict[str, Any] = {} if timeout is None else {"timeout": httpx.Timeout(timeout)}
        attempt = 0
        while True:
            try:
                resp = self._http.request(method, path, json=body, **extra)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code not in RETRY_STATUSES:
                    raise error_from_response(resp)
                problem = str(error_from_response(resp))
            wait = self.backoff.delay(attempt)
            attempt += 1
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if wait <= 0 or self.stop.is_set():
                raise ServerUnavailable(f"{method} {self.server_url}{path}: {problem} (after {attempt} attempt(s))")
            log.warning("%s %s failed (%s); retrying in %.2fs", method, path, problem, wait)
            if self.stop.wait(wait):
                raise ServerUnavailable(f"{method} {self.server_url}{path}: {problem} (stopping)")

    # ------------------------------------------------------------ job protocol

    def claim(self, environment: Environment, worker_id: str, *, retry_for: float | None = None) -> ClaimResponse | None:
        """A job for ``environment`` with a lease, or ``None`` when the queue has none."""
        body = ClaimRequest(environment=environment, worker_id=worker_id).model_dump(mode="json")
        resp = self.request("POST", "/v1/jobs/claim", body=body, retry_for=retry_for)
        return None if resp.status_code == 204 else ClaimResponse.model_validate(resp.json())

    def heartbeat(self, job_id: int, lease: LeaseRequest, *, retry_for: float | None = 0,
                  timeout: float | None = None) -> None:
        self.request("POST", f"/v1/jobs/{job_id}/heartbeat", body=lease.model_dump(mode="json"), retry_for=retry_for,
                     timeout=timeout)

    def complete(self, job_id: int, req: CompleteRequest, *, retry_for: float | None = None) -> None:
        self.request("POST", f"/v1/jobs/{job_id}/complete", body=req.model_dump(mode="json"), retry_for=retry_for)

    def fail(self, job_id: int, req: FailRequest, *, retry_for: float | None = None) -> None:
        self.request("POST", f"/v1/jobs/{job_id}/fail", body=req.model_dump(mode="json"), retry_for=retry_for)

    # ------------------------------------------------------------ plans, specs, admin

    def put_plan(self, upload: PlanUpload, *, retry_for: float | None = None) -> PlanRecord:
        resp = self.request("PUT", "/v1/plans", body=upload.model_dump(mode="json"), retry_for=retry_for)
        return PlanRecord.model_validate(resp.json())

    def register_spec(self, spec: dict[str, Any], *, retry_for: float | None = None) -> SpecCreated:
        resp = self.request("POST", "/v1/specs", body=spec, retry_for=retry_for)
        return SpecCreated.model_validate(resp.json())

    def enqueue(self, req: TuneRequest, *, retry_for: float | None = None) -> list[Job]:
        resp = self.request("POST", "/v1/admin/tune", body=req.model_dump(mode="json"), retry_for=retry_for)
        return JobList.model_validate(resp.json()).jobs

    def job(self, job_id: int, *, retry_for: float | None = None) -> Job:
        return Job.model_validate(self.request("GET", f"/v1/jobs/{job_id}", retry_for=retry_for).json())
