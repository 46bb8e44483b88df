"""The application factory. Nothing is created at import time: each :func:`create_app` call makes its own
app, metrics registry and (in its lifespan) store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .. import __version__
from ..settings import Settings, get_settings
from ..store import Store, open_store
from .errors import install_error_handlers
from .metrics import Metrics, MetricsMiddleware
from .redact import redacting
from .routes import ROUTERS

_DESCRIPTION = """Tuned cuDNN Frontend execution plans, per GPU environment.

Clients resolve many graph keys in one round trip (`POST /v1/plans/resolve`) and fetch immutable blobs;
workers claim tuning jobs and upload plans; admins enqueue tuning. Authenticate with
`Authorization: Bearer <token>`. Every error is `{"error": {"code", "message"}}`."""


def _check(settings: Settings) -> None:
    for name in ("max_blob_bytes", "max_request_bytes", "max_resolve_keys", "lease_seconds"):
        if not getattr(settings, name) > 0:
            raise ValueError(f"setting {name} (PLANCACHE_{name.upper()}) must be positive, not {getattr(settings, name)!r}")


def create_app(settings: Settings | None = None, *, store: Store | None = None) -> FastAPI:
    """A new app. Its lifespan opens the store at ``settings.database_url`` (migrating it to head) and closes
    it at shutdown, unless ``store`` is given: then that store is used and left open for its owner."""
    settings = settings or get_settings()
    _check(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with redacting((settings.admin_token,) if settings.admin_token else ()):
            app.state.store = store if store is not None else open_store(
                settings.database_url, create=True, blob_store=settings.blob_store)
            try:
                yield
            finally:
                if store is None:
                    app.state.store.close()
                app.state.store = None

    app = FastAPI(title="plancache", version=__version__, description=_DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.store = None
    app.state.metrics = metrics = Metrics(lambda: app.state.store)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
