"""Two GPUs of one host (skipped, saying so, where torch sees fewer than two CUDA devices).

A worker on device 1, chosen by ``--device 1`` or by ``CUDA_VISIBLE_DEVICES=1``, fingerprints device 1 and tunes
there alone: a process watching device 0 sees none of its memory taken meanwhile (a CUDA context alone, which any
stray call of the worker or of one of its builder processes would create there, holds hundreds of MiB of an H200).
``--all-devices`` runs a worker on each GPU. A ``PlanCache(device=1)`` in a process whose current device stays 0
loads, executes and captures on device 1 alone, with reference numerics, plans tuned on device 0 and on device 1;
two caches of one process, on devices 0 and 1, load the same plans at once and keep them apart. Every GPU step runs
in a fresh process (tests/multi_gpu_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from plancache.client.remote import Remote
from plancache.http import Retry
from plancache.protocol import PlanMeta, PlanRecord, TargetEnvironment, TuneRequest
from plancache.signing import Signer, keygen
from plancache.spec import GraphSpec, parse_spec
from plancache.worker import JobsApi
from tests.gpu_util import gpu_skip_reason
from tests.live_server import LiveServer


def _two_gpus_skip_reason() -> str | None:
    reason = gpu_skip_reason()
    if reason is not None:
        return reason
    import torch

    count = torch.cuda.device_count()
    return None if count >= 2 else f"needs two CUDA devices, torch sees {count}"


_REASON = _two_gpus_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"two-GPU test: {_REASON}")]

ROOT = Path(__file__).resolve().parents[2]
SEEDS = {"conv_bias_relu": 0, "matmul_scale_bias_gelu_amax": 1}  # spec name -> the device it is tuned on
TIMEOUT = 300
#: Device memory another process may take from the watched device without holding a context there.
UNTOUCHED_BYTES = 128 * 2**20


def spec_path(name: str) -> Path:
    return ROOT / "examples" / f"{name}.json"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


def child(*args: str, **env: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tests.multi_gpu_child", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=child_env(**env), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


class Watch:
    """A process holding device ``device`` that records the lowest free memory on it until :meth:`taken`."""

    def __init__(self, device: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.multi_gpu_child", "observe", "--device", str(device)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
        assert self.proc.stdout is not None
        self.free = json.loads(self.proc.stdout.readline())["free"]

    def taken(self) -> int:
        """Bytes of the device that others held at the worst moment since the watch began."""
        out, _ = self.proc.communicate("stop\n", timeout=30)
        assert self.proc.returncode == 0
        return int(self.free - json.loads(out.strip().splitlines()[-1])["lowest"])


def assert_within_tolerance(spec: GraphSpec, errors: dict[str, float], what: str) -> None:
    from plancache.gpu.reference import TOLERANCE

    doc = spec.canonical_document()
    assert {int(u) for u in errors} == {t.uid for t in doc.output_tensors()}, f"{what}: outputs {sorted(errors)}"
    for uid, err in errors.items():
        t = doc.tensor(int(uid))
        assert err <= TOLERANCE[doc.data_type_of(t)], f"{what}: output {t.name or uid} error {err}"


def enqueue(srv: LiveServer, specs: list[GraphSpec], device: int) -> list[Any]:
    from plancache.environment import detect

    with JobsApi.open(srv.url, srv.admin_token, retry=Retry(within=5)) as admin:
        for s in specs:
            Remote(admin.http).register_spec(s)
        return admin.enqueue(TuneRequest(graph_keys=[s.graph_key for s in specs],
                                         targets=[TargetEnvironment.exactly(detect(device))]))


def record(srv: LiveServer, spec: GraphSpec, device: int) -> PlanRecord:
    from plancache.environment import detect

    r = httpx.get(f"{srv.url}/v1/plans/{spec.graph_key}", params=detect(device).validity(),
                  headers={"Authorization": f"Bearer {srv.token('reader')}"})
    assert r.status_code == 200, r.text
    return PlanRecord.model_validate(r.json())


@pytest.mark.parametrize("by_option", [True, False], ids=["device-option", "cuda-visible-devices"])
def test_a_worker_on_device_1_fingerprints_and_tunes_there_alone(tmp_path, by_option):
    from plancache.environment import detect, device_selector

    priv, _, _ = keygen(tmp_path / "keys", "gpu-worker")
    specs = [parse_spec(spec_path(name).read_text()) for name in SEEDS]
    option = ["--device", "1"] if by_option else []
    env = {} if by_option else {"CUDA_VISIBLE_DEVICES": device_selector(1)}  # the worker's device 0
    with LiveServer(tmp_path, lease_seconds=60) as srv:
        jobs = enqueue(srv, specs, 1)
        watch = Watch(0)
        proc = subprocess.run([sys.executable, "-m", "plancache", "worker", "--server", srv.url, "--token",
                               srv.token("worker"), "--signing-key", str(priv), "--spool-dir", str(tmp_path / "spool"),
                               "--worker-id", "device-1", "--once", "--poll-interval", "0.1", "--build-processes", "4",
                               *option], capture_output=True, text=True, timeout=TIMEOUT, env=child_env(**env), cwd=ROOT)
        taken = watch.taken()
        assert proc.returncode == 0, proc.stderr[-4000:]
        with JobsApi.open(srv.url, srv.admin_token, retry=Retry(within=5)) as admin:
            assert [admin.job(j.id).status for j in jobs] == ["succeeded"] * len(jobs), proc.stderr[-4000:]
        for s in specs:
            rec = record(srv, s, 1)
            assert rec.worker_id == "device-1" and rec.environment == detect(1)
    assert detect(1).env_id in proc.stderr  # the worker fingerprinted the device it tuned on
    assert taken < UNTOUCHED_BYTES, f"{taken / 2**20:.0f} MiB of device 0 was taken while the worker ran on device 1"


def test_all_devices_runs_one_worker_per_gpu(tmp_path):
    priv, _, _ = keygen(tmp_path / "keys", "gpu-worker")
    specs = [parse_spec(spec_path(name).read_text()) for name in ["conv_bias_relu", "matmul_scale_bias_gelu_amax",
                                                                  "sdpa_causal"]]
    with LiveServer(tmp_path, lease_seconds=60) as srv:
        jobs = enqueue(srv, specs, 0)
        proc = subprocess.run([sys.executable, "-m", "plancache", "worker", "--all-devices", "--server", srv.url,
                               "--token", srv.token("worker"), "--signing-key", str(priv), "--spool-dir",
                               str(tmp_path / "spool"), "--worker-id", "host", "--once", "--poll-interval", "0.1",
                               "--build-processes", "4"], capture_output=True, text=True, timeout=TIMEOUT,
                              env=child_env(), cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with JobsApi.open(srv.url, srv.admin_token, retry=Retry(within=5)) as admin:
            assert [admin.job(j.id).status for j in jobs] == ["succeeded"] * len(jobs), proc.stderr[-4000:]
        import torch

        labels = {f"gpu{n}" for n in range(torch.cuda.device_count())}
        assert {record(srv, s, 0).worker_id for s in specs} <= {f"host-{label}" for label in labels}
    for label in labels:
        assert f"[{label}] " in proc.stderr and (tmp_path / "spool" / label).is_dir()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live server holding signed plans of the seeds, each tuned on the device :data:`SEEDS` gives it (by the
    worker's tuner, builder processes included, in a fresh process)."""
    root = tmp_path_factory.mktemp("multi_gpu")
    priv, pub, _ = keygen(root / "keys")
    signer = Signer.from_file(priv)
    specs = {name: parse_spec(spec_path(name).read_text()).canonical_document() for name in SEEDS}
    tuned = {}
    with LiveServer(root / "server") as srv:
        for name, device in SEEDS.items():
            out = root / f"tuned-{name}"
            tuned[name] = child("tune", "--device", str(device), "--out", str(out), str(spec_path(name)))
            meta = PlanMeta.model_validate_json((out / "meta.json").read_text())
            srv.store.put_spec(specs[name].graph_key, specs[name].to_json())
            srv.store.publish_plan(signer.sign(meta), (out / "blob").read_bytes())
        yield srv, root, pub, specs, tuned


