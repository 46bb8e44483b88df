"""``plancache serve --log-level warning`` prints no access log; the ``listening on`` line still comes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.integration.test_uvicorn import REPO, wait_ready
from tests.live_server import free_port


def test_serve_at_warning_prints_no_access_log(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    env["PLANCACHE_DATABASE_URL"] = f"sqlite:///{tmp_path / 'plancache.db'}"
    proc = subprocess.Popen([sys.executable, "-m", "plancache", "serve", "--port", str(port), "--log-level", "warning"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert f"listening on http://127.0.0.1:{port}" in err, err
    assert "GET /healthz" not in out + err and "GET /readyz" not in out + err, out + err
