"""The client's conversation with the plancache server: every call, and every policy of the calls.

Calls: resolve plans (each missing key with its reason), fetch blobs, register specs, explain misses (of a server
that does not give the reasons in its resolve answer), report refusals. Policies: the client's
:class:`~plancache.http.HttpClient` (retries, timeouts) and :class:`~plancache.http.CircuitBreaker` (:func:`connect`),
which refusals trip the breaker, https-only presigned GETs, the size limit of every answer, what is registered and
sent again (:class:`Registrar`), and how long a missed key is not asked about again (:class:`MissMemory`).

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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..environment import Environment
from ..errors import PlanCacheError, Reason, ServerUnavailable
from ..http import CircuitBreaker, HttpClient, json_as
from ..protocol import (
    MAX_REPORTED_REJECTS,
    ExplainRequest,
    ExplainResponse,
    MissReason,
    RejectReport,
    ResolveRequest,
    ResolveResponse,
    SiblingsRequest,
    SiblingsResponse,
    SpecCreated,
)
from ..spec import GraphSpec

if TYPE_CHECKING:
    import httpx

    from ..settings import ClientSettings
    from .context import RecordsSource

log = logging.getLogger("plancache.client")

#: Bytes allowed per key of a resolve answer besides its base64 blob: the record (digests, signed envelope,
#: environment, knobs, timings) or the reason of a miss, and the JSON around it; and once per answer.
RECORD_ALLOWANCE = 16 * 1024
ANSWER_ALLOWANCE = 64 * 1024
#: Bytes allowed per key of an explain answer (a reason of at most 2,000 characters, a signed withdrawal and the
#: JSON around them).
EXPLAIN_ALLOWANCE = 16 * 1024
#: The largest answer to ``POST /v1/specs`` (a graph key and a flag).
SPEC_ANSWER_LIMIT = 64 * 1024
#: Bytes allowed per spec of a siblings answer (an attention graph's is 2-4 KB).
SPEC_ALLOWANCE = 64 * 1024


#: Seconds a process does not ask the server again about a key it missed (so the miss is not counted again), and
#: how many such keys it remembers (the oldest forgotten first: asked again).
MISS_RECHECK_SECONDS = 60.0
MISS_MEMORY_KEYS = 10_000
#: Times a process sends the spec of a key whose registration failed for now (429, 5xx, unreachable, past the
#: deadline, 408) before it gives up: once per miss of the key, so at most once every :data:`MISS_RECHECK_SECONDS`.
REGISTER_ATTEMPTS = 3


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
    def where(self) -> str:
        """The server's URL."""
        return self.http.server_url

    def stop(self) -> None:
        """Waits for answers and retries under way give up at once."""
        self.http.stop.set()

    @property
    def is_off(self) -> bool:
        """True while a circuit breaker of the HTTP client holds calls back."""
        return any(isinstance(p, CircuitBreaker) and p.is_off for p in self.http.policies)

    def resolve_limit(self, n_keys: int, include_blobs: bool) -> int:
        """The most bytes read of a resolve answer for ``n_keys`` keys: per key a record allowance plus, with
        blobs, the base64 of the largest blob, and no more than ``resolve_max_bytes`` in all."""
        per_key = max(RECORD_ALLOWANCE, EXPLAIN_ALLOWANCE) + (base64_size(self.max_blob_bytes) if include_blobs else 0)
        return min(self.resolve_max_bytes, ANSWER_ALLOWANCE + n_keys * per_key)

    def resolve(self, environment: Environment, graph_keys: list[str], *, include_blobs: bool = True,
                deadline: float | None = None, background: bool = False) -> ResolveResponse:
        """``POST /v1/plans/resolve``: the records (and blobs) of ``graph_keys`` for ``environment``, and why each
        missing key is missing. One round trip for up to ``max_keys_per_request`` keys; the server records the
        missing keys as misses. A server that does not give the reasons (API 1.1) is asked for them
        (:meth:`explain`) while the deadline allows; one that cannot say leaves them out. ``background``: a failure
        does not trip the circuit breaker (:class:`~plancache.http.Call`'s ``trips``)."""
        keys = list(dict.fromkeys(graph_keys))
        plans: dict[str, Any] = {}
        missing: list[str] = []
        reasons: dict[str, MissReason] = {}
        for start in range(0, len(keys), self.max_keys_per_request):
            part_keys = keys[start:start + self.max_keys_per_request]
            req = ResolveRequest(environment=environment, graph_keys=part_keys, include_blobs=include_blobs)
            part = self.http.read("POST", "/v1/plans/resolve", json_as(ResolveResponse),
                                  body=req.model_dump(mode="json"), deadline=deadline, trips=not background,
                                  max_bytes=self.resolve_limit(len(part_keys), include_blobs))
            plans.update(part.plans)
            missing.extend(part.missing)
            reasons.update((k, r) for k, r in part.reasons.items() if k in part.missing)
        unexplained = [k for k in missing if k not in reasons]
        if unexplained and (deadline is None or time.monotonic() < deadline):
            try:
                reasons.update(self.explain(environment, unexplained, deadline=deadline, background=background))
            except PlanCacheError as exc:
                log.debug("plancache: the server did not explain its misses: %s", exc.message)
        return ResolveResponse(plans=plans, missing=missing, reasons=reasons)

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

    def siblings(self, environment: Environment, graph_keys: list[str], *, limit: int,
                 deadline: float | None = None) -> dict[str, dict[str, Any]]:
        """``POST /v1/plans/siblings``: the specs of the plans the server holds for other shapes of ``graph_keys``
        (at most :data:`~plancache.protocol.MAX_SIBLING_KEYS`), ``limit`` per key, by graph key. A server without the
        route (API 1.3 or older) refuses it with 405 (its ``GET /v1/plans/{graph_key}`` takes the path); a failure
        trips no breaker (a background call)."""
        req = SiblingsRequest(environment=environment, graph_keys=graph_keys, limit=limit)
        answer = self.http.read("POST", "/v1/plans/siblings", json_as(SiblingsResponse), body=req.model_dump(mode="json"),
                                deadline=deadline, trips=False, trips_on_refusal=False,
                                max_bytes=ANSWER_ALLOWANCE + len(graph_keys) * limit * SPEC_ALLOWANCE)
        return answer.specs

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


