"""The plancache server as the client sees it: resolve plans, fetch blobs, register specs, explain misses.

Calls go through a :class:`~plancache.http.HttpClient`; the :class:`~plancache.client.PlanCache` gives its
own short timeouts (``Settings.connect_timeout`` / ``read_timeout``) and a
:class:`~plancache.http.CircuitBreaker`: one failure (unreachable, timeout, 5xx/429, refused credentials,
a malformed answer, an answer over its size limit or past its deadline) turns the remote off for the
cool-down, during which every call fails at once with :class:`~plancache.errors.ServerUnavailable`
(``skipped=True``) instead of waiting on the network again.

A blob comes from where the resolve answer says (``blob_url``): the server's own route, with the token, or a
presigned object-store URL, through a client of its own that never sends the token (:meth:`Remote.fetch_blob`). A
client of an https server refuses a plain-http presigned URL, unless ``insecure_allow_http_presigned``: the plan bytes,
and which plans a host loads, would cross the network in clear text, for anyone on the path to read, stall or corrupt.

Every answer is read with a size limit, while it streams in: a blob at most its record's ``blob_size``
(and never over ``max_blob_bytes``), a resolve answer at most :meth:`Remote.resolve_limit` bytes. Each call
takes an optional ``deadline`` (a :func:`time.monotonic` instant) by which its whole answer must be in.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..environment import Environment
from ..errors import Reason, ServerUnavailable
from ..http import CircuitBreaker, HttpClient, json_as
from ..protocol import (
    MAX_REPORTED_REJECTS,
    ExplainRequest,
    ExplainResponse,
    MissReason,
    RejectReport,
    ResolveRequest,
    ResolveResponse,
    SpecCreated,
)
from ..spec import GraphSpec

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("plancache.client")

#: Bytes allowed per key of a resolve answer besides its base64 blob: the record (digests, signed envelope,
#: environment, knobs, timings) and the JSON around it; and once per answer.
RECORD_ALLOWANCE = 16 * 1024
ANSWER_ALLOWANCE = 64 * 1024
#: Bytes allowed per key of an explain answer (a reason of at most 2,000 characters, a signed withdrawal and the
#: JSON around them).
EXPLAIN_ALLOWANCE = 16 * 1024
#: The largest answer to ``POST /v1/specs`` (a graph key and a flag).
SPEC_ANSWER_LIMIT = 64 * 1024


def base64_size(n: int) -> int:
    """Length of the base64 text of ``n`` bytes."""
    return 4 * ((n + 2) // 3)


class Remote:
    """The client's calls to one plancache server, on ``http``. ``max_blob_bytes``: the largest plan blob it
    reads; ``resolve_max_bytes``: the largest resolve answer it reads, however many keys it asks for;
    ``insecure_allow_http_presigned``: GET plain-http presigned URLs even though the server is https."""

    def __init__(self, http: HttpClient, *, max_keys_per_request: int = 1000, max_blob_bytes: int = 64 * 1024 * 1024,
                 resolve_max_bytes: int = 256 * 1024 * 1024, transport: httpx.BaseTransport | None = None,
                 insecure_allow_http_presigned: bool = False) -> None:
        if max_keys_per_request < 1:
            raise ValueError("max_keys_per_request must be >= 1")
        if max_blob_bytes < 1 or resolve_max_bytes < 1:
            raise ValueError("max_blob_bytes and resolve_max_bytes must be >= 1")
        self.http = http
        self.max_keys_per_request = max_keys_per_request
        self.max_blob_bytes = max_blob_bytes
        self.resolve_max_bytes = resolve_max_bytes
        self._transport = transport
        self._elsewhere: dict[str, HttpClient] = {}  # origin of presigned URLs -> a client without the token
        self._elsewhere_lock = threading.Lock()
        #: Plain-http presigned URLs are refused: the server is https and no opt-in says otherwise.
        self.refuses_http_presigned = self.http.server_url.startswith("https://") and not insecure_allow_http_presigned
        self._refusal_logged = False

    @property
    def is_off(self) -> bool:
        """True while a circuit breaker of the HTTP client holds calls back."""
        return any(isinstance(p, CircuitBreaker) and p.is_off for p in self.http.policies)

    def resolve_limit(self, n_keys: int, include_blobs: bool) -> int:
        """The most bytes read of a resolve answer for ``n_keys`` keys: per key a record allowance plus, with
        blobs, the base64 of the largest blob, and no more than ``resolve_max_bytes`` in all."""
        per_key = RECORD_ALLOWANCE + (base64_size(self.max_blob_bytes) if include_blobs else 0)
        return min(self.resolve_max_bytes, ANSWER_ALLOWANCE + n_keys * per_key)

    def resolve(self, environment: Environment, graph_keys: list[str], *, include_blobs: bool = True,
                deadline: float | None = None, background: bool = False) -> ResolveResponse:
        """``POST /v1/plans/resolve``: the records (and blobs) of ``graph_keys`` for ``environment``.
        One round trip for up to ``max_keys_per_request`` keys. The server records the missing keys as misses.
        ``background``: a failure does not trip the circuit breaker (:class:`~plancache.http.Call`'s ``trips``)."""
        keys = list(dict.fromkeys(graph_keys))
        plans: dict[str, Any] = {}
        missing: list[str] = []
        for start in range(0, len(keys), self.max_keys_per_request):
            part_keys = keys[start:start + self.max_keys_per_request]
            req = ResolveRequest(environment=environment, graph_keys=part_keys, include_blobs=include_blobs)
            part = self.http.read("POST", "/v1/plans/resolve", json_as(ResolveResponse),
                                  body=req.model_dump(mode="json"), deadline=deadline, trips=not background,
                                  max_bytes=self.resolve_limit(len(part_keys), include_blobs))
            plans.update(part.plans)
            missing.extend(part.missing)
        return ResolveResponse(plans=plans, missing=missing)

    def explain(self, environment: Environment, graph_keys: list[str], *,
                deadline: float | None = None, background: bool = False) -> dict[str, MissReason]:
        """``POST /v1/plans/explain``: why each of ``graph_keys`` has no plan for ``environment`` (a server without
        the route answers 404: the caller goes without). A refusal (401/403, or 429: over the route's budget) does not
        trip a circuit breaker."""
        reasons: dict[str, MissReason] = {}
        keys = list(dict.fromkeys(graph_keys))
        for start in range(0, len(keys), self.max_keys_per_request):
            req = ExplainRequest(environment=environment, graph_keys=keys[start:start + self.max_keys_per_request])
            part = self.http.read("POST", "/v1/plans/explain", json_as(ExplainResponse),
                                  body=req.model_dump(mode="json"), deadline=deadline, trips_on_refusal=False,
                                  trips=not background,
                                  max_bytes=ANSWER_ALLOWANCE + len(req.graph_keys) * EXPLAIN_ALLOWANCE)
            reasons.update(part.reasons)
        return reasons

    def fetch_blob(self, sha256: str, *, size: int | None = None, deadline: float | None = None,
                   url: str | None = None, background: bool = False) -> bytes:
        """The blob's bytes (unverified), read up to ``size`` bytes (the record's ``blob_size``; at most
        ``max_blob_bytes``): a longer answer is cut off and fails with ServerUnavailable. From ``url`` when given:
        a path is on this server (sent with the token), an absolute http(s) URL (a presigned one) is GET with no
        credentials at all, through a client of its own that trips no breaker (a plain-http one fails at once,
        unsent, while :attr:`refuses_http_presigned`); else ``GET /v1/blobs/{sha256}``."""
        limit = self.max_blob_bytes if size is None else min(size, self.max_blob_bytes)
        if url is None or url.startswith("/"):
            return self.http.read("GET", url or f"/v1/blobs/{sha256}", _blob_bytes, max_bytes=limit, deadline=deadline,
                                  trips=not background)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ServerUnavailable(f"blob {sha256}: the server named {url[:100]!r}, not a path or an http(s) URL")
        origin = f"{parts.scheme}://{parts.netloc}"
        if parts.scheme == "http" and self.refuses_http_presigned:
            self._log_refusal(origin)
            raise ServerUnavailable(f"blob {sha256}: the presigned URL is plain http ({origin}) and the server "
                                    "https: refused (PLANCACHE_INSECURE_ALLOW_HTTP_PRESIGNED=1 accepts it)")
        with self._elsewhere_lock:
            http = self._elsewhere.get(origin)
            if http is None:
                http = self._elsewhere[origin] = HttpClient(origin, None, connect_timeout=self.http.connect_timeout,
                                                            read_timeout=self.http.read_timeout,
                                                            transport=self._transport)
        return http.read("GET", url[len(origin):], _blob_bytes, max_bytes=limit, deadline=deadline, retry=False)

    def _log_refusal(self, origin: str) -> None:
        """Say once why plain-http presigned URLs are refused."""
        with self._elsewhere_lock:
            if self._refusal_logged:
                return
            self._refusal_logged = True
        log.warning("plancache: the server %s hands out plain-http presigned blob URLs (%s): refused, so the plan "
                    "bytes do not cross the network in clear text; each blob is fetched from the server's route instead "
                    "(stats().presigned_fallbacks). Serve the object store over https, turn presigning off on the "
                    "server (PLANCACHE_PRESIGN_BLOBS=false), or set PLANCACHE_INSECURE_ALLOW_HTTP_PRESIGNED=1 to "
                    "accept them", self.http.server_url, origin)

    def register_spec(self, spec: GraphSpec, *, deadline: float | None = None) -> str:
        """``POST /v1/specs``: store the spec so an admin can tune its key; returns the server's graph key.
        Any token may (a reader's included); a refusal (401/403, or 429: over the token's spec-write budget) does not
        trip a circuit breaker."""
        created = self.http.read("POST", "/v1/specs", json_as(SpecCreated), body=spec.to_json(), trips_on_refusal=False,
                                 max_bytes=SPEC_ANSWER_LIMIT, deadline=deadline)
        return created.graph_key

    def report_rejects(self, rejects: Mapping[str, int], *, deadline: float) -> None:
        """``POST /v1/reports/rejects``: the plans this process refused, by reason, so that the server counts them
        (``plancache_client_rejects_total``). Sent once, never retried; a refusal trips no breaker."""
        known = {reason.value for reason in Reason}
        counts = {r: min(n, MAX_REPORTED_REJECTS) for r, n in rejects.items() if n > 0 and r in known}
        if not counts:
            return
        report = RejectReport.model_validate({"rejects": counts})
        self.http.request("POST", "/v1/reports/rejects", body=report.model_dump(mode="json"), retry=False,
                          trips_on_refusal=False, deadline=deadline, max_bytes=SPEC_ANSWER_LIMIT)

    def close(self) -> None:
        self.http.close()
        for http in self._elsewhere.values():
            http.close()


def _blob_bytes(resp: httpx.Response) -> bytes:
    """The body of a 200 answer; any other answer below 400 (a redirect, which is not followed, 204, 304) holds no
    blob: a malformed answer (ServerUnavailable), so that a presigned URL's failure falls back to the server."""
    if resp.status_code != 200:
        raise ValueError(f"{resp.status_code} {resp.reason_phrase}, not 200 with the blob")
    return resp.content
