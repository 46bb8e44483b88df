"""The application factory. Nothing is created at import time: each :func:`create_app` call makes its own
app, metrics registry and (in its lifespan) store."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..http import API_VERSION, API_VERSION_HEADER
from ..settings import ServerSettings
from ..signing import TrustedKeys
from ..store import Store, open_store
from .autotune import Autotuner, policy_from
from .bodies import install_openapi_rules
from .bounded import STORE_WAIT, Bounded
from .docs import install_docs
from .errors import install_error_handlers
from .limits import UPLOAD_THREADS, ByteBudget, RateLimiter
from .memo import PRESIGNED_URLS, RecordMemo, TtlMemory, blob_memory
from .metrics import Metrics, MetricsMiddleware
from .redact import redacting
from .routes import ROUTERS

#: FastAPI hands pydantic each body or query-model parameter as a field aliased by the parameter's name; for five
#: of this server's (the bodies of PUT /v1/plans, the withdrawal, job completion and reject report routes, and the
#: environment query) pydantic 2.12+ warns at the first request that the alias has no effect, though FastAPI reads
#: the parameter by it (pydantic#12356): a false alarm in every server's log.
#: (tests/conftest.py hands it to pytest, which resets the filters a module set)
BODY_ALIAS_WARNING = (r"The 'alias' attribute with value '(environment|report|req|upload|withdrawal)' was provided "
                      r"to the `Field\(\)`")
warnings.filterwarnings("ignore", message=BODY_ALIAS_WARNING, category=UserWarning)

_DESCRIPTION = """Tuned cuDNN Frontend execution plans, per GPU environment.

Clients resolve many graph keys in one round trip (`POST /v1/plans/resolve`) and fetch immutable blobs;
workers claim tuning jobs and upload plans; admins enqueue tuning. Authenticate with
`Authorization: Bearer <token>`. Every error is `{"error": {"code", "message"}}`."""


def _check(settings: ServerSettings) -> None:
    for name in ("max_blob_bytes", "max_request_bytes", "max_resolve_keys", "lease_seconds", "max_json_bytes",
                 "max_inflight_bytes", "body_parse_threads", "header_timeout", "body_timeout", "body_min_rate",
                 "keep_alive_timeout"):
        if not getattr(settings, name) > 0:
            raise ValueError(f"setting {name} (PLANCACHE_{name.upper()}) must be positive, not {getattr(settings, name)!r}")


_prepared = False
#: The interpreter's thread switch interval in a server process, in seconds (Python's default is 0.005).
SWITCH_INTERVAL = 0.001


def prepare_process() -> None:
    """Once per process, at the first app's start, so that threads parsing request bodies delay the event loop
    little (docs/DEPLOYMENT.md "Request limits"):

    - every object alive now (modules, models, the store's engine; some 10^5) is moved out of the garbage
      collector's reach (``gc.freeze``): a full collection, which a body's parse can trigger and which holds
      the GIL, then scans only what requests allocated (a 1 MiB body's parse: 30 ms stall instead of 130 ms);
    - a thread holding the GIL is asked to hand it over after 1 ms instead of 5 ms (``sys.setswitchinterval``):
      ``/healthz`` p99 36 ms instead of 77 ms under 16 concurrent 1 MiB bodies, same throughput."""
    global _prepared
    if not _prepared:
        _prepared = True
        gc.collect()
        gc.freeze()
        sys.setswitchinterval(SWITCH_INTERVAL)


class ApiVersionMiddleware:
    """Names :data:`~plancache.http.API_VERSION` in every HTTP answer's :data:`~plancache.http.API_VERSION_HEADER`."""

    HEADER = (API_VERSION_HEADER.lower().encode("latin-1"), API_VERSION.encode("latin-1"))

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.HEADER]
            await send(message)

        await self.app(scope, receive, stamped)


def create_app(settings: ServerSettings | None = None, *, store: Store | None = None) -> FastAPI:
    """A new app. Its lifespan opens the store at ``settings.database_url`` (migrating it to head) and closes
    it at shutdown, unless ``store`` is given: then that store is used and left open for its owner."""
    settings = settings or ServerSettings()  # the server's variables only
    _check(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with redacting((settings.admin_token,) if settings.admin_token else ()):
            app.state.store = store if store is not None else open_store(
                settings.database_url, create=True, blob_store=settings.blob_store)
            prepare_process()
            if settings.autotune:
                app.state.autotuner.start()
            try:
                yield
            finally:
                app.state.autotuner.stop()
                if store is None:
                    app.state.store.close()
                app.state.store = None

    # docs_url/redoc_url off: FastAPI's pages load their assets from a CDN; install_docs serves a self-contained /docs
    app = FastAPI(title="plancache", version=__version__, description=_DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.router.redirect_slashes = False  # a redirect would name the request's Host header: answer 404 instead
    app.state.settings = settings
    # the keys a withdrawal must be signed by to be stored (routes.admin); a bad file stops the app here
    app.state.trusted_keys = TrustedKeys.from_setting(settings.trusted_keys)
    app.state.store = None
    # per-process budgets (plancache.server.limits): bytes in flight, spec registrations and recorded misses per token
    app.state.inflight = ByteBudget(settings.max_inflight_bytes, settings.inflight_wait_seconds)
    app.state.spec_writes = RateLimiter(settings.spec_writes_per_minute, settings.spec_write_burst)
    app.state.miss_writes = RateLimiter(settings.misses_per_minute, settings.miss_burst)
    app.state.upload_threads = anyio.CapacityLimiter(UPLOAD_THREADS)  # blob uploads' threads, apart from the rest
    # per-process memories of the hot read path (plancache.server.memo): blob bytes, resolve answers' records,
    # authenticated tokens, presigned URLs (each handed out while more than half of its validity is left)
    app.state.blob_memory = blob_memory(settings.blob_memory_bytes)
    app.state.record_memo = RecordMemo()
    app.state.principals = TtlMemory(settings.token_cache_seconds)
    app.state.presigned_urls = TtlMemory(settings.presign_seconds / 2, max_items=PRESIGNED_URLS)
    app.state.metrics = metrics = Metrics(lambda: app.state.store)
    app.state.readiness = Bounded(lambda: app.state.store.ping(), timeout=STORE_WAIT, name="readiness")
    # the autotune policy (plancache.server.autotune): a background thread when PLANCACHE_AUTOTUNE is on
    app.state.autotuner = Autotuner(lambda: app.state.store, policy_from(settings), settings.autotune_interval,
                                    metrics.autotune_jobs.inc)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_docs(app)
    install_openapi_rules(app)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(ApiVersionMiddleware)  # outermost: every answer, errors of the metrics' middleware too
    return app
