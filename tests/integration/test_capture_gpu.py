"""Capture and pre-tune on the GPU: a run of FE's own ops that never imports plancache is captured
(``plancache capture``), the capture file is enqueued (``plancache enqueue``), a worker tunes the queue
(``plancache worker --once``), and a fresh strict-mode process then gets every graph from the server: FE plans
none of them and the outputs match the float32 reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plancache.client.capture import parse_capture
from tests.gpu_util import requires_gpu
from tests.live_server import LiveServer

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("sdpa_causal", "rms_norm")  # tests/fe_ops_gpu_child.py: forward + backward of each
TOLERANCE = 2e-2


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    base["CUDA_CACHE_DISABLE"] = "1"
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**base, **(env or {})})
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_a_captured_run_enqueued_and_tuned_is_served_in_strict_mode(tmp_path):
    from plancache.signing import keygen

    key_file, _, _ = keygen(tmp_path / "keys")
    plancache = [sys.executable, "-m", "plancache"]
    child = [sys.executable, "-m", "tests.fe_ops_gpu_child"]
    out = tmp_path / "graphs.json"
    with LiveServer(tmp_path / "server", autotune=False) as srv:
        run(*plancache, "capture", "--out", str(out), "--", *child, "--no-plancache", *PATHS)
        graphs = parse_capture(json.loads(out.read_text()))
        assert len(graphs) >= 4, [s.name for s, _ in graphs]  # a forward and a backward graph per path
        enqueued = run(*plancache, "enqueue", str(out), "--server", srv.url, "--token", srv.admin_token)
        assert enqueued.stdout.count("queued") == len(graphs), enqueued.stdout
        run(*plancache, "worker", "--server", srv.url, "--token", srv.token("worker"), "--once",
            "--spool-dir", str(tmp_path / "spool"), env={"PLANCACHE_SIGNING_KEY": str(key_file)}, timeout=900)
        jobs = srv.store.list_jobs()
        assert {j.source for j in jobs} == {"capture"}
        assert [j for j in jobs if j.status != "succeeded"] == [], [(j.graph_key[:12], j.error) for j in jobs]
        strict = run(*child, "--server", srv.url, "--token", srv.token("reader"), "--trusted",
                     str(tmp_path / "keys"), "--cache", str(tmp_path / "fresh-cache"), "--mode", "strict", *PATHS)
    result = json.loads(strict.stdout.strip().splitlines()[-1])
    assert result["stats"]["fe_builds"] == {} and result["stats"]["hits"] == {"server": len(graphs)}
    for name, got in result["paths"].items():
        assert "error" not in got, f"{name}: {got['error']}"
        assert all(err <= TOLERANCE for err in got["errors"].values()), (name, got["errors"])
        print(f"\n{name}: first call served in strict mode in {got['first_ms']:.1f} ms")
