"""Run in a fresh process by the client GPU tests; prints one JSON line.

``fetch``: a new :class:`PlanCache` prefetches the given specs (server and/or disk cache), runs every
plan through ``Plan.execute`` on fresh inputs and compares with the float32 reference.
``family``: heuristic builds of one spec at several shapes through one ``PlanCache`` (the family's
kernel cache), each timed and checked, plus a control build of a further shape without the cache.

usage: python -m tests.client_gpu_child fetch --cache DIR [--server URL --token T --trusted DIR] SPEC.json...
       python -m tests.client_gpu_child family --cache DIR SPEC.json OVERRIDES_JSON CONTROL_JSON
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def _run_and_check(plan: Any, spec: Any, seed: int) -> dict[str, float]:
    import torch

    from plancache import gpu

    dev = torch.device("cuda", 0)
    inputs = gpu.make_inputs(spec, dev, seed=seed)
    outputs = gpu.allocate_outputs(spec, dev)
    plan.execute(**inputs, **outputs)
    torch.cuda.synchronize()
    return gpu.output_errors(spec, outputs, gpu.reference_outputs(spec, inputs))


def fetch(args: argparse.Namespace) -> dict[str, Any]:
    from plancache.client import PlanCache
    from plancache.spec import parse_spec

    specs = [parse_spec(Path(p).read_text()) for p in args.specs]
    t0 = time.perf_counter()
    pc = PlanCache(args.server, token=args.token, trusted_keys=args.trusted, cache_dir=args.cache, mode=args.mode)
    created_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    plans = pc.prefetch(specs)
    prefetch_ms = (time.perf_counter() - t0) * 1000
    out = {}
    for spec in specs:
        plan = plans[spec.graph_key]
        out[spec.name] = {"source": plan.source, "errors": _run_and_check(plan, spec, seed=4242),
                          "engine_id": plan.engine_id}
    return {"plans": out, "stats": pc.stats().as_dict(), "create_ms": created_ms, "prefetch_ms": prefetch_ms}


def family(args: argparse.Namespace) -> dict[str, Any]:
    from plancache import gpu
    from plancache.client import PlanCache, family_key
    from plancache.spec import parse_spec

    base = parse_spec(Path(args.spec).read_text())
    shapes = [base.with_dims(o) for o in json.loads(args.overrides)]
    pc = PlanCache("", cache_dir=args.cache, trusted_keys=[])
    builds = []
    for spec in shapes:
        t0 = time.perf_counter()
        plan = pc.plan(spec)
        build_ms = (time.perf_counter() - t0) * 1000
        builds.append({"dims": {n: list(t.dims) for n, t in spec.tensors.items()}, "source": plan.source,
                       "build_ms": build_ms, "errors": _run_and_check(plan, spec, seed=99)})
    control = base.with_dims(json.loads(args.control))
    t0 = time.perf_counter()
    gpu.build_heuristic(control, pc._backend.handle)
    control_ms = (time.perf_counter() - t0) * 1000
    return {"builds": builds, "control_static_ms": control_ms,
            "dynamic": family_key(base) not in pc._static_families, "stats": pc.stats().as_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--cache", required=True)
    f.add_argument("--server")
    f.add_argument("--token")
    f.add_argument("--trusted")
    f.add_argument("--mode", default="normal")
    f.add_argument("specs", nargs="+")
    g = sub.add_parser("family")
    g.add_argument("--cache", required=True)
    g.add_argument("spec")
    g.add_argument("overrides")
    g.add_argument("control")
    args = parser.parse_args()
    print(json.dumps(fetch(args) if args.cmd == "fetch" else family(args)))


if __name__ == "__main__":
    main()
