"""A frozen bucket stalls nothing that needs no bucket (issue 37, finding 3).

The endpoint here is a TCP server that accepts every connection and never answers, as an S3 endpoint that froze.
Figures (this module's server, on main 4d1a308): opening the store read one referenced blob there, 30 s and then a
refusal (every admin command exited 5 or 6, a restarted server crash-looped); one blob GET through the server waited
30 s. With the fix: the store opens at once; the first blob GET answers 503 after the bounded read timeout (2 tries
of READ_TIMEOUT, 0.3 s here) and the next ones at once (the circuit), with ``Retry-After``; records-only resolves,
``/healthz`` and ``token list`` answer meanwhile; ``plans gc`` deletes the records it can and says what it skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from plancache.blobs import objects
from plancache.cli import make_app
from plancache.server import create_app
from plancache.settings import Settings
from plancache.store import open_store
from plancache.store.blobs import probe_blob_store
from tests.server_util import ADMIN_TOKEN, bearer

READ_TIMEOUT = 0.3


@pytest.fixture
def frozen_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The URL of an endpoint that accepts connections and never answers; the AWS_* variables point at it."""
    server = socket.create_server(("127.0.0.1", 0), backlog=128)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1",
                        "AWS_ALLOW_HTTP": "true", "AWS_ENDPOINT_URL": url}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(objects, "READ_TIMEOUT", timedelta(seconds=READ_TIMEOUT))
    try:
        yield url
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@pytest.fixture
def seeded(tmp_path: Path, make_spec, make_plan, gpu_env) -> tuple[str, str, str]:
    """A database whose blobs left it (a folder holds them): (its URL, a plan's graph key, its blob's sha256)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    with open_store(url, create=True, blob_store=(tmp_path / "blobs").as_uri()) as store:
        key, spec = make_spec(0)
        store.put_spec(key, spec)
        record = store.publish_plan(*make_plan(key, gpu_env))
    return url, key, record.blob_sha256


def test_the_server_answers_blob_reads_503_fast_and_everything_else_meanwhile(frozen_endpoint, seeded, gpu_env):
    url, key, sha256 = seeded
    started = time.monotonic()
    store = open_store(url, blob_store="s3://frozen/blobs")
    assert time.monotonic() - started < 2  # the database alone is read
    app = create_app(Settings(database_url=url, admin_token=ADMIN_TOKEN, presign_blobs=False), store=store)
    try:
        with TestClient(app) as client:
            headers = bearer(ADMIN_TOKEN)
            started = time.monotonic()
            first = client.get(f"/v1/blobs/{sha256}", headers=headers)
            first_seconds = time.monotonic() - started
            assert first.status_code == 503 and first.json()["error"]["code"] == "blob_store_unavailable"
            assert int(first.headers["Retry-After"]) == objects.CIRCUIT_SECONDS
            assert first_seconds < 2 * READ_TIMEOUT + 1.5
            started = time.monotonic()
            for _ in range(20):
                again = client.get(f"/v1/blobs/{sha256}", headers=headers)
                assert again.status_code == 503 and 1 <= int(again.headers["Retry-After"]) <= objects.CIRCUIT_SECONDS
            assert time.monotonic() - started < 1.0  # the circuit: no read waits out its timeout
            started = time.monotonic()
            resolve = client.post("/v1/plans/resolve", headers=headers,
                                  json={"environment": gpu_env.model_dump(), "graph_keys": [key]})
            assert resolve.status_code == 200 and key in resolve.json()["plans"]
            assert client.get("/healthz").status_code == 200
            assert time.monotonic() - started < 1.0
    finally:
        store.close()


def test_start_up_reports_an_unreachable_bucket_and_commands_run(frozen_endpoint, seeded, tmp_path):
    url, _, _ = seeded
    with open_store(url, blob_store="s3://frozen/blobs") as store:
        problem = probe_blob_store(store.db, store.blob_store)
    assert problem is not None and "cannot be read now" in problem
    env = {**os.environ, "PLANCACHE_BLOB_STORE": "s3://frozen/blobs", "PLANCACHE_DATABASE_URL": url}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "plancache", "token", "create", "--name", "leaked", "--role", "reader"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "plancache", "token", "revoke", "leaked"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 20  # two process starts, no bucket read


def test_a_missing_blob_is_reported_not_refused(seeded, tmp_path):
    url, _, _ = seeded
    with open_store(url, blob_store=(tmp_path / "unmounted").as_uri()) as store:
        problem = probe_blob_store(store.db, store.blob_store)
    assert problem is not None and "the volume mounted" in problem


@pytest.fixture
def two_environments(seeded, make_spec, make_plan, tmp_path) -> str:
    """``seeded`` and a plan of another environment (its own blob) beside it: the database's URL."""
    from tests.factories import OTHER_GPU

    url, _, _ = seeded
    with open_store(url, blob_store=(tmp_path / "blobs").as_uri()) as store:
        key, spec = make_spec(1)
        store.put_spec(key, spec)
        store.publish_plan(*make_plan(key, OTHER_GPU, blob=b"other-plan"))
    return url


def _plans_gc(url: str, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, float]:
    """``plancache plans gc ARGS`` in this process (so the short read timeout holds) on the frozen bucket: the
    result and its seconds."""
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", "s3://frozen/blobs")
    started = time.monotonic()
    result = CliRunner().invoke(make_app(), ["plans", "gc", "--database-url", url, "--grace-hours", "0", *args])
    return result, time.monotonic() - started


def test_gc_dry_run_reports_the_database_and_what_it_cannot_count(frozen_endpoint, two_environments, gpu_env,
                                                                   monkeypatch):
    """``plans gc --dry-run`` with the bucket frozen: what the database tells (records, unreferenced blobs), one
    line saying the bucket's objects are not counted, exit 0, within the read timeout (it failed with exit 5)."""
    result, seconds = _plans_gc(two_environments, monkeypatch, "--dry-run", "--keep-environment", gpu_env.env_id)
    assert result.exit_code == 0, result.output
    assert "would delete 1 plan records" in result.stdout and "would delete 1 unreferenced blobs" in result.stdout
    lines = [line for line in result.stdout.splitlines() if "cannot be listed" in line]
    assert len(lines) == 1 and lines[0].startswith("not counted: objects no catalog row names")
    assert "Traceback" not in result.output and seconds < 2 * READ_TIMEOUT + 1.5


def test_gc_deletes_records_and_skips_the_blob_sweep(frozen_endpoint, two_environments, gpu_env, monkeypatch):
    """``plans gc`` with the bucket frozen deletes the records it was asked to and keeps every blob row (a row and
    its bytes go together), then says the sweep was skipped: exit 5 (OS_ERROR), no traceback."""
    from plancache.cli.failures import ExitCode
    from plancache.store.models import blobs, plans

    result, seconds = _plans_gc(two_environments, monkeypatch, "--keep-environment", gpu_env.env_id)
    assert result.exit_code == ExitCode.OS_ERROR, result.output
    assert "deleted 1 plan records" in result.stdout and "deleted 0 unreferenced blobs" in result.stdout
    assert "blob sweep skipped, as the bucket cannot be listed now" in result.stderr
    assert "Traceback" not in result.output and seconds < 2 * READ_TIMEOUT + 1.5
    with open_store(two_environments, blob_store="s3://frozen/blobs") as store, store.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(plans)).scalar() == 1
        assert conn.execute(sa.select(sa.func.count()).select_from(blobs)).scalar() == 2
