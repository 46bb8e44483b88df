"""A frozen bucket stalls nothing that needs no bucket (issue 37, finding 3).

The endpoint here is a TCP server that accepts every connection and never answers, as an S3 endpoint that froze.
Figures (this module's server, on main 4d1a308): opening the store read one referenced blob there, 30 s and then a
refusal (every admin command exited 5 or 6, a restarted server crash-looped); one blob GET through the server waited
30 s. With the fix: the store opens at once; the first blob GET answers 503 after the bounded read timeout (2 tries
of READ_TIMEOUT, 0.3 s here) and the next ones at once (the circuit), with ``Retry-After``; records-only resolves,
``/healthz`` and ``token list`` answer meanwhile.
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

import pytest
from fastapi.testclient import TestClient

from plancache.blobs import objects
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


def test_gc_fails_within_the_read_timeout_and_says_so(frozen_endpoint, seeded):
    """``plans gc`` (``--dry-run`` too) lists the bucket for objects no record names: with the bucket frozen it
    fails after the read timeout, not obstore's 30 s per try."""
    from plancache.errors import BlobStoreUnavailable
    from plancache.store.retention import gc

    url, _, _ = seeded
    with open_store(url, blob_store="s3://frozen/blobs") as store:
        started = time.monotonic()
        with pytest.raises(BlobStoreUnavailable):
            gc(store, grace=timedelta(hours=24), dry_run=True)
    assert time.monotonic() - started < 2 * READ_TIMEOUT + 1.5
