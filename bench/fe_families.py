"""Per-family figures for the FE example graphs (examples/fe/graphs.py) on this GPU.

For every family: autotune it from its document alone (candidates, winner vs heuristic median, normalised
error, the numerics check applied), then in fresh processes with ``CUDA_CACHE_DISABLE=1`` time what a
user's process pays until the plan is ready to execute, from ``cudnn.create_handle()`` on (library
start-up included, as for the first graph of a process):

* **build**: construct the graph with the user's code, then ``validate → build_operation_graph →
  create_execution_plans(A, FALLBACK) → check_support → build_plans``;
* **load**: construct the graph with the user's code, then deserialize the tuned blob into it.

Both children then execute once, so a plan that is "ready" also runs.

    python bench/fe_families.py [--only NAME ...] [--out bench/results/fe_families.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "fe"))
sys.path.insert(0, str(ROOT))


def _child(name: str, blob_path: str | None) -> dict:
    """One fresh process: handle → construct → build or deserialize → one execute. Times in ms."""
    import cudnn
    import graphs
    import torch

    from plancache import gpu

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    t0 = time.perf_counter()
    handle = cudnn.create_handle()
    t_handle = time.perf_counter()
    g, tensors = graphs.EXAMPLES[name](handle)
    spec = gpu.canonicalize_uids(g)
    if blob_path is None:
        plan = gpu.build_heuristic(spec, handle, graph=g)
    else:
        plan = gpu.deserialize_plan(spec, Path(blob_path).read_bytes(), handle, graph=g)
    t_ready = time.perf_counter()
    inputs = gpu.make_inputs(spec, dev, seed=5)
    outputs = gpu.allocate_outputs(spec, dev, gpu.runtime.plan_layouts(plan))
    by_uid = {t.uid: t for t in tensors.values()}
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device=dev)
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    g.execute({by_uid[u]: v for u, v in {**inputs, **outputs}.items()}, ws, handle=handle)
    torch.cuda.synchronize()
    expected, check = gpu.expected_outputs(spec, inputs, handle, dev)
    err = gpu.compare_outputs(spec, outputs, expected, inputs=inputs)
    return {"ready_ms": (t_ready - t0) * 1e3, "handle_ms": (t_handle - t0) * 1e3, "err": err, "check": check}


def _fresh(name: str, blob_path: str | None) -> dict:
    env = {**os.environ, "CUDA_CACHE_DISABLE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--child", name] + (["--blob", blob_path] if blob_path else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tune(name: str, blob_dir: Path) -> dict:
    import graphs

    from plancache import gpu
    from plancache.spec import from_pygraph

    spec = gpu.runtime.canonical(json.loads(json.dumps(from_pygraph(graphs.EXAMPLES[name]()[0]).to_json())))
    tuned = gpu.autotune(spec, warmup=3, repeats=20)
    path = blob_dir / f"{name}.plan"
    path.write_bytes(tuned.blob)
    ok = [c for c in tuned.candidates if c.status == "ok"]
    return {"blob": str(path), "candidates": len(tuned.candidates), "passed": len(ok),
            "winner_ms": tuned.winner_median_ms, "heuristic_ms": tuned.heuristic_median_ms,
            "tune_s": tuned.tuning_seconds, "tune_err": tuned.max_abs_err, "check": tuned.numerics_check}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--blob")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fe_families.json"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.blob)))
        return
    import graphs

    names = args.only or sorted(graphs.EXAMPLES)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = _tune(name, Path(tmp))
            build = _fresh(name, None)
            load = _fresh(name, row.pop("blob"))
            row.update(build_ms=build["ready_ms"], load_ms=load["ready_ms"], handle_ms=load["handle_ms"],
                       err=max(build["err"], load["err"]), run_check=load["check"])
            rows[name] = row
            print(f"{name:22s} cand {row['candidates']:3d} ({row['passed']:3d} ok)  winner {row['winner_ms']:.4f} ms  "
                  f"heuristic {row['heuristic_ms'] or float('nan'):.4f} ms  cold build {row['build_ms']:7.1f} ms  "
                  f"construct+deserialize {row['load_ms']:6.1f} ms  err {row['err']:.2e}  {row['check']}", flush=True)
    import cudnn
    import torch

    ratios = [r["build_ms"] / r["load_ms"] for r in rows.values()]
    result = {"gpu": torch.cuda.get_device_name(0), "cudnn": cudnn.backend_version(), "fe": cudnn.__version__,
              "torch": torch.__version__, "families": rows, "median_build_over_load": statistics.median(ratios)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"median cold build / construct+deserialize: {result['median_build_over_load']:.1f}x -> {args.out}")


if __name__ == "__main__":
    main()
