"""Helpers of the HTTP API tests: an in-process app on the ``store`` fixture with a token for every role.

Test modules import the ``api`` fixture from here (``from .server_util import api  # noqa: F401``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient

from plancache.protocol import PlanMeta, b64encode
from plancache.server import create_app
from plancache.settings import Settings

ADMIN_TOKEN = "test-bootstrap-admin-token"


@dataclass
class Api:
    """A client of an app over ``store``, and ``Authorization`` headers for each role."""

    client: TestClient
    store: Any
    app: Any
    reader: dict[str, str]
    worker: dict[str, str]
    admin: dict[str, str]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextlib.contextmanager
def open_api(store: Any, **settings: Any) -> Iterator[Api]:
    """A running app (lifespan entered) on ``store``; ``settings`` override :class:`Settings` fields."""
    fields: dict[str, Any] = {"database_url": "sqlite:///unused-the-store-is-injected.db", "admin_token": ADMIN_TOKEN,
                              **settings}
    app = create_app(Settings(**fields), store=store)
    reader, _ = store.create_token("test-reader", "reader")
    worker, _ = store.create_token("test-worker", "worker")
    admin, _ = store.create_token("test-admin", "admin")
    with TestClient(app) as client:
        yield Api(client, store, app, bearer(reader), bearer(worker), bearer(admin))


@pytest.fixture
def api(store: Any) -> Iterator[Api]:
    with open_api(store) as a:
        yield a


def upload_json(meta: PlanMeta, blob: bytes, spec: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """A ``PUT /v1/plans`` body for ``meta`` and ``blob`` (with ``spec`` if given)."""
    body = {**meta.model_dump(mode="json"), "blob_b64": b64encode(blob), **overrides}
    if spec is not None:
        body["spec"] = spec
    return body


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def env_query(env: Any) -> dict[str, Any]:
    """The validity fields as query parameters of ``GET /v1/plans/{graph_key}``."""
    return env.validity()
