"""Tuning throughput on one GPU: the 49-graph workload tuned by one process building candidates itself,
then by one process timing while builder processes build.

    python bench/tuning.py --out bench/results [--processes N] [--limit N]

Each run is a fresh process with ``CUDA_CACHE_DISABLE=1`` that tunes every graph of
``bench/workload.py`` one after another, as a worker does its jobs (``--processes 0``: every candidate built in
the tuning process; the builder pool's start-up counts in the parallel run, and there each graph's builds are
queued while the graph before it is timed, as a worker claiming ahead does). Per graph it records the
winner and every candidate's median, so winners can be compared: the same candidate, or a different one
whose median in the in-process run is within ``--noise`` of that run's winner (a tie inside timing noise).
Writes ``tuning_parallel.json``, ``tuning_parallel.png`` and the parallel run's signed plans (``plans.json``, key
in ``keys/``, for ``bench/startup.py --plans``) into OUT; prints graphs per hour and
GPU-hours per 10,000 graphs for both.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import pyplot  # noqa: E402
from bench.workload import family, workload  # noqa: E402


def child(out: Path, processes: int, limit: int | None) -> None:
    """Tune the workload in this process; write ``run_<processes>.json``."""
    import torch

    from plancache import gpu
    from plancache.gpu.candidates import BuildPool
    from plancache.signing import Signer, keygen

    torch.cuda.init()
    specs = [s.canonical_document() for s in workload()][:limit]
    if processes:
        shutil.rmtree(out / "keys", ignore_errors=True)
    signer = Signer.from_file(keygen(out / "keys", "bench")[0]) if processes else None
    plans = []
    rows = []
    t0 = time.perf_counter()
    pool = BuildPool(processes) if processes else None
    try:
        for n, spec in enumerate(specs):  # as a worker does: the next graph's builds queued behind this one's
            following = specs[n + 1] if n + 1 < len(specs) else None
            t = gpu.autotune(spec, repeats=20, builders=pool, seed=7, following=following)
            rows.append({"name": spec.name, "family": family(spec.name), "tuning_s": t.tuning_seconds,
                         "build_s": t.build_seconds, "timing_s": t.timing_seconds, "winner": t.winner_index,
                         "winner_ms": t.winner_median_ms, "candidates": len(t.candidates),
                         "ok": sum(c.status == "ok" for c in t.candidates),
                         "medians": {str(c.index): c.median_ms for c in t.candidates}})
            if signer is not None:  # the parallel run's plans, signed, for bench/startup.py --plans
                meta = signer.sign(t.to_meta(spec.graph_key, worker_id="bench"))
                plans.append({"meta": meta.model_dump(mode="json"), "spec": spec.to_json(),
                              "blob_b64": base64.b64encode(t.blob).decode()})
            print(f"[{processes}] {spec.name}: {t.tuning_seconds:.2f} s, {len(t.candidates)} candidates, "
                  f"winner #{t.winner_index} {t.winner_median_ms:.4f} ms", flush=True)
    finally:
        if pool is not None:
            pool.close()
    total = time.perf_counter() - t0
    if plans:
        (out / "plans.json").write_text(json.dumps(plans))
    (out / f"run_{processes}.json").write_text(json.dumps({"processes": processes, "total_s": total, "graphs": rows}))


def _run(out: Path, processes: int, limit: int | None) -> dict:
    env = {**os.environ, "CUDA_CACHE_DISABLE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, __file__, "--child", str(processes), "--out", str(out)]
    subprocess.run(args + (["--limit", str(limit)] if limit else []), env=env, check=True)
    return json.loads((out / f"run_{processes}.json").read_text())


def compare(serial: dict, parallel: dict, noise: float) -> dict:
    """Per graph: the same winner, a tie within ``noise``, or a different winner (listed)."""
    per_graph, different = [], []
    for s, p in zip(serial["graphs"], parallel["graphs"]):
        same = s["winner"] == p["winner"]
        theirs = s["medians"].get(str(p["winner"]))  # the parallel winner's median in the serial run
        gap = None if theirs is None else theirs / s["winner_ms"] - 1
        verdict = "same" if same else "tie" if gap is not None and gap <= noise else "different"
        per_graph.append({"name": s["name"], "serial_winner": s["winner"], "parallel_winner": p["winner"],
                          "serial_winner_ms": s["winner_ms"], "parallel_winner_ms": p["winner_ms"],
                          "gap_in_serial_run": gap, "verdict": verdict,
                          "serial_s": s["tuning_s"], "parallel_s": p["tuning_s"]})
        if verdict == "different":
            different.append(s["name"])
    return {"per_graph": per_graph, "different": different}


def _per_family(run: dict) -> dict:
    fams: dict[str, float] = {}
    for g in run["graphs"]:
        fams[g["family"]] = fams.get(g["family"], 0.0) + g["tuning_s"]
    return fams


def _plot(out: Path, serial: dict, parallel: dict, speedup: float) -> None:
    plt = pyplot()
    if plt is None:
        return
    fams = ["conv", "matmul", "sdpa"]
    a, b = _per_family(serial), _per_family(parallel)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(fams))
    ax.bar([i - 0.2 for i in x], [a.get(f, 0) for f in fams], width=0.4, label="in-process builds", color="tab:orange")
    ax.bar([i + 0.2 for i in x], [b.get(f, 0) for f in fams], width=0.4,
           label=f"{parallel['processes']} builder processes", color="tab:green")
    ax.set_xticks(list(x))
    ax.set_xticklabels(fams)
    ax.set_ylabel("tuning seconds (sum over graphs)")
    ax.set_title(f"tuning {len(serial['graphs'])} graphs on one H200: {speedup:.2f}x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tuning_parallel.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--processes", type=int, default=None, help="builder processes (default: the worker's default)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N graphs (smoke runs)")
    ap.add_argument("--noise", type=float, default=0.03, help="relative gap that is a tie (default 3%%)")
    ap.add_argument("--child", type=int, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        child(args.out, args.child, args.limit)
        return
    from plancache.gpu.candidates import default_processes

    processes = default_processes() if args.processes is None else args.processes
    serial = _run(args.out, 0, args.limit)
    parallel = _run(args.out, processes, args.limit)
    n = len(serial["graphs"])
    speedup = serial["total_s"] / parallel["total_s"]
    cmp = compare(serial, parallel, args.noise)
    summary = {
        "graphs": n, "processes": processes, "cpu_cores": os.cpu_count(),
        "serial_s": serial["total_s"], "parallel_s": parallel["total_s"], "speedup": speedup,
        "graphs_per_hour": {"serial": n * 3600 / serial["total_s"], "parallel": n * 3600 / parallel["total_s"]},
        "gpu_hours_per_10k_graphs": {"serial": serial["total_s"] / n * 10_000 / 3600,
                                     "parallel": parallel["total_s"] / n * 10_000 / 3600},
        "per_family_s": {"serial": _per_family(serial), "parallel": _per_family(parallel)},
        "winners": {v: sum(g["verdict"] == v for g in cmp["per_graph"]) for v in ("same", "tie", "different")},
        "different": cmp["different"], "per_graph": cmp["per_graph"],
    }
    (args.out / "tuning_parallel.json").write_text(json.dumps(summary, indent=1))
    _plot(args.out, serial, parallel, speedup)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_graph"}, indent=1))


if __name__ == "__main__":
    main()