def test_the_tuner_fingerprints_and_holds_only_its_device(served):
    _, _, _, _, tuned = served
    for name, device in SEEDS.items():
        t = tuned[name]
        assert t["environment"] == t["detected"], name
        assert t["contexts"] == [device], f"{name} tuned on device {device} made contexts on {t['contexts']}"
        assert t["allocated"][str(1 - device)] == 0, name


def test_a_cache_on_device_1_loads_executes_and_captures_there(served, tmp_path):
    srv, _, pub, specs, _ = served
    out = child("client", "--device", "1", "--cache", str(tmp_path), "--server", srv.url, "--token",
                srv.token("reader"), "--trusted", str(pub), *(str(spec_path(n)) for n in specs))
    assert out["current_device"] == 0 and out["contexts"] == [1], out  # nothing ran on device 0
    for name, spec in specs.items():
        result = out["plans"][spec.graph_key]
        assert result["source"] == "server", name  # tuned on device 0 or 1, loaded on device 1
        assert_within_tolerance(spec, result["eager"], f"{name} eager on device 1")
        assert_within_tolerance(spec, result["replay"], f"{name} replayed on device 1")


def test_two_caches_in_one_process_on_two_devices_stay_apart(served, tmp_path):
    srv, _, pub, specs, _ = served
    out = child("pair", "--cache", str(tmp_path), "--server", srv.url, "--token", srv.token("reader"),
                "--trusted", str(pub), *(str(spec_path(n)) for n in specs))
    assert out["handles_distinct"] and out["contexts"] == [0, 1], out
    for name, spec in specs.items():
        result = out["plans"][spec.graph_key]
        assert result["distinct"] and result["devices"] == ["cuda:0", "cuda:1"], (name, result)
        assert result["sources"] == ["server", "server"], (name, result)  # each cache its own load
        for device, key in ((0, "zero"), (1, "one")):
            assert_within_tolerance(spec, result[key]["eager"], f"{name} eager on device {device}")
            assert_within_tolerance(spec, result[key]["replay"], f"{name} replayed on device {device}")
            assert f"the plan runs on cuda:{device}" in result[key]["other_device_refused"], (name, result)


