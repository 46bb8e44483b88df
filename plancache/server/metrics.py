"""Prometheus metrics of one app, in its own :class:`CollectorRegistry` (never the process-global one).

- ``plancache_http_requests_total{method,route,status}`` and ``plancache_http_request_duration_seconds{method,route}``
  (``route`` is the path template of the app's route the request matched -- API routes, ``/docs`` and
  ``/openapi.json`` alike -- and ``<unmatched>`` for paths no route matches, so the label set stays small)
- ``plancache_resolve_keys_total{result="hit"|"miss"}``
- ``plancache_blob_bytes_served_total{route}`` (blob GETs and blobs inlined in resolve answers)
- ``plancache_jobs{status}`` (read from the store at scrape time)
- ``plancache_tuning_seconds`` (autotuning time of each newly published plan)
- ``plancache_autotune_jobs_total`` (jobs this process's autotune policy enqueued, :mod:`plancache.server.autotune`)
- ``plancache_callers_total{agent,release}`` (requests by the ``User-Agent`` that plancache's clients, workers and
  command line send, :func:`plancache.http.user_agent`; any other caller is ``agent="other"``; past
  :data:`MAX_RELEASES` distinct releases a process has seen, a new one counts as ``release="other"``)
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy.exc
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..http import USER_AGENT_PATTERN

log = logging.getLogger("plancache.server")

UNMATCHED_ROUTE = "<unmatched>"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_TUNING_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: Distinct releases ``plancache_callers_total`` names per process; a fleet runs a few at a time.
MAX_RELEASES = 16
OTHER = "other"
_USER_AGENT = re.compile(USER_AGENT_PATTERN)


class _JobsCollector(Collector):
    """``plancache_jobs{status}`` from ``store.job_counts()``; nothing while the store is closed or unreachable."""

    def __init__(self, store: Callable[[], Any]) -> None:
        self._store = store

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("plancache_jobs", "Tuning jobs by status", labels=["status"])

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        store = self._store()
        if store is None:
            return
        try:
            counts = store.job_counts()
        except sqlalchemy.exc.SQLAlchemyError as exc:
            log.warning("metrics: cannot count jobs: %s", type(exc).__name__)
            return
        family = self._family()
        for status, n in counts.items():
            family.add_metric([status], n)
        yield family


class Metrics:
    """The app's metrics; ``store`` returns the open store (or None) when jobs are counted."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, store: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("plancache_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram("plancache_http_request_duration_seconds", "HTTP request latency by route",
                                 ["method", "route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.resolve_keys = Counter("plancache_resolve_keys", "Graph keys asked for in resolve, by result",
                                    ["result"], registry=r)
        self.misses_not_counted = Counter("plancache_misses_not_counted", "Missed graph keys answered but not recorded: "
                                          "the token's miss budget was spent", registry=r)
        self.bytes_served = Counter("plancache_blob_bytes_served", "Plan blob bytes sent, by route", ["route"], registry=r)
        self.tuning_seconds = Histogram("plancache_tuning_seconds", "Autotuning time of newly published plans",
                                        buckets=_TUNING_BUCKETS, registry=r)
        self.autotune_jobs = Counter("plancache_autotune_jobs", "Jobs the autotune policy of this process enqueued",
                                     registry=r)
        self.callers = Counter("plancache_callers", "HTTP requests by calling agent and its release",
                               ["agent", "release"], registry=r)
        self._releases: set[str] = set()
        r.register(_JobsCollector(store))

    def observe_caller(self, user_agent: str) -> None:
        """Counts one request of the caller that ``user_agent`` names (bounded labels, see the module docstring)."""
        match = _USER_AGENT.match(user_agent)
        if match is None:
            self.callers.labels(OTHER, "").inc()
            return
        agent, release = match.groups()
        if release not in self._releases:
            if len(self._releases) >= MAX_RELEASES:
                release = OTHER
            else:
                self._releases.add(release)
        self.callers.labels(agent, release).inc()

    def observe_resolve(self, hits: int, misses: int, blob_bytes: int) -> None:
        self.resolve_keys.labels("hit").inc(hits)
        self.resolve_keys.labels("miss").inc(misses)
        if blob_bytes:
            self.bytes_served.labels("/v1/plans/resolve").inc(blob_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_label(scope: Scope) -> str:
    """The path template of the route that ``scope`` matched, else :data:`UNMATCHED_ROUTE`.

    FastAPI's routes record themselves in ``scope["route"]``; Starlette's plain routes (``/openapi.json``) do
    not, so those are found again by matching the app's routes, as its router did (a full match first, then
    one that matched the path but not the method)."""
    path: str | None = getattr(scope.get("route"), "path", None)
    if path:
        return path
    partial = None
    for route in getattr(getattr(scope.get("app"), "router", None), "routes", ()):
        try:
            match, child = route.matches(scope)
        except Exception:  # noqa: BLE001 - a label must never fail the request
            continue
        path = getattr(child.get("route"), "path", None) or getattr(route, "path", None)
        if match is Match.FULL and path:
            return str(path)
        if match is Match.PARTIAL and partial is None:
            partial = path
    return partial or UNMATCHED_ROUTE


class MetricsMiddleware:
    """Counts and times every HTTP request by method, route template and status (an escaping exception is a 500)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = route_label(scope)
            method = scope["method"] if scope["method"] in _METHODS else "OTHER"
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - start)
            self.metrics.observe_caller(_header(scope, b"user-agent"))


def _header(scope: Scope, name: bytes) -> str:
    """The first ``name`` header of ``scope``'s request (latin-1, as HTTP carries it), else ``""``."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return ""
