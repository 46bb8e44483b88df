"""The plancache server as the client sees it: resolve plans, fetch blobs, register specs.

Short connect/read timeouts (``Settings.connect_timeout`` / ``read_timeout``) and a circuit
breaker: one failure (unreachable, timeout, 5xx/429, refused credentials, a malformed answer)
turns the remote off for ``cooldown`` seconds, during which every call fails at once with
:class:`RemoteUnavailable` (``skipped=True``) instead of waiting on the network again. The
first call after the cool-down tries the server again (and re-arms the breaker if it fails).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import ValidationError

from ..environment import Environment
from ..errors import PlanCacheError
from ..protocol import ResolveRequest, ResolveResponse, SpecCreated
from ..spec import GraphSpec

log = logging.getLogger("plancache.client")

#: Statuses that mean "the server cannot help now" and trip the breaker (so does any 5xx). Other 4xx
#: answers are about this one request (e.g. a spec the server refuses) and do not.
TRIP_STATUSES = frozenset({401, 403, 429})


class RemoteUnavailable(PlanCacheError):
    """The server could not be used; ``skipped`` is true when the breaker was open and no request was sent."""

    code = "server_unavailable"
    http_status = 503

    def __init__(self, message: str, *, skipped: bool = False) -> None:
        super().__init__(message)
        self.skipped = skipped


class RemoteRefused(PlanCacheError):
    """The server answered this request with a 4xx error (its code and status are kept)."""

    def __init__(self, message: str, code: str, http_status: int) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status


def _describe(resp: httpx.Response) -> tuple[str, str]:
    """``(code, message)`` from an ``{"error": {"code", "message"}}`` body, or from the status line."""
    try:
        body = resp.json()["error"]
        return str(body["code"]), str(body["message"])[:500]
    except (ValueError, KeyError, TypeError):
        return f"http_{resp.status_code}", (resp.text[:200] or resp.reason_phrase)


class Remote:
    """HTTP access to one plancache server with a circuit breaker."""

    def __init__(self, server_url: str, *, token: str | None = None, connect_timeout: float = 1.0,
                 read_timeout: float = 5.0, cooldown: float = 30.0, max_keys_per_request: int = 1000,
                 transport: httpx.BaseTransport | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not server_url.startswith(("http://", "https://")):
            raise ValueError(f"server URL {server_url!r} must start with http:// or https://")
        if cooldown < 0 or connect_timeout <= 0 or read_timeout <= 0 or max_keys_per_request < 1:
            raise ValueError("timeouts must be > 0, cooldown >= 0 and max_keys_per_request >= 1")
        self.server_url = server_url.rstrip("/")
        self.cooldown = cooldown
        self.max_keys_per_request = max_keys_per_request
        self._clock = clock
        self._lock = threading.Lock()
        self._off_until: float | None = None
        self._last_failure = ""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.server_url, headers=headers, transport=transport,
                                  timeout=httpx.Timeout(read_timeout, connect=connect_timeout))

    # ------------------------------------------------------------ breaker

    @property
    def is_off(self) -> bool:
        """True while the breaker is open (the cool-down after a failure has not passed)."""
        with self._lock:
            return self._off_until is not None and self._clock() < self._off_until

    def _trip(self, problem: str) -> RemoteUnavailable:
        with self._lock:
            self._off_until = self._clock() + self.cooldown
            self._last_failure = problem
        log.warning("plancache server %s unusable (%s); not asking it again for %.0f s",
                    self.server_url, problem, self.cooldown)
        return RemoteUnavailable(f"{self.server_url}: {problem}")

    def _request(self, method: str, path: str, body: Any = None, *, auth_trips: bool = True) -> httpx.Response:
        """A 2xx response, or :class:`RemoteUnavailable` (breaker tripped) / :class:`RemoteRefused`.
        ``auth_trips=False``: a 401/403 is this call's business only (e.g. a reader token may not register specs)."""
        with self._lock:
            if self._off_until is not None:
                left = self._off_until - self._clock()
                if left > 0:
                    raise RemoteUnavailable(f"{self.server_url} is off for another {left:.1f} s after: "
                                            f"{self._last_failure}", skipped=True)
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:  # connect/read timeouts, refused, reset, protocol errors
            raise self._trip(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if resp.status_code >= 400:
            code, message = _describe(resp)
            problem = f"{method} {path}: {resp.status_code} {code}: {message}"
            auth = resp.status_code in (401, 403)
            if resp.status_code >= 500 or (resp.status_code in TRIP_STATUSES and (auth_trips or not auth)):
                raise self._trip(problem)
            raise RemoteRefused(problem, code, resp.status_code)
        with self._lock:
            self._off_until = None
        return resp

    def _parse(self, resp: httpx.Response, model: type[Any]) -> Any:
        try:
            return model.model_validate_json(resp.content)
        except ValidationError as exc:
            raise self._trip(f"{resp.request.method} {resp.request.url.path}: malformed answer: "
                             f"{exc.errors()[0].get('msg', exc)}") from None

    # ------------------------------------------------------------ calls

    def resolve(self, environment: Environment, graph_keys: list[str], *, include_blobs: bool = True) -> ResolveResponse:
        """``POST /v1/plans/resolve``: the records (and blobs) of ``graph_keys`` for ``environment``.
        One round trip for up to ``max_keys_per_request`` keys. The server records the missing keys as misses."""
        keys = list(dict.fromkeys(graph_keys))
        plans: dict[str, Any] = {}
        missing: list[str] = []
        for start in range(0, len(keys), self.max_keys_per_request):
            req = ResolveRequest(environment=environment, graph_keys=keys[start:start + self.max_keys_per_request],
                                 include_blobs=include_blobs)
            part: ResolveResponse = self._parse(
                self._request("POST", "/v1/plans/resolve", req.model_dump(mode="json")), ResolveResponse)
            plans.update(part.plans)
            missing.extend(part.missing)
        return ResolveResponse(plans=plans, missing=missing)

    def fetch_blob(self, sha256: str) -> bytes:
        """``GET /v1/blobs/{sha256}`` (unverified bytes)."""
        return self._request("GET", f"/v1/blobs/{sha256}").content

    def register_spec(self, spec: GraphSpec) -> str:
        """``POST /v1/specs``: store the spec so an admin can tune its key; returns the server's graph key.
        Needs a worker or admin token; a refusal does not turn the remote off."""
        created: SpecCreated = self._parse(self._request("POST", "/v1/specs", spec.to_json(), auth_trips=False), SpecCreated)
        return created.graph_key

    def close(self) -> None:
        self._http.close()
