"""GPU tests of the client: a fresh process fetches plans tuned on this GPU from a live server -- specs, and
FE example graphs the user's own code constructs and hands to ``PlanCache.build`` -- and runs them with
reference numerics (then again offline from its disk cache); CUDA-graph replay matches eager execution,
also after new data is copied into the captured tensors; a dynamic-shape family builds its later shapes
from the family's kernel cache much faster than its first."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from examples.generate import conv_bias_relu, matmul_epilogue, sdpa_causal
from plancache.spec import GraphSpec, parse_spec
from tests.gpu_util import requires_gpu
from tests.live_server import LiveServer

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ["conv_bias_relu", "matmul_scale_bias_gelu_amax", "sdpa_causal"]
#: FE example graphs (examples/fe/graphs.py) the fresh process constructs with the user's own code.
FE_FAMILIES = ["sdpa_bwd", "layernorm_fwd_train", "conv_dgrad", "fp8_matmul", "paged_decode"]
CHILD_TIMEOUT = 120


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


def assert_within_tolerance(spec: GraphSpec, errors: dict, what: str) -> None:
    """``errors`` of every output of the canonical ``spec``, by uid (an int, or its JSON string), each within
    the tolerance of the output's data type."""
    from plancache.gpu.reference import TOLERANCE

    assert {int(u) for u in errors} == {t.uid for t in spec.output_tensors()}, f"{what}: outputs {sorted(errors)}"
    for uid, err in errors.items():
        t = spec.tensor(int(uid))
        assert err <= TOLERANCE[spec.data_type_of(t)], f"{what}: output {t.name or uid} error {err}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live server holding signed plans autotuned here, from their documents alone, for the seed examples and
    the FE families. Specs are canonical documents (the uids plans are fed by)."""
    from examples.fe import graphs
    from plancache import gpu
    from plancache.signing import Signer, keygen
    from plancache.spec import from_pygraph

    root = tmp_path_factory.mktemp("client_gpu")
    priv, _, _ = keygen(root / "keys")
    signer = Signer.from_file(priv)
    specs = {name: parse_spec(spec_path(name).read_text()).canonical_document() for name in SEEDS}
    specs |= {name: from_pygraph(graphs.EXAMPLES[name]()[0]).canonical_document() for name in FE_FAMILIES}
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
    todo = [*(f"--graph={n}" for n in FE_FAMILIES), *(str(spec_path(n)) for n in SEEDS)]
    online = child("fetch", "--cache", cache, "--server", srv.url, "--token", srv.token("reader"),
                   "--trusted", str(root / "keys"), "--mode", "strict", *todo)
    offline = child("fetch", "--cache", cache, "--server", "", "--trusted", str(root / "keys"),
                    "--mode", "replay_only", *todo)
    for run, source in ((online, "server"), (offline, "disk")):
        assert run["stats"]["rejects"] == {} and run["stats"]["hits"] == {source: len(specs)}
        for name, spec in specs.items():
            got = run["plans"][spec.graph_key]
            # the engine cuDNN reports for the plan loaded in that process, not the record's own field
            assert got["source"] == source and got["engine_id"] == tuned[name].engine_id, (name, got)
            assert got["check"] == "reference", (name, got["check"])
            assert_within_tolerance(spec, got["errors"], f"{name} from {source}")
        print(f"\n{source}: PlanCache() {run['create_ms']:.0f} ms, prefetch of {len(SEEDS)} specs "
              f"{run['prefetch_ms']:.1f} ms, then {len(FE_FAMILIES)} user graphs through PlanCache.build "
              f"(deserialize in all {run['stats']['deserialize_seconds'] * 1000:.1f} ms)")


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
        plan.execute({**inputs, **eager})
        captured_in = {u: t.clone() for u, t in inputs.items()}
        captured_out = gpu.allocate_outputs(spec, dev)
        graph = plan.capture({**captured_in, **captured_out})
        graph.replay()
        torch.cuda.synchronize()
        first = gpu.output_errors(spec, captured_out, eager, inputs=captured_in)
        assert max(first.values()) <= 1e-3, first
        # New data goes in through the captured pointers; scalars keep their captured values.
        fresh = gpu.make_inputs(spec, dev, seed=2)
        for u, t in captured_in.items():
            if not spec.tensor(u).is_pass_by_value:
                t.copy_(fresh[u])
                fresh[u] = t.clone()
            else:
                fresh[u] = t
        eager2 = gpu.allocate_outputs(spec, dev)
        plan.execute({**fresh, **eager2})  # eager after capture: the handle is back on the current stream
        graph.replay()
        torch.cuda.synchronize()
        second = gpu.output_errors(spec, captured_out, eager2, inputs=fresh)
        assert max(second.values()) <= 1e-3, second
        reference = gpu.reference_outputs(spec, fresh)
        assert_within_tolerance(spec, gpu.output_errors(spec, captured_out, reference, inputs=fresh), name)
    print(f"\n{name}: replay vs eager {max(first.values()):.2e} / {max(second.values()):.2e}")


def _family(shapes: list[GraphSpec], control: GraphSpec, tmp_path: Path) -> dict:
    """Heuristic builds of ``shapes`` in one cold process (spec files in ``tmp_path``), each checked."""
    files = []
    for i, spec in enumerate([control, *shapes]):
        path = tmp_path / f"shape{i}.json"
        path.write_text(json.dumps(spec.to_json()))
        files.append(str(path))
    res = child("family", "--cache", str(tmp_path / "cache"), "--control", files[0], *files[1:], cold=True)
    for spec, b in zip(shapes, res["builds"], strict=True):
        assert b["graph_key"] == spec.graph_key and b["source"] == "heuristic"
        assert b["check"] == "reference", (spec.name, b["check"])
        assert_within_tolerance(spec.canonical_document(), b["errors"], spec.name)
    times = [round(b["build_ms"], 1) for b in res["builds"]]
    print(f"\n{shapes[0].name} family (CUDA_CACHE_DISABLE=1, dynamic={res['dynamic']}): build ms per shape {times}; "
          f"a further shape built without the kernel cache: {res['control_static_ms']:.1f} ms")
    return res


def test_a_shape_family_builds_later_shapes_from_its_kernel_cache(tmp_path):
    """Batch sizes of the fused conv: the first build compiles, the later ones reuse its kernels."""
    res = _family([conv_bias_relu(n=n) for n in (8, 16, 32, 4)], conv_bias_relu(n=24), tmp_path)
    assert res["dynamic"], "the conv family fell back to static builds"
    first, later = res["builds"][0]["build_ms"], [b["build_ms"] for b in res["builds"][1:]]
    assert statistics.median(later) < first / 4, (first, later)


@pytest.mark.parametrize("make, sizes, control", [
    # Only conv/pointwise graphs are built from a kernel cache (plancache.gpu.families.kernel_cache_safe):
    # these families are built statically.
    pytest.param(lambda b: matmul_epilogue(batch=b), (16, 4, 8), 24, id="matmul_scale_bias_gelu_amax"),
    pytest.param(lambda s: sdpa_causal(seq=s), (1024, 256, 512), 384, id="sdpa_causal"),
])
def test_other_families_build_every_shape_correctly(tmp_path, make, sizes, control):
    """Whether or not a family's graphs can be built with dynamic shapes, every shape is right; timings reported."""
    res = _family([make(x) for x in sizes], make(control), tmp_path)
    assert res["stats"]["hits"] == {"heuristic": len(sizes)}