def test_the_hook_serves_a_graph_of_device_1_from_a_cache_of_device_1(served, tmp_path):
    """FE's ops build a graph with the handle of its tensors' device: with the hook's cache on device 0, a norm on
    ``cuda:1`` misses in a cache the hook made for device 1 (FE builds it, its spec captured); tuned on device 1 and
    published, a strict process then gets both graphs from the server through that device-1 cache, none through
    device 0's and none built by FE."""
    from plancache.client.capture import read_capture

    srv, root, pub, _, _ = served
    common = ("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(pub))
    first = child("hook", "--mode", "normal", "--cache", str(tmp_path / "first"), *common,
                  PLANCACHE_CAPTURE=str(tmp_path / "capture.json"))
    assert set(first["caches"]) == {"0", "1"} and first["current_device"] == 0, first
    assert first["caches"]["1"]["misses"] == 2 and first["caches"]["0"]["fe_builds"] == {"miss": 2}, first
    signer = Signer.from_file(root / "keys" / "plancache.key")  # the served fixture's signing key
    captured = [spec for spec, _ in read_capture(tmp_path / "capture.json")]
    assert len(captured) == 2
    for n, spec in enumerate(captured):
        path = tmp_path / f"captured-{n}.json"
        path.write_text(json.dumps(spec.to_json()))
        out = tmp_path / f"tuned-{n}"
        child("tune", "--device", "1", "--out", str(out), str(path))
        meta = PlanMeta.model_validate_json((out / "meta.json").read_text())
        srv.store.publish_plan(signer.sign(meta), (out / "blob").read_bytes())
    second = child("hook", "--mode", "strict", "--cache", str(tmp_path / "second"), *common)
    assert second["caches"]["1"]["hits"] == {"server": 2} and second["caches"]["0"]["hits"] == {}, second
    assert second["caches"]["0"]["fe_builds"] == {}, second
    for what, run in (("normal", first), ("strict", second)):
        assert all(e <= 2e-2 for e in run["errors"].values()), (what, run["errors"])
