"""Prometheus metrics of one app, in its own :class:`CollectorRegistry` (never the process-global one).

- ``plancache_http_requests_total{method,route,status}`` and ``plancache_http_request_duration_seconds{method,route}``
  (``route`` is the path template of the app's route the request matched -- API routes, ``/docs`` and
  ``/openapi.json`` alike -- and ``<unmatched>`` for paths no route matches, so the label set stays small)
- ``plancache_resolve_keys_total{result="hit"|"miss"}``
- ``plancache_blob_bytes_served_total{route}`` (blob GETs and blobs inlined in resolve answers)
- ``plancache_jobs{status}`` (read from the store at scrape time)
- the fleet, per GPU environment (labels ``sm``, ``sm_count``, ``cudnn``, ``driver``, ``fe``; a job target's field
  that matches any value is ``""``), read from the store (:meth:`plancache.store.fleet.Fleet.fleet_counts`):
  ``plancache_fleet_jobs{…,status}`` (queued and running jobs by target), ``plancache_fleet_missed_keys{…}`` and
  ``plancache_fleet_misses{…}`` (graph keys missed, misses recorded),
  ``plancache_fleet_worker_last_claim_timestamp_seconds{…}`` (when a worker of the environment last claimed).
  Every replica reports the same database-wide value: aggregate with ``max by (labels)``, never ``sum``, so the
  figure is right whatever the number of replicas and survives any one of them (no leader to elect or lose).
- ``plancache_store_up`` (1: the scrape's store reads answered within :data:`STORE_WAIT` seconds; 0: they did
  not, and the store's families are left out of this scrape, which answers regardless)
- ``plancache_blob_store_errors_total{code}`` (requests failed by the blob store: unavailable, mismatched)
- ``plancache_client_rejects_total{reason}`` (plans clients refused, as they report them, by
  :class:`~plancache.errors.Reason`)
- ``plancache_build_info{release,api_version}`` (always 1)
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
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..environment import VALIDITY_FIELDS
from ..http import API_VERSION, USER_AGENT_PATTERN
from .bounded import STORE_WAIT, Bounded

log = logging.getLogger("plancache.server")

UNMATCHED_ROUTE = "<unmatched>"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_TUNING_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: Distinct releases ``plancache_callers_total`` names per process; a fleet runs a few at a time.
MAX_RELEASES = 16
OTHER = "other"
_USER_AGENT = re.compile(USER_AGENT_PATTERN)


#: Seconds the store's figures of a scrape are reused for (a scrape waits :data:`~.bounded.STORE_WAIT` for them).
STORE_MAX_AGE = 5.0
#: The labels of a GPU environment in the fleet's families, in :data:`~plancache.environment.VALIDITY_FIELDS` order.
ENV_LABELS = tuple({"cudnn_version": "cudnn", "driver_version": "driver", "frontend_version": "fe"}.get(f, f)
                   for f in VALIDITY_FIELDS)


def _env_labels(validity: tuple[Any, ...]) -> list[str]:
    return ["" if v is None else str(v) for v in validity]


class _StoreCollector(Collector):
    """The families read from the store (``plancache_jobs``, the fleet's, ``plancache_store_up``), at most
    :data:`STORE_WAIT` seconds per scrape (:class:`~plancache.server.bounded.Bounded`); none while the store is
    closed."""

    def __init__(self, store: Callable[[], Any]) -> None:
        self._store = store
        self.read = Bounded(self._figures, timeout=STORE_WAIT, max_age=STORE_MAX_AGE, name="metrics")

    def _figures(self) -> tuple[dict[str, int], Any]:
        store = self._store()
        return store.job_counts(), store.fleet_counts()

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        env = list(ENV_LABELS)
        return {
            "jobs": GaugeMetricFamily("plancache_jobs", "Tuning jobs by status", labels=["status"]),
            "fleet_jobs": GaugeMetricFamily("plancache_fleet_jobs", "Queued and running jobs by target environment "
                                            "(the same on every replica: aggregate with max)", labels=[*env, "status"]),
            "missed_keys": GaugeMetricFamily("plancache_fleet_missed_keys", "Graph keys missed by environment "
                                             "(the same on every replica)", labels=env),
            "misses": GaugeMetricFamily("plancache_fleet_misses", "Misses recorded by environment "
                                        "(the same on every replica)", labels=env),
            "workers": GaugeMetricFamily("plancache_fleet_worker_last_claim_timestamp_seconds",
                                         "When a worker of the environment last claimed (the same on every replica)",
                                         labels=env),
        }

    def describe(self) -> Iterator[Metric]:
        yield from self._families().values()
        yield GaugeMetricFamily("plancache_store_up", "")

    def collect(self) -> Iterator[Metric]:
        if self._store() is None:
            return
        up = GaugeMetricFamily("plancache_store_up", "1: this scrape read the store within the bound, else 0")
        try:
            counts, fleet = self.read.get()
        except (TimeoutError, sqlalchemy.exc.SQLAlchemyError) as exc:
            log.warning("metrics: cannot read the store: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        f = self._families()
        for status, n in counts.items():
            f["jobs"].add_metric([status], n)
        for (validity, status), n in fleet.jobs.items():
            f["fleet_jobs"].add_metric([*_env_labels(validity), status], n)
        for validity, (keys, events) in fleet.misses.items():
            f["missed_keys"].add_metric(_env_labels(validity), keys)
            f["misses"].add_metric(_env_labels(validity), events)
        for validity, at in fleet.workers.items():
            f["workers"].add_metric(_env_labels(validity), at.timestamp())
        yield from f.values()


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
        self.blob_store_errors = Counter("plancache_blob_store_errors", "Requests failed by the blob store, by error "
                                         "code", ["code"], registry=r)
        self.client_rejects = Counter("plancache_client_rejects", "Plans clients refused, as they report them, by "
                                      "reason", ["reason"], registry=r)
        Info("plancache_build", "The server's release and API version", registry=r).info(
            {"release": __version__, "api_version": API_VERSION})
        self.store_figures = _StoreCollector(store)
        r.register(self.store_figures)

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
