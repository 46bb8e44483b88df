"""GPU tests of the client: a fresh process fetches plans tuned on this GPU from a live server and runs them
with reference numerics (then again offline from its disk cache); CUDA-graph replay matches eager
execution, also after new data is copied into the captured tensors; a dynamic-shape family builds its
later shapes from the family's kernel cache much faster than its first."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from plancache.spec import parse_spec
from tests.gpu_util import requires_gpu
from tests.live_server import LiveServer

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = Path(__file__).resolve().parents[1]
SEEDS = ["conv_bias_relu", "matmul_scale_bias_gelu_amax", "sdpa_causal"]
CHILD_TIMEOUT = 55


def spec_path(name: str) -> Path:
    return ROOT / "examples" / f"{name}.json"


def child(*args: str, cold: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    if cold:
        env["CUDA_CACHE_DISABLE"] = "1"  # no driver JIT cache: a first build pays its real compile cost
    proc = subprocess.run([sys.executable, "-m", "tests.client_gpu_child", *args], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_within_tolerance(spec, errors: dict[str, float], what: str) -> None:
    from plancache.gpu.reference import TOLERANCE

    for out, err in errors.items():
        assert err <= TOLERANCE[spec.outputs[out].dtype], f"{what}: output {out} error {err}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live server holding signed plans autotuned here for the seed examples."""
    from plancache import gpu
    from plancache.signing import Signer, keygen

    root = tmp_path_factory.mktemp("client_gpu")
    priv, _, _ = keygen(root / "keys")
    signer = Signer.from_file(priv)
    specs = {name: parse_spec(spec_path(name).read_text()) for name in SEEDS}
    with LiveServer(root / "server") as srv:
        tuned = {}
        for name, spec in specs.items():
            t = gpu.autotune(spec, warmup=2, repeats=5)
            srv.store.put_spec(spec.graph_key, spec.to_json())
            srv.store.publish_plan(signer.sign(t.to_meta(spec.graph_key, "client-gpu-test")), t.blob)
            tuned[name] = t
        yield srv, root, specs, tuned


def test_a_fresh_process_fetches_the_tuned_plans_and_runs_them_with_reference_numerics(served, tmp_path):
    srv, root, specs, tuned = served
    cache = str(tmp_path / "cache")
    files = [str(spec_path(n)) for n in SEEDS]
    online = child("fetch", "--cache", cache, "--server", srv.url, "--token", srv.token("reader"),
                   "--trusted", str(root / "keys"), "--mode", "strict", *files)
    offline = child("fetch", "--cache", cache, "--server", "", "--trusted", str(root / "keys"),
                    "--mode", "replay_only", *files)
    for run, source in ((online, "server"), (offline, "disk")):
        assert run["stats"]["rejects"] == {} and run["stats"]["hits"] == {source: len(SEEDS)}
        for name in SEEDS:
            got = run["plans"][specs[name].name]
            assert got["source"] == source and got["engine_id"] == tuned[name].engine_id
            assert_within_tolerance(specs[name], got["errors"], f"{name} from {source}")
        print(f"\n{source}: PlanCache() {run['create_ms']:.0f} ms, prefetch of {len(SEEDS)} plans {run['prefetch_ms']:.1f} ms "
              f"(deserialize {run['stats']['deserialize_seconds'] * 1000:.1f} ms)")


@pytest.mark.parametrize("name", SEEDS)
def test_cuda_graph_replay_matches_eager(served, tmp_path, name):
    import torch

    from plancache import gpu
    from plancache.client import PlanCache

    srv, root, specs, _ = served
    spec = specs[name]
    dev = torch.device("cuda", 0)
    with PlanCache(srv.url, token=srv.token("reader"), trusted_keys=str(root / "keys"), cache_dir=tmp_path) as pc:
        plan = pc.plan(spec)
        assert plan.source == "server"
        inputs = gpu.make_inputs(spec, dev, seed=1)
        eager = gpu.allocate_outputs(spec, dev)
        plan.execute(**inputs, **eager)
        captured_in = {n: t.clone() for n, t in inputs.items()}
        captured_out = gpu.allocate_outputs(spec, dev)
        graph = plan.capture(**captured_in, **captured_out)
        graph.replay()
        torch.cuda.synchronize()
        first = gpu.output_errors(spec, captured_out, eager)
        assert max(first.values()) <= 1e-3, first
        # New data goes in through the captured pointers; scalars keep their captured values.
        fresh = gpu.make_inputs(spec, dev, seed=2)
        for n, t in captured_in.items():
            if not spec.tensors[n].pass_by_value:
                t.copy_(fresh[n])
                fresh[n] = t.clone()
            else:
                fresh[n] = t
        eager2 = gpu.allocate_outputs(spec, dev)
        plan.execute(**fresh, **eager2)  # eager after capture: the handle is back on the current stream
        graph.replay()
        torch.cuda.synchronize()
        second = gpu.output_errors(spec, captured_out, eager2)
        assert max(second.values()) <= 1e-3, second
        assert_within_tolerance(spec, gpu.output_errors(spec, captured_out, gpu.reference_outputs(spec, fresh)), name)
    print(f"\n{name}: replay vs eager {max(first.values()):.2e} / {max(second.values()):.2e}")


def _family(name: str, overrides: list[dict], control: dict, tmp_path: Path) -> dict:
    res = child("family", "--cache", str(tmp_path / "cache"), str(spec_path(name)), json.dumps(overrides),
                json.dumps(control), cold=True)
    spec = parse_spec(spec_path(name).read_text())
    for b in res["builds"]:
        assert b["source"] == "heuristic"
        assert_within_tolerance(spec.with_dims(b["dims"]), b["errors"], f"{name} {b['dims']}")
    times = [round(b["build_ms"], 1) for b in res["builds"]]
    print(f"\n{name} family (CUDA_CACHE_DISABLE=1, dynamic={res['dynamic']}): build ms per shape {times}; "
          f"a further shape built without the kernel cache: {res['control_static_ms']:.1f} ms")
    return res


def test_a_shape_family_builds_later_shapes_from_its_kernel_cache(tmp_path):
    """Batch sizes of the fused conv: the first build compiles, the later ones reuse its kernels."""
    def batch(n: int) -> dict:
        return {"X": [n, 128, 56, 56]}

    res = _family("conv_bias_relu", [batch(n) for n in (8, 16, 32, 4)], batch(24), tmp_path)
    assert res["dynamic"], "the conv family fell back to static builds"
    first, later = res["builds"][0]["build_ms"], [b["build_ms"] for b in res["builds"][1:]]
    assert statistics.median(later) < first / 4, (first, later)


@pytest.mark.parametrize("name, overrides, control", [
    # cuBLASLt declines dynamic shapes for the matmul epilogue: its family is built statically.
    ("matmul_scale_bias_gelu_amax", [{"A": [b, 512, 1024], "B": [b, 1024, 512]} for b in (16, 4, 8)],
     {"A": [24, 512, 1024], "B": [24, 1024, 512]}),
    ("sdpa_causal", [{n: [4, 16, s, 64] for n in "qkv"} for s in (1024, 256, 512)], {n: [4, 16, 384, 64] for n in "qkv"}),
])
def test_other_families_build_every_shape_correctly(tmp_path, name, overrides, control):
    """Whether or not a family's graphs can be built with dynamic shapes, every shape is right; timings reported."""
    res = _family(name, overrides, control, tmp_path)
    assert res["stats"]["hits"] == {"heuristic": len(overrides)}
