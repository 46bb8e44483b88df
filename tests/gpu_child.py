"""Run in a fresh process by the GPU tests: deserialize a plan, execute it by canonical uid, check and time it; or,
as an independent baseline, build the spec with FE's own heuristics (``pygraph.build``, no plancache ladder) and
time that plan the same way.

usage: python tests/gpu_child.py SPEC.json PLAN.blob  → prints one JSON line (errors by output uid, the engine id
       read back from cuDNN after the load, the median ms)
       python tests/gpu_child.py --heuristic SPEC.json  → {"median_ms", "engine_id"} of FE's own heuristic build
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(spec_path: str, blob_path: str) -> None:
    import cudnn
    import torch

    from plancache import gpu
    from plancache.gpu.timing import median_ms
    from plancache.spec import parse_spec
    from tests.gpu_util import loaded_engine_id  # the GPU tests run this with the repository on PYTHONPATH

    spec = parse_spec(Path(spec_path).read_text()).canonical_document()
    blob = Path(blob_path).read_bytes()
    dev = torch.device("cuda", 0)
    handle = gpu.create_handle(0)
    cudnn.set_stream(handle, torch.cuda.current_stream(dev).cuda_stream)
    t0 = time.perf_counter()
    plan = gpu.deserialize_plan(spec, blob, handle)
    deserialize_ms = (time.perf_counter() - t0) * 1000
    inputs = gpu.make_inputs(spec, dev, seed=777)
    outputs = gpu.allocate_outputs(spec, dev)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device=dev)
    tensors = {**inputs, **outputs}
    plan.execute(tensors, ws, handle)
    torch.cuda.synchronize()
    errs = gpu.output_errors(spec, outputs, gpu.reference_outputs(spec, inputs), inputs=inputs)
    ms = median_ms(lambda: plan.execute(tensors, ws, handle), warmup=5, repeats=50, budget_s=None,
                   set_stream=lambda sid: cudnn.set_stream(handle, sid))
    print(json.dumps({"errors": errs, "deserialize_ms": deserialize_ms, "median_ms": ms,
                      "engine_id": loaded_engine_id(plan.graph)}))


def heuristic(spec_path: str) -> None:
    import cudnn
    import torch

    from plancache import gpu
    from plancache.gpu.fegraph import decode, graph_layouts
    from plancache.gpu.timing import median_ms
    from plancache.spec import parse_spec
    from tests.gpu_util import loaded_engine_id

    spec = parse_spec(Path(spec_path).read_text()).canonical_document()
    dev = torch.device("cuda", 0)
    handle = gpu.create_handle(0)
    cudnn.set_stream(handle, torch.cuda.current_stream(dev).cuda_stream)
    g = decode(spec, handle=handle)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])  # FE's own choice, as an FE user gets it
    tensors = {**gpu.make_inputs(spec, dev, seed=777), **gpu.allocate_outputs(spec, dev, graph_layouts(g))}
    ws = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=dev)
    g.execute(tensors, ws, handle=handle)
    torch.cuda.synchronize()
    ms = median_ms(lambda: g.execute(tensors, ws, handle=handle), warmup=5, repeats=50, budget_s=None,
                   set_stream=lambda sid: cudnn.set_stream(handle, sid))
    print(json.dumps({"median_ms": ms, "engine_id": loaded_engine_id(g)}))


if __name__ == "__main__":
    if sys.argv[1] == "--heuristic":
        heuristic(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
