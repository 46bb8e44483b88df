"""Every FE example family end to end on the GPU: the worker tunes it from the document alone, a newly
constructed graph (the user's own code) gets the blob deserialized into it, runs with its own Tensor
handles, and matches the numerics check; the pygraph.build hook serves @cudnn.jit-style code."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "fe"))
import graphs  # noqa: E402

from plancache import gpu  # noqa: E402
from plancache.gpu import reference  # noqa: E402
from plancache.spec import from_pygraph, parse_spec  # noqa: E402
from tests.gpu_util import loaded_engine_id  # noqa: E402


def _run_user_graph(g, spec, tensors, handle, seed):
    dev = torch.device("cuda")
    inputs = reference.make_inputs(spec, dev, seed=seed)
    layouts = {t.uid: (list(t.dim), list(t.stride)) for t in g._tensor_by_uid.values()}
    outputs = reference.allocate_outputs(spec, dev, layouts)
    by_uid = {t.uid: t for t in tensors.values()}
    pack = {by_uid[u]: v for u, v in {**inputs, **outputs}.items()}  # the user's own Tensor handles
    ws = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=dev)
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    g.execute(pack, ws, handle=handle)
    torch.cuda.synchronize()
    expected, check = gpu.expected_outputs(spec, inputs, handle, dev)
    return reference.compare_outputs(spec, outputs, expected, inputs=inputs), check


@pytest.mark.parametrize("name", sorted(graphs.EXAMPLES))
def test_family_tuned_from_the_document_runs_in_the_users_own_graph(name):
    g0, _ = graphs.EXAMPLES[name]()
    doc = json.loads(json.dumps(from_pygraph(g0).to_json()))        # what a server stores
    spec = parse_spec(doc)
    tuned = gpu.autotune(spec, warmup=2, repeats=10)
    assert tuned.numerics_check == "reference"                     # every family has a float32 reference, never cuDNN vs cuDNN
    gpu.verify_plan(spec, tuned.blob)                               # the blob reloads and passes again
    handle = gpu.create_handle()
    g, tensors = graphs.EXAMPLES[name](handle)                      # the user's code, a new graph
    user_spec = gpu.canonicalize_uids(g)
    assert user_spec.graph_key == spec.graph_key
    t0 = time.perf_counter()
    gpu.deserialize_plan(user_spec, tuned.blob, handle, graph=g)
    load_ms = (time.perf_counter() - t0) * 1e3
    assert loaded_engine_id(g) == tuned.engine_id                  # the engine cuDNN loaded, read back from it
    err, check = _run_user_graph(g, user_spec, tensors, handle, seed=77)
    assert check == "reference"
    print(f"\nFAMILY {name}: candidates={len(tuned.candidates)} winner={tuned.winner_median_ms:.4f}ms "
          f"heuristic={tuned.heuristic_median_ms}ms tune={tuned.tuning_seconds:.2f}s load={load_ms:.1f}ms "
          f"err={err:.2e} check={check}")


def test_jit_style_code_goes_through_the_hook(tmp_path):
    from plancache.client import PlanCache, hook

    cache = PlanCache(server_url="", cache_dir=tmp_path)
    handle = gpu.create_handle()

    @cudnn.jit(heur_modes=[cudnn.heur_mode.A])
    def make():
        g, tensors = graphs.EXAMPLES["conv_fprop"](handle)
        return g, list(tensors.values())

    with hook.installed(cache):
        g, uids = make()
    assert cache.stats().fe_builds == {"miss": 1}                 # no server: FE built it, with the caller's modes
    assert len(uids) == 3 and all(isinstance(u, int) for u in uids)
    assert g.get_workspace_size() >= 0
