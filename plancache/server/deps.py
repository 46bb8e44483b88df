"""Per-app state handed to routes as dependencies: the settings, the store (opened by the lifespan) and the metrics.

They are ``async`` only so that FastAPI runs them on the event loop instead of a worker thread; none awaits anything."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..settings import ServerSettings
from ..store import Store
from .metrics import Metrics


async def get_settings(request: Request) -> ServerSettings:
    settings: ServerSettings = request.app.state.settings
    return settings


async def get_store(request: Request) -> Store:
    store: Store | None = request.app.state.store
    if store is None:
        raise RuntimeError("the app's store is not open: run the app with its lifespan (uvicorn, or `with TestClient(app)`)")
    return store


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[ServerSettings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
