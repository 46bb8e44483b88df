"""GPU end to end: the real worker (``plancache worker``, GpuTuner) against a real server tunes the three
seed examples and publishes signed plans that verify, reload and beat (or match) the heuristic choice."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from plancache.client.remote import Remote
from plancache.http import Retry
from plancache.protocol import PlanRecord, TargetEnvironment, TuneRequest
from plancache.signing import TrustedKeys, keygen
from plancache.spec import parse_spec
from plancache.worker import JobsApi
from tests.gpu_util import requires_gpu
from tests.live_server import LiveServer

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ["conv_bias_relu", "matmul_scale_bias_gelu_amax", "sdpa_causal"]
BUDGET_S = 300


def test_real_worker_tunes_publishes_and_signs_the_seed_examples(tmp_path):
    from plancache import gpu
    from plancache.environment import detect

    priv, pub, key_id = keygen(tmp_path / "keys", "gpu-worker")
    trusted = TrustedKeys.from_files([pub])
    env = detect(0)
    specs = {n: parse_spec((ROOT / "examples" / f"{n}.json").read_text()) for n in SEEDS}
    with LiveServer(tmp_path, lease_seconds=30) as srv:
        with JobsApi.open(srv.url, srv.admin_token, retry=Retry(within=5)) as admin:
            for s in specs.values():
                Remote(admin.http).register_spec(s)
            jobs = admin.enqueue(TuneRequest(graph_keys=[s.graph_key for s in specs.values()],
                                             targets=[TargetEnvironment.exactly(env)]))
        assert len(jobs) == 3
        cmd = [sys.executable, "-m", "plancache", "worker", "--server", srv.url, "--token", srv.token("worker"),
               "--signing-key", str(priv), "--spool-dir", str(tmp_path / "spool"), "--worker-id", "gpu-test-worker",
               "--once", "--poll-interval", "0.1"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BUDGET_S)
        elapsed = time.perf_counter() - t0
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert not [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]

        headers = {"Authorization": f"Bearer {srv.token('reader')}"}
        rows = []
        with JobsApi.open(srv.url, srv.admin_token, retry=Retry(within=5)) as admin:
            for job in jobs:
                done = admin.job(job.id)
                assert (done.status, done.attempts) == ("succeeded", 1), (done, proc.stderr[-4000:])
        for name, s in specs.items():
            r = httpx.get(f"{srv.url}/v1/plans/{s.graph_key}", params=env.validity(), headers=headers)
            assert r.status_code == 200, r.text
            rec = PlanRecord.model_validate(r.json())
            trusted.verify(rec)
            assert rec.signer_key_id == key_id and rec.worker_id == "gpu-test-worker"
            assert rec.environment.validity() == env.validity()
            blob = httpx.get(f"{srv.url}/v1/blobs/{rec.blob_sha256}", headers=headers).content
            assert len(blob) == rec.blob_size
            gpu.verify_plan(s, blob)  # the published bytes reload and match the reference here too
            assert rec.heuristic_median_ms is not None
            assert rec.winner_median_ms <= rec.heuristic_median_ms * 1.05
            rows.append((name, rec.tuning_seconds, rec.winner_median_ms, rec.heuristic_median_ms))
    print(f"\nworker end to end on {env.describe()}: {elapsed:.1f} s for {len(rows)} jobs")
    print(f"{'graph':<30} {'tuning s':>9} {'winner ms':>10} {'heuristic ms':>13} {'speedup':>8}")
    for name, secs, win, heur in rows:
        print(f"{name:<30} {secs:>9.2f} {win:>10.4f} {heur:>13.4f} {heur / win:>7.2f}x")
