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

from plancache.protocol import PlanMeta
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


def upload_json(meta: PlanMeta, spec: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """A ``PUT /v1/plans`` (or ``plan`` of a job completion) body for ``meta``, with ``spec`` if given: the record
    alone, its blob uploaded before with :func:`put_blob`."""
    body = {**meta.model_dump(mode="json"), **overrides}
    if spec is not None:
        body["spec"] = spec
    return body


def put_blob(http: Any, blob: bytes, headers: dict[str, str], *, url: str = "",
             job: tuple[int, str, str] | None = None, check: bool = True) -> Any:
    """``PUT /v1/blobs/{sha256}`` of ``blob``'s raw bytes on ``http`` (a TestClient or an httpx client or module, then
    with the server's ``url``), as a worker does before publishing the record; ``job`` (id, worker id, lease token)
    for a worker token. With ``check`` the blob must be stored (200 or 201)."""
    job_headers = {} if job is None else {"X-Plancache-Job": str(job[0]), "X-Plancache-Worker": job[1],
                                          "X-Plancache-Lease": job[2]}
    r = http.put(f"{url}/v1/blobs/{sha(blob)}", content=blob,
                 headers={**headers, **job_headers, "Content-Type": "application/octet-stream"})
    if check:
        assert r.status_code in (200, 201), r.text
    return r


def upload(http: Any, meta: PlanMeta, blob: bytes, spec: dict[str, Any] | None = None, *, headers: dict[str, str],
           url: str = "", **overrides: Any) -> Any:
    """Upload a plan as an admin or a worker does: ``blob`` raw (:func:`put_blob` with ``headers``, and a worker's
    job when ``overrides`` name ``job_id`` and ``lease_token``), then ``PUT /v1/plans`` with the record
    (:func:`upload_json`); the record's response."""
    held = overrides.get("job_id"), overrides.get("lease_token")
    job = (held[0], meta.worker_id, held[1]) if held[0] is not None and held[1] is not None else None
    put_blob(http, blob, headers, url=url, job=job)
    return http.put(f"{url}/v1/plans", json=upload_json(meta, spec, **overrides), headers=headers)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def env_query(env: Any) -> dict[str, Any]:
    """The validity fields as query parameters of ``GET /v1/plans/{graph_key}``."""
    return env.validity()
