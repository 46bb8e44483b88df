"""A real ``plancache serve`` (SQLite, loopback, a free port) seeded with plans, for the GPU benchmarks."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from bench.load_server import free_port

ROOT = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "bench-admin-token"


def serve_seeded(db: Path, uploads: Iterable[tuple[dict[str, Any], bytes]]) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start the server on a fresh SQLite file ``db`` and upload every plan as admin, as a worker does: ``(body,
    blob)``, the blob raw (``PUT /v1/blobs/{sha256}``), then the body (the record and its spec, ``PUT /v1/plans``);
    return the process, its URL and the admin token."""
    db.unlink(missing_ok=True)
    port = free_port()
    env = {**os.environ, "PLANCACHE_DATABASE_URL": f"sqlite:///{db}", "PLANCACHE_ADMIN_TOKEN": ADMIN_TOKEN,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "plancache", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("plancache serve did not come up")
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for body, blob in uploads:
        httpx.put(f"{url}/v1/blobs/{hashlib.sha256(blob).hexdigest()}", content=blob,
                  headers={**auth, "Content-Type": "application/octet-stream"}, timeout=30).raise_for_status()
        httpx.put(f"{url}/v1/plans", json=body, headers=auth, timeout=30).raise_for_status()
    return proc, url, ADMIN_TOKEN
