"""The app behind a real uvicorn on a loopback port, talked to with httpx:

- ``plancache serve`` in a subprocess on a fresh SQLite file: the README's round trip (register a spec,
  enqueue, a worker claims and completes, a client resolves and fetches the blob), with the tokens
  kept out of its logs;
- a :class:`~tests.live_server.LiveServer` on the ``store`` fixture (SQLite and Postgres, database and file blob
  stores): large blobs, concurrent clients, and a streamed (chunked) body over the limit refused with 413.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from plancache.server.bodies import record_body_limit
from plancache.settings import Settings
from tests.live_server import LiveServer, free_port
from tests.server_util import ADMIN_TOKEN, bearer, put_blob, upload, upload_json

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "conv_bias_relu.json"
pytestmark = pytest.mark.both_blob_stores
START_TIMEOUT = 60.0


def wait_ready(base: str, proc: subprocess.Popen) -> None:
    """Until ``plancache serve`` (``proc``) answers ``/readyz`` at ``base``."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{base} did not become ready within {START_TIMEOUT}s")


def _cli(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "plancache", *args], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_plancache_serve_round_trip(tmp_path: Path, gpu_env: Any, make_plan: Any) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PLANCACHE_DATABASE_URL": f"sqlite:///{tmp_path / 'fresh' / 'plancache.db'}",
           "PLANCACHE_ADMIN_TOKEN": ADMIN_TOKEN}
    env.pop("PLANCACHE_OPEN_READS", None)
    proc = subprocess.Popen([sys.executable, "-m", "plancache", "serve", "--port", str(port)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(base, proc)
        worker_token = _cli("token", "create", "--role", "worker", "--name", "gpu-1", env=env).strip()
        reader_token = _cli("token", "create", "--role", "reader", "--name", "app", env=env).strip()
        key = _cli("spec", "key", str(EXAMPLE), env=env).split()[0]
        with httpx.Client(base_url=base, timeout=30.0) as http:
            admin, worker, reader = bearer(ADMIN_TOKEN), bearer(worker_token), bearer(reader_token)
            assert http.get("/healthz").json()["status"] == "ok"
            r = http.post("/v1/specs", content=EXAMPLE.read_bytes(), headers={**admin, "Content-Type": "application/json"})
            assert r.status_code == 201 and r.json() == {"graph_key": key, "created": True}
            r = http.post("/v1/admin/tune", json={"graph_keys": [key], "targets": [{"sm": 90}]}, headers=admin)
            assert r.status_code == 200 and [j["status"] for j in r.json()["jobs"]] == ["queued"]
            environment = gpu_env.model_dump()
            r = http.post("/v1/plans/resolve", json={"environment": environment, "graph_keys": [key]}, headers=reader)
            answer = r.json()
            assert answer["plans"] == {} and answer["missing"] == [key] and answer["reasons"][key]["reason"] == "queued"

            # what `plancache worker` does on the GPU, with a stand-in blob
            claim = http.post("/v1/jobs/claim", json={"environment": environment, "worker_id": "gpu-1"}, headers=worker).json()
            assert claim["job"]["graph_key"] == key
            assert claim["spec"] == json.loads(http.get(f"/v1/specs/{key}", headers=reader).text)
            meta, blob = make_plan(key, gpu_env, blob=os.urandom(300_000), worker_id="gpu-1")
            put_blob(http, blob, worker, job=(claim["job"]["id"], "gpu-1", claim["lease_token"]))  # raw, then the record
            r = http.post(f"/v1/jobs/{claim['job']['id']}/complete", headers=worker,
                          json={"worker_id": "gpu-1", "lease_token": claim["lease_token"], "plan": upload_json(meta)})
            assert r.status_code == 200, r.text

            r = http.post("/v1/plans/resolve", json={"environment": environment, "graph_keys": [key], "include_blobs": True},
                          headers=reader)
            resolved = r.json()["plans"][key]
            assert base64.b64decode(resolved["blob_b64"]) == blob and r.json()["missing"] == []
            digest = resolved["record"]["blob_sha256"]
            r = http.get(f"/v1/blobs/{digest}", headers=reader, params={"token": reader_token})  # a careless client
            assert r.content == blob and r.headers["etag"] == f'"{digest}"'
            assert http.get(f"/v1/blobs/{digest}", headers={**reader, "If-None-Match": r.headers["etag"]}).status_code == 304
            assert http.get("/v1/jobs", headers=reader).status_code == 403
            assert "plancache_resolve_keys_total" in http.get("/metrics").text
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), err  # uvicorn shuts down cleanly, then re-raises SIGTERM
    logs = out + err
    assert "GET /v1/blobs/" in logs  # the access log ran …
    for secret in (ADMIN_TOKEN, worker_token, reader_token):  # … and printed no token
        assert secret not in logs


@pytest.fixture
def served(store: Any, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    with LiveServer(tmp_path, store=store, admin_token=ADMIN_TOKEN, start_timeout=START_TIMEOUT,
                    max_request_bytes=8 << 20, max_blob_bytes=4 << 20) as srv:
        yield srv.url, store


def test_uvicorn_large_blobs_and_concurrent_clients(served: tuple[str, Any], make_spec: Any, make_plan: Any,
                                                     gpu_env: Any) -> None:
    base, store = served
    admin = bearer(ADMIN_TOKEN)
    keys, blobs = [], {}
    with httpx.Client(base_url=base, timeout=60.0) as http:
        for i in range(4):
            key, spec = make_spec(i)
            meta, blob = make_plan(key, gpu_env, blob=os.urandom((i + 1) << 20))
            r = upload(http, meta, blob, spec, headers=admin)
            assert r.status_code == 201, r.text
            keys.append(key)
            blobs[hashlib.sha256(blob).hexdigest()] = blob
        body = {"environment": gpu_env.model_dump(), "graph_keys": keys, "include_blobs": True}

        def resolve_and_fetch(_: int) -> bool:
            with httpx.Client(base_url=base, timeout=60.0, headers=admin) as c:
                plans = c.post("/v1/plans/resolve", json=body).json()["plans"]

                def answered(p: dict[str, Any]) -> bytes:  # inline, or where the answer says (a presigned URL on S3)
                    if p["blob_b64"] is not None:
                        return base64.b64decode(p["blob_b64"])
                    url = p["blob_url"]
                    return (httpx.get(url, timeout=60.0) if url.startswith("http") else c.get(url)).content

                inline_ok = all(answered(p) == blobs[p["record"]["blob_sha256"]] for p in plans.values())
                fetched_ok = all(c.get(f"/v1/blobs/{d}").content == b for d, b in blobs.items())
                return len(plans) == 4 and inline_ok and fetched_ok

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(resolve_and_fetch, range(16)))


def test_uvicorn_refuses_a_streamed_body_over_the_limit(served: tuple[str, Any], gpu_env: Any, make_spec: Any,
                                                        make_plan: Any) -> None:
    base, store = served
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env, blob=b"z" * (2 << 20))
    inline = upload_json(meta, spec, blob_b64=base64.b64encode(blob).decode())  # an outdated worker's upload
    payload = json.dumps(inline).encode()  # 2.8 MB: over a plan upload's body limit (2.06 MiB)
    assert len(payload) > record_body_limit(Settings())

    def stream() -> Iterator[bytes]:
        for i in range(0, len(payload), 1 << 16):
            yield payload[i:i + (1 << 16)]

    with httpx.Client(base_url=base, timeout=60.0) as http:
        r = http.put("/v1/plans", content=stream(), headers={**bearer(ADMIN_TOKEN), "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert r.json()["error"]["message"].startswith("request body")
    # the server is fine afterwards (as `plancache serve` does, it dropped the refused connection: ask on a new one)
    assert httpx.get(f"{base}/healthz", timeout=10.0).status_code == 200
    assert store.get_plan(key, gpu_env) is None
