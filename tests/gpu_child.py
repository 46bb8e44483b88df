"""Run in a fresh process by the GPU tests: deserialize a plan, execute it by canonical uid, check and time it.

usage: python tests/gpu_child.py SPEC.json PLAN.blob  → prints one JSON line (errors by output uid)
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
    print(json.dumps({"errors": errs, "deserialize_ms": deserialize_ms, "median_ms": ms}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
