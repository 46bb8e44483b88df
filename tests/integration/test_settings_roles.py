"""Each role reads its own variables: a bad value of a variable that only another role reads does not stop a client,
a server or a store from starting, and the variables a role does read are still checked."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from plancache.client import PlanCache
from plancache.server import create_app
from plancache.settings import ClientSettings, ServerSettings, StoreSettings, WorkerSettings
from plancache.store import open_store

from ..client_fakes import RecordingBackend

SERVER_ONLY = {"PLANCACHE_LEASE_SECONDS": "abc", "PLANCACHE_MAX_INFLIGHT_BYTES": "lots", "PLANCACHE_AUTOTUNE": "maybe"}
CLIENT_ONLY = {"PLANCACHE_REQUEST_DEADLINE": "soon", "PLANCACHE_CACHE_MAX_BYTES": "big", "PLANCACHE_REVALIDATE_SECONDS": "-1"}
WORKER_ONLY = {"PLANCACHE_BUILD_TIMEOUT": "never", "PLANCACHE_JOB_TIMEOUT": "-"}


def _set(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_the_client_ignores_server_and_worker_variables(monkeypatch, tmp_path):
    _set(monkeypatch, SERVER_ONLY | WORKER_ONLY)
    cache = PlanCache(None, backend=RecordingBackend(), cache_dir=tmp_path)
    assert cache.request_deadline == ClientSettings.model_fields["request_deadline"].default
    with pytest.raises(ValidationError, match="LEASE_SECONDS|lease_seconds"):
        ServerSettings()  # the same environment does stop a server


def test_the_client_checks_its_own_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("PLANCACHE_REQUEST_DEADLINE", "soon")
    with pytest.raises(ValidationError, match="request_deadline"):
        PlanCache(None, backend=RecordingBackend(), cache_dir=tmp_path)


def test_the_client_reads_the_blob_limit_it_shares_with_the_server(monkeypatch, tmp_path):
    monkeypatch.setenv("PLANCACHE_MAX_BLOB_BYTES", "1048576")
    cache = PlanCache("http://127.0.0.1:9", backend=RecordingBackend(), cache_dir=tmp_path)
    assert cache._remote is not None and cache._remote.max_blob_bytes == 1048576
    monkeypatch.setenv("PLANCACHE_MAX_BLOB_BYTES", "0")
    with pytest.raises(ValidationError, match="max_blob_bytes"):
        PlanCache("http://127.0.0.1:9", backend=RecordingBackend(), cache_dir=tmp_path)


def test_the_server_and_the_store_ignore_client_and_worker_variables(monkeypatch, tmp_path, db_url):
    _set(monkeypatch, CLIENT_ONLY | WORKER_ONLY)
    with open_store(db_url, create=True) as store:
        app = create_app(store=store)
        assert isinstance(app.state.settings, ServerSettings)
    assert StoreSettings().blob_store == "database"
    with pytest.raises(ValidationError, match="build_timeout"):
        WorkerSettings()  # a worker started here would stop, naming it