def connect(url: str, token: str | None, settings: ClientSettings, *, connect_timeout: float | None = None,
            read_timeout: float | None = None, cooldown: float = 30.0,
            transport: httpx.BaseTransport | None = None) -> Remote:
    """The :class:`Remote` of a :class:`~plancache.client.PlanCache`: its own short timeouts (``settings``' unless
    given), a :class:`~plancache.http.CircuitBreaker` of ``cooldown`` seconds, and ``settings``' size limits."""
    http = HttpClient(url, token, connect_timeout=connect_timeout or settings.connect_timeout,
                      read_timeout=read_timeout or settings.read_timeout, policies=[CircuitBreaker(cooldown)],
                      transport=transport)
    return Remote(http, max_blob_bytes=settings.max_blob_bytes, resolve_max_bytes=settings.resolve_max_bytes,
                  transport=transport, insecure_allow_http_presigned=settings.insecure_allow_http_presigned)


class Registrar:
    """Registers the specs of the keys a process misses, once per process, so an admin can tune them: one refused
    for good (401/403: by no key; a spec refused, 409, 413, 422…) is not sent again; one that failed for now (429,
    5xx, unreachable, past the deadline, 408) is sent again at a later miss of its key, :data:`REGISTER_ATTEMPTS`
    times at most; one the remote held back unsent is no attempt. ``on_failure`` counts a failed call."""

    def __init__(self, on_failure: Callable[[PlanCacheError], None]) -> None:
        self._on_failure = on_failure
        self._done: dict[str, str | None] = {}  # not sent again: None registered, else why not (for good)
        self._failed: dict[str, int] = {}  # key: its registrations sent that failed for now
        self._refusal: str | None = None  # why this token may not register any spec

    def register(self, source: RecordsSource, key: str, spec: GraphSpec, deadline: float) -> str | None:
        """Send the spec of ``key`` when it is due (not past the deadline): None when it is stored, or will be sent at
        a later miss; else why it was not stored (this time, or for good)."""
        if key in self._done or self._refusal is not None:
            return self._done.get(key, self._refusal)
        if time.monotonic() >= deadline:
            return None
        try:
            source.register_spec(spec, deadline=deadline)
        except PlanCacheError as exc:
            if self._gives_up(key, exc):
                self._done[key] = exc.message
                self._failed.pop(key, None)
            return exc.message
        self._done[key] = None
        self._failed.pop(key, None)
        return None

    def _gives_up(self, key: str, exc: PlanCacheError) -> bool:
        """Whether the registration of ``key`` that failed with ``exc`` is not to be sent again (said so)."""
        if isinstance(exc, ServerUnavailable):
            self._on_failure(exc)
            if exc.skipped:
                return False
        if isinstance(exc, ServerUnavailable) or exc.http_status == 408:  # 408: the body came in too slowly
            self._failed[key] = failed = self._failed.get(key, 0) + 1
            if failed < REGISTER_ATTEMPTS:
                return False
            log.warning("plancache: could not register the spec of %s in %d attempts (%s); this process does not send "
                        "it again (an admin can: plancache enqueue)", key[:12], failed, exc.message)
        elif exc.http_status in (401, 403):
            self._refusal = exc.message
            log.info("plancache: this token may not register specs (%s); misses are still recorded by resolve",
                     exc.message)
        else:
            log.warning("plancache: could not register the spec of %s: %s", key[:12], exc.message)
        return True


@dataclass(frozen=True)
class Missed:
    """What a process remembers of a key the server missed: when (:func:`time.monotonic`), why, and why its spec
    was not registered then (None: it was, or was not due)."""

    at: float
    reason: MissReason | None
    unregistered: str | None = None


class MissMemory:
    """The keys the server missed, each remembered for :data:`MISS_RECHECK_SECONDS` (at most
    :data:`MISS_MEMORY_KEYS`): a process that loads a missed key on every call neither waits on the server each
    time nor counts a miss each time. Not thread-safe: the ladder's lock guards it."""

    def __init__(self) -> None:
        from cachetools import TTLCache  # with the first PlanCache, not the import

        self._missed: TTLCache[str, Missed] = TTLCache(MISS_MEMORY_KEYS, MISS_RECHECK_SECONDS)

    def get(self, key: str) -> Missed | None:
        return self._missed.get(key)

    def remember(self, key: str, missed: Missed) -> None:
        self._missed[key] = missed

    def expire(self, now: float) -> None:
        """Forget what is older than :data:`MISS_RECHECK_SECONDS` at ``now`` (a :func:`time.monotonic` instant)."""
        self._missed.expire(now)


def _blob_bytes(resp: httpx.Response) -> bytes:
    """The body of a 200 answer; any other answer below 400 (a redirect, which is not followed, 204, 304) holds no
    blob: a malformed answer (ServerUnavailable), so that a presigned URL's failure falls back to the server."""
    if resp.status_code != 200:
        raise ValueError(f"{resp.status_code} {resp.reason_phrase}, not 200 with the blob")
    return resp.content
