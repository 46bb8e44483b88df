"""The app itself: factory and lifespan, error mapping, strict bodies, metrics, OpenAPI (SQLite only; the
routes' behaviour on both databases is in ``test_api_*``)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import sqlalchemy.exc
from fastapi import FastAPI
from fastapi.testclient import TestClient

import plancache.server
from plancache.server import create_app
from plancache.settings import Settings
from plancache.store import open_store
from tests.server_util import Api, bearer, open_api

ADMIN = "app-test-admin-token"


@pytest.fixture
def sqlite_store(tmp_path) -> Iterator[object]:
    with open_store(f"sqlite:///{tmp_path / 'app.db'}", create=True) as s:
        yield s


@pytest.fixture
def sapi(sqlite_store) -> Iterator[Api]:
    with open_api(sqlite_store) as a:
        yield a


def test_no_app_or_engine_is_created_at_import():
    for info in pkgutil.walk_packages(plancache.server.__path__, "plancache.server."):
        module = importlib.import_module(info.name)
        assert not [n for n, v in vars(module).items() if isinstance(v, (FastAPI, sqlalchemy.engine.Engine))], info.name


def test_lifespan_opens_migrates_and_closes_the_configured_store(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    app = create_app(Settings(database_url=url, admin_token=ADMIN))
    with TestClient(app) as client:
        assert client.get("/readyz").json() == {"status": "ready"}
        assert client.get("/v1/jobs", headers=bearer(ADMIN)).json() == {"jobs": []}  # schema exists
        store = app.state.store
    assert app.state.store is None and store.engine.pool.checkedout() == 0
    with open_store(url) as again:  # migrated to head: opens without create
        assert again.list_jobs() == []


def test_an_injected_store_is_left_open(sqlite_store):
    with TestClient(create_app(Settings(), store=sqlite_store)) as client:
        assert client.get("/healthz").json()["status"] == "ok"
    sqlite_store.ping()


@pytest.mark.parametrize("field", ["lease_seconds", "max_blob_bytes", "max_request_bytes", "max_resolve_keys"])
def test_nonpositive_limits_are_refused_at_creation(field):
    with pytest.raises(ValueError, match=field):
        create_app(Settings(**{field: 0}))


def test_routing_errors_have_the_error_body(sapi):
    r = sapi.client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json() == {"error": {"code": "not_found", "message": "Not Found"}}
    r = sapi.client.delete("/v1/plans")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "PUT" in r.headers["allow"]


@pytest.mark.parametrize("body, problem", [
    (b"{not json", "invalid JSON"),
    (b'{"environment": {"sm": NaN}}', "NaN"),
    (b'{"environment": {"sm": Infinity}}', "Infinity"),
    (b'{"environment": {"sm": 1e999}}', "out of range"),
    (b'{"environment": {"sm": ' + b"9" * 5000 + b"}}", "too long"),
    (b'{"worker_id": "a\\u0000b"}', "NUL"),
    (b'{"worker_id": "a\\\\\\u0000b"}', "NUL"),
    (b'{"worker_id": "\xff"}', "not UTF-8"),
    (b"[" * 100_000, "nests too deeply"),
    (b"", "body: Field required"),
    (b"[1, 2]", "body"),
])
def test_bad_bodies_are_422_naming_the_problem(sapi, body, problem):
    r = sapi.client.post("/v1/jobs/claim", content=body, headers={**sapi.worker, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "validation_error" and problem in r.json()["error"]["message"]


def test_an_escaped_backslash_before_u0000_is_not_a_nul(sapi, gpu_env):
    body = b'{"environment": ' + gpu_env.model_dump_json().encode() + b', "worker_id": "a\\\\u0000b"}'
    r = sapi.client.post("/v1/jobs/claim", content=body, headers={**sapi.worker, "Content-Type": "application/json"})
    assert r.status_code == 204


def test_nul_in_the_query_string_is_422(sapi):
    r = sapi.client.get("/v1/plans/" + "0" * 64 + "?sm=90&frontend_version=a%00b", headers=sapi.reader)
    assert r.status_code == 422 and "NUL" in r.json()["error"]["message"]


def test_database_trouble_is_503_and_readyz_says_so(sapi, monkeypatch):
    def down(*_a, **_k):
        raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(sapi.store, "ping", down)
    monkeypatch.setattr(sapi.store, "get_spec", down)
    r = sapi.client.get("/readyz")
    assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable"
    r = sapi.client.get("/v1/specs/" + "0" * 64, headers=sapi.reader)
    assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable" and r.headers["retry-after"] == "1"
    assert sapi.client.get("/healthz").status_code == 200


def test_an_unexpected_exception_is_a_logged_500_with_the_error_body(sqlite_store, monkeypatch, caplog):
    app = create_app(Settings(open_reads=True), store=sqlite_store)
    monkeypatch.setattr(sqlite_store, "get_spec", lambda _k: 1 / 0)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/v1/specs/" + "0" * 64)
        assert r.status_code == 500
        assert r.json() == {"error": {"code": "internal_error", "message": "internal server error (logged)"}}
        assert "ZeroDivisionError" in caplog.text
        assert 'route="/v1/specs/{graph_key}",status="500"' in client.get("/metrics").text


def test_request_metrics_by_route_template_and_status(sapi):
    sapi.client.get("/v1/specs/" + "1" * 64, headers=sapi.reader)
    sapi.client.get("/v1/specs/" + "2" * 64, headers=sapi.reader)
    sapi.client.get("/v1/no-such-route")
    sapi.client.request("BREW", "/healthz")
    text = sapi.client.get("/metrics").text
    assert 'plancache_http_requests_total{method="GET",route="/v1/specs/{graph_key}",status="404"} 2.0' in text
    assert 'plancache_http_requests_total{method="GET",route="<unmatched>",status="404"} 1.0' in text
    assert 'plancache_http_requests_total{method="OTHER",route="/healthz",status="405"} 1.0' in text
    assert 'plancache_http_request_duration_seconds_count{method="GET",route="/v1/specs/{graph_key}"} 2.0' in text


def test_each_app_has_its_own_metrics(sqlite_store):
    a, b = create_app(Settings(), store=sqlite_store), create_app(Settings(), store=sqlite_store)
    with TestClient(a) as ca, TestClient(b) as cb:
        ca.get("/healthz")
        assert 'route="/healthz"' in ca.get("/metrics").text and 'route="/healthz"' not in cb.get("/metrics").text


def test_openapi_and_docs(sapi):
    assert sapi.client.get("/docs").status_code == 200
    schema = sapi.client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["token"] == {
        "type": "http", "scheme": "bearer", "description": schema["components"]["securitySchemes"]["token"]["description"]}
    resolve = schema["paths"]["/v1/plans/resolve"]["post"]
    assert resolve["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResolveRequest")
    assert resolve["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResolveResponse")
    assert resolve["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_the_parameters_fastapi_reads_by_their_name_log_no_pydantic_false_alarm(tmp_path):
    """pydantic warns that FastAPI's alias of five of the server's model parameters has no effect
    (plancache.server.app.BODY_ALIAS_WARNING); a server logged that at their routes' first requests. A fresh process
    where that warning is an error gets answers (4xx for these requests), not a 500."""
    code = f"""
import warnings
from pydantic.warnings import UnsupportedFieldAttributeWarning
warnings.simplefilter("error", UnsupportedFieldAttributeWarning)
from fastapi.testclient import TestClient
from plancache.server import create_app
from plancache.settings import Settings
app = create_app(Settings(database_url="sqlite:///{tmp_path / 'w.db'}", admin_token="t" * 32))
with TestClient(app) as c:
    auth = {{"Authorization": "Bearer " + "t" * 32}}
    print([c.request(m, p, json={{"x": 1}}, headers=auth).status_code for m, p in
           (("PUT", "/v1/plans"), ("POST", "/v1/admin/withdrawals"), ("POST", "/v1/jobs/1/complete"),
            ("POST", "/v1/reports/rejects"), ("GET", "/v1/plans/" + "a" * 64 + "?sm=90"))])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(400 <= c < 500 for c in codes), (codes, proc.stderr[-3000:])
