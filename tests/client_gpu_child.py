"""Run in a fresh process by the client GPU tests; prints one JSON line, plans keyed by graph key and
errors by canonical output uid.

``fetch``: a new :class:`PlanCache` prefetches the given specs (server and/or disk cache) and runs every
plan through ``Plan.execute``; then, for each ``--graph NAME``, the user's own code constructs that FE
example graph (``examples/fe/graphs.py``) on the user's handle, hands it to ``PlanCache.build`` and runs
it with its own ``graph.execute`` and Tensor handles. Every run is on fresh inputs and is compared with
the float32 reference (:func:`plancache.gpu.expected_outputs` says which check applied).
``family``: heuristic builds of several shapes of one graph through one ``PlanCache`` (the family's
kernel cache), each timed and checked, plus a control build of a further shape without the cache.

usage: python -m tests.client_gpu_child fetch --cache DIR [--server URL --token T --trusted DIR] [--mode M]
           [--graph NAME ...] SPEC.json...
       python -m tests.client_gpu_child family --cache DIR --control SPEC.json SPEC.json...
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import cudnn
import torch

from examples.fe import graphs
from plancache import gpu
from plancache.client import Plan, PlanCache
from plancache.client.steps import HeuristicStep, family_key
from plancache.spec import GraphSpec, parse_spec
from tests.gpu_util import loaded_engine_id

DEV = torch.device("cuda", 0)


def _check(spec: GraphSpec, inputs: dict[int, torch.Tensor], outputs: dict[int, torch.Tensor],
           handle: Any) -> dict[str, Any]:
    expected, check = gpu.expected_outputs(spec, inputs, handle, DEV)
    return {"errors": gpu.output_errors(spec, outputs, expected, inputs=inputs), "check": check}


def _run_plan(plan: Plan, handle: Any, seed: int) -> dict[str, Any]:
    """A spec's plan, executed through ``Plan.execute`` by canonical uid."""
    spec = plan.spec.canonical_document()
    inputs = gpu.make_inputs(spec, DEV, seed=seed)
    outputs = gpu.allocate_outputs(spec, DEV)
    plan.execute({**inputs, **outputs})
    torch.cuda.synchronize()
    return _check(spec, inputs, outputs, handle)


def _run_user_graph(g: Any, tensors: dict[str, Any], plan: Plan, handle: Any, seed: int) -> dict[str, Any]:
    """The user's graph after ``PlanCache.build``, executed by the user's own call with the user's Tensor handles."""
    spec = plan.spec.canonical_document()  # build() renumbered the graph's tensors to these uids
    inputs = gpu.make_inputs(spec, DEV, seed=seed)
    outputs = gpu.allocate_outputs(spec, DEV, {t.uid: (list(t.dim), list(t.stride)) for t in g._tensor_by_uid.values()})
    by_uid = {t.uid: t for t in tensors.values()}
    ws = torch.empty(max(int(g.get_workspace_size()), 1), dtype=torch.uint8, device=DEV)
    cudnn.set_stream(handle, torch.cuda.current_stream(DEV).cuda_stream)
    g.execute({by_uid[u]: v for u, v in {**inputs, **outputs}.items()}, ws, handle=handle)
    torch.cuda.synchronize()
    return _check(spec, inputs, outputs, handle)


def fetch(args: argparse.Namespace) -> dict[str, Any]:
    specs = [parse_spec(Path(p).read_text()) for p in args.specs]
    t0 = time.perf_counter()
    pc = PlanCache(args.server, token=args.token, trusted_keys=args.trusted, cache_dir=args.cache, mode=args.mode)
    created_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    plans = pc.prefetch(specs)
    prefetch_ms = (time.perf_counter() - t0) * 1000
    handle = gpu.create_handle(0)  # the user's own
    out = {key: {"source": plan.source, "engine_id": loaded_engine_id(plan.graph), **_run_plan(plan, handle, seed=4242)}
           for key, plan in plans.items()}
    for name in args.graph:
        g, tensors = graphs.EXAMPLES[name](handle)  # the user's code: a new, unbuilt graph
        plan = pc.build(g)
        out[plan.graph_key] = {"source": plan.source, "engine_id": loaded_engine_id(g),
                               **_run_user_graph(g, tensors, plan, handle, seed=4242)}
    return {"plans": out, "stats": pc.stats().as_dict(), "create_ms": created_ms, "prefetch_ms": prefetch_ms}


def family(args: argparse.Namespace) -> dict[str, Any]:
    shapes = [parse_spec(Path(p).read_text()) for p in args.specs]
    pc = PlanCache("", cache_dir=args.cache, trusted_keys=[])
    handle = pc._backend.handle
    builds = []
    for spec in shapes:
        t0 = time.perf_counter()
        plan = pc.plan(spec)
        build_ms = (time.perf_counter() - t0) * 1000
        builds.append({"graph_key": plan.graph_key, "source": plan.source, "build_ms": build_ms,
                       **_run_plan(plan, handle, seed=99)})
    control = parse_spec(Path(args.control).read_text())
    t0 = time.perf_counter()
    gpu.build_heuristic(control, handle)
    control_ms = (time.perf_counter() - t0) * 1000
    heuristic = next(s for s in pc.steps if isinstance(s, HeuristicStep))
    return {"builds": builds, "control_static_ms": control_ms,
            "dynamic": family_key(shapes[0]) not in heuristic.static_families, "stats": pc.stats().as_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--cache", required=True)
    f.add_argument("--server")
    f.add_argument("--token")
    f.add_argument("--trusted")
    f.add_argument("--mode", default="normal")
    f.add_argument("--graph", action="append", default=[], choices=sorted(graphs.EXAMPLES))
    f.add_argument("specs", nargs="*")
    g = sub.add_parser("family")
    g.add_argument("--cache", required=True)
    g.add_argument("--control", required=True)
    g.add_argument("specs", nargs="+")
    args = parser.parse_args()
    print(json.dumps(fetch(args) if args.cmd == "fetch" else family(args)))


if __name__ == "__main__":
    main()
