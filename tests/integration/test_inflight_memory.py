"""Every byte a request holds is counted in the in-flight budget (issue 37, finding 7): blob uploads into the
database store count the blob and the driver's copy, inline resolve answers hold no base64 copy of a blob.

Measured on a ``plancache serve`` process (its peak RSS, ``VmHWM``, above its RSS before the storm), with a 96 MiB
budget: 5 concurrent 24 MiB blob uploads into the database store, then (the peak reset) 6 concurrent resolves
inlining one 24 MiB blob each. On main 4d1a308 (uploads counted once, a blob's base64 made whole, then copied
twice): 257 MiB and 551 MiB. With the fix: 107-131 MiB and 102 MiB, within the budget and SLACK.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from plancache.store import open_store
from tests.factories import H200, make_meta
from tests.live_server import free_port

MIB = 1 << 20
BUDGET = 96 * MIB
BLOB = 24 * MIB
#: What the server's Python and libraries take beyond the budget in such a storm (buffers of the HTTP layer,
#: memory the allocator keeps after a free).
SLACK = 96 * MIB
ADMIN = "inflight-test-admin-token"


def _rss(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def _storm(calls: list[tuple[str, str, dict]], url: str) -> list[int]:
    codes: list[int] = []

    def one(method: str, path: str, kwargs: dict) -> None:
        headers = {"Authorization": f"Bearer {ADMIN}", **kwargs.pop("headers", {})}
        with httpx.Client(timeout=120) as client:
            codes.append(client.request(method, url + path, headers=headers, **kwargs).status_code)

    threads = [threading.Thread(target=one, args=(method, path, dict(kwargs))) for method, path, kwargs in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's peak RSS from /proc")
def test_uploads_and_inline_answers_stay_within_the_in_flight_budget(tmp_path, make_spec):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    key, spec = make_spec(0)
    with open_store(url, create=True) as store:
        store.put_spec(key, spec)
    port = free_port()
    env = {**os.environ, "PLANCACHE_DATABASE_URL": url, "PLANCACHE_ADMIN_TOKEN": ADMIN,
           "PLANCACHE_MAX_INFLIGHT_BYTES": str(BUDGET), "PLANCACHE_INFLIGHT_WAIT_SECONDS": "60",
           "PLANCACHE_BLOB_MEMORY_BYTES": "0", "PLANCACHE_AUTOTUNE": "false"}
    server = subprocess.Popen([sys.executable, "-m", "plancache", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        blobs = [bytes([i]) * BLOB for i in range(5)]
        idle = _rss(server.pid, "VmRSS")
        codes = _storm([("PUT", f"/v1/blobs/{hashlib.sha256(b).hexdigest()}",
                         {"content": b, "headers": {"Content-Type": "application/octet-stream"}}) for b in blobs], base)
        uploads_peak = _rss(server.pid, "VmHWM") - idle
        assert codes == [201] * 5
        meta = make_meta(key, H200, blobs[0], revision=1)
        r = httpx.put(f"{base}/v1/plans", json=meta.model_dump(mode="json") | {"spec": spec},
                      headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code in (200, 201), r.text
        body = {"environment": H200.model_dump(), "graph_keys": [key], "include_blobs": True}
        before = _rss(server.pid, "VmRSS")
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # the peak RSS starts again from here
        codes = _storm([("POST", "/v1/plans/resolve", {"json": body})] * 6, base)
        assert codes == [200] * 6
        peak = _rss(server.pid, "VmHWM") - before
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"in-flight budget {BUDGET / MIB:.0f} MiB: peak RSS above idle {uploads_peak / MIB:.0f} MiB after 5 "
          f"uploads of {BLOB / MIB:.0f} MiB; above its RSS then, {peak / MIB:.0f} MiB during 6 inline resolves")
    assert uploads_peak < BUDGET + SLACK and peak < BUDGET + SLACK
