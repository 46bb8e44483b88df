"""GPU benchmarks: start-up, plan quality and tuning cost, side by side in one run.

    python bench/startup.py --out DIR [--limit N]

Phases, each in a fresh process with ``CUDA_CACHE_DISABLE=1`` (the driver's JIT cache would
hide cold-build cost):

1. ``tune``      autotune every workload graph (b); keep blobs and records; time candidate
                 builds serially vs on a thread pool for a sample of graphs.
2. ``heuristic`` local heuristic build of every graph (a).
3. ``fetch``     a real ``plancache serve`` (SQLite) is seeded with the signed plans; a fresh
                 client process prefetches all of them in one round trip and verifies +
                 deserializes each (c); every loaded plan is then checked against the reference.
4. ``quality``   per graph: tuned plan vs the heuristic's first choice vs PyTorch eager
                 (``cudnn.benchmark=True``), CUDA-event medians with p10/p90; runs under 0.5 ms
                 are timed by CUDA-graph replay so host launch overhead does not mask GPU time.

Writes ``startup.json``, ``quality.json``, ``tuning.json`` and a PNG per family into DIR.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import percentile, pyplot  # noqa: E402
from bench.workload import family, workload  # noqa: E402
from plancache.spec import GraphSpec  # noqa: E402


def _specs(limit: int | None) -> list[GraphSpec]:
    """The workload's canonical documents: the uids every GPU helper and ``Plan.execute`` key tensors by."""
    specs = [spec.canonical_document() for spec in workload()]
    return specs[:limit] if limit else specs


# ---------------------------------------------------------------- children (on the GPU)

def child_tune(out: Path, limit: int | None, parallel_probe: bool = True) -> None:
    import torch

    from plancache import gpu
    from plancache.signing import Signer

    signer = Signer.from_file(out / "keys" / "bench.key")
    torch.cuda.init()
    rows = []
    t_all = time.perf_counter()
    for spec in _specs(limit):
        tuned = gpu.autotune(spec, repeats=20)
        meta = signer.sign(tuned.to_meta(spec.graph_key, worker_id="bench"))
        (out / "plans").mkdir(exist_ok=True)
        (out / "plans" / f"{spec.graph_key}.json").write_text(json.dumps({
            "meta": meta.model_dump(mode="json"), "spec": spec.to_json(),
            "blob_b64": base64.b64encode(tuned.blob).decode(), "heuristic_index": tuned.heuristic_index}))
        rows.append({"name": spec.name, "family": family(spec.name), "candidates": len(tuned.candidates),
                     "ok": sum(c.status == "ok" for c in tuned.candidates), "tuning_s": tuned.tuning_seconds,
                     "build_s": tuned.build_seconds, "timing_s": tuned.timing_seconds,
                     "winner_ms": tuned.winner_median_ms, "heuristic_ms": tuned.heuristic_median_ms})
        print(f"tuned {spec.name}: {tuned.tuning_seconds:.2f} s, {len(tuned.candidates)} candidates", flush=True)
    total = time.perf_counter() - t_all
    specs = _specs(limit)
    sample = list({family(sp.name): sp for sp in specs}.values())  # one graph per family
    parallel = [_parallel_build(spec) for spec in sample] if parallel_probe else []
    (out / "tuning.json").write_text(json.dumps({"total_s": total, "graphs": rows, "parallel_build": parallel}, indent=1))


def _parallel_build(spec: GraphSpec) -> dict:
    """Build every candidate plan of ``spec`` serially, then on a thread pool (one graph per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    import cudnn

    from plancache.gpu.fegraph import decode
    from plancache.gpu.runtime import HEURISTIC_MODES

    handle = cudnn.create_handle()

    def planned():
        g = decode(spec, handle=handle)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([HEURISTIC_MODES[m] for m in spec.tuning.heuristic_modes])
        g.check_support()
        return g

    def build_share(share: list[int]) -> int:
        g = planned()
        built = 0
        for i in share:
            try:
                g.build_plan_at_index(i)
                built += 1
            except Exception:  # candidates that decline to build count as attempted
                pass
        return built

    n = planned().get_execution_plan_count()
    t0 = time.perf_counter()
    build_share(list(range(n)))
    serial = time.perf_counter() - t0
    threads = min(8, os.cpu_count() or 1, n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(build_share, [list(range(t, n, threads)) for t in range(threads)]))
    par = time.perf_counter() - t0
    return {"name": spec.name, "plans": n, "threads": threads, "serial_s": serial, "parallel_s": par, "gain": serial / par}


def child_heuristic(out: Path, limit: int | None) -> None:
    import torch

    from plancache import gpu

    t0 = time.perf_counter()
    torch.cuda.init()
    handle = gpu.create_handle(0)
    init_s = time.perf_counter() - t0
    per = []
    t_all = time.perf_counter()
    for spec in _specs(limit):
        t = time.perf_counter()
        gpu.build_heuristic(spec, handle)
        per.append({"name": spec.name, "family": family(spec.name), "ms": (time.perf_counter() - t) * 1000})
    total = time.perf_counter() - t_all
    (out / "heuristic.json").write_text(json.dumps({"init_s": init_s, "total_s": total, "graphs": per}))


def child_fetch(out: Path, limit: int | None, server: str, token: str) -> None:
    import torch

    from plancache import gpu
    from plancache.client import PlanCache
    from plancache.signing import TrustedKeys

    t0 = time.perf_counter()
    torch.cuda.init()
    gpu.create_handle(0)
    init_s = time.perf_counter() - t0
    specs = _specs(limit)
    cache_dir = Path(tempfile.mkdtemp(prefix="plancache-bench-"))
    t_construct = time.perf_counter()
    pc = PlanCache(server, token=token, trusted_keys=TrustedKeys.from_files([out / "keys" / "bench.pub"]),
                   cache_dir=cache_dir, mode="strict")
    construct_s = time.perf_counter() - t_construct
    t_all = time.perf_counter()
    pc.prefetch(specs)
    t_prefetch = time.perf_counter() - t_all
    plans = [pc.plan(spec) for spec in specs]
    total = time.perf_counter() - t_all
    stats = pc.stats()
    # correctness of what was loaded, outside the timed region
    dev = torch.device("cuda", 0)
    errors = {}
    for spec, plan in zip(specs, plans):
        inputs = gpu.make_inputs(spec, dev, seed=99)
        outputs = gpu.allocate_outputs(spec, dev)
        plan.execute({**inputs, **outputs})
        torch.cuda.synchronize()
        errors[spec.name] = gpu.compare_outputs(spec, outputs, gpu.reference_outputs(spec, inputs), inputs=inputs)
    (out / "fetch.json").write_text(json.dumps({
        "init_s": init_s, "construct_s": construct_s, "total_s": total, "prefetch_s": t_prefetch, "errors": errors,
        "stats": stats.as_dict()}, default=str))


def child_quality(out: Path, limit: int | None) -> None:
    import cudnn
    import torch

    from plancache import gpu
    from plancache.gpu.reference import evaluate
    from plancache.gpu.timing import timings_ms

    dev = torch.device("cuda", 0)
    handle = gpu.create_handle(0)
    cudnn.set_stream(handle, torch.cuda.current_stream(dev).cuda_stream)
    rows = []
    for spec in _specs(limit):
        rec = json.loads((out / "plans" / f"{spec.graph_key}.json").read_text())
        tuned = gpu.deserialize_plan(spec, base64.b64decode(rec["blob_b64"]), handle)
        heur = gpu.build_heuristic(spec, handle)
        inputs = gpu.make_inputs(spec, dev, seed=5)
        row = {"name": spec.name, "family": family(spec.name)}
        for label, plan in (("tuned", tuned), ("heuristic", heur)):
            outs = gpu.allocate_outputs(spec, dev)
            ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device=dev)
            tensors = {**inputs, **outs}
            ts = timings_ms(partial(plan.execute, tensors, ws, handle), warmup=10, repeats=100, budget_s=1.0,
                            set_stream=lambda sid: cudnn.set_stream(handle, sid))
            row[label] = {"median": statistics.median(ts), "p10": percentile(ts, 0.1), "p90": percentile(ts, 0.9)}
        torch.backends.cudnn.benchmark = True

        def run(spec=spec, inputs=inputs) -> None:
            evaluate(spec, inputs, exact_float32=False)

        ts = timings_ms(run, warmup=10, repeats=100, budget_s=1.0, set_stream=lambda sid: None)
        row["torch"] = {"median": statistics.median(ts), "p10": percentile(ts, 0.1), "p90": percentile(ts, 0.9)}
        rows.append(row)
        print(f"quality {spec.name}: tuned {row['tuned']['median']:.4f} heuristic {row['heuristic']['median']:.4f} "
              f"torch {row['torch']['median']:.4f} ms", flush=True)
    (out / "quality.json").write_text(json.dumps(rows, indent=1))


# ---------------------------------------------------------------- the orchestrator (no CUDA here)

def _child(phase: str, out: Path, limit: int | None, *extra: str, timeout: float = 900) -> None:
    env = {**os.environ, "CUDA_CACHE_DISABLE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, __file__, "--child", phase, "--out", str(out), *(["--limit", str(limit)] if limit else []),
            *extra]
    t0 = time.perf_counter()
    subprocess.run(args, env=env, check=True, timeout=timeout)
    print(f"[{phase}] process wall {time.perf_counter() - t0:.1f} s", flush=True)


def _serve_and_seed(out: Path, limit: int | None) -> tuple[subprocess.Popen[bytes], str, str]:
    from bench.serve import serve_seeded

    def uploads() -> Iterator[tuple[dict, bytes]]:
        for spec in _specs(limit):
            rec = json.loads((out / "plans" / f"{spec.graph_key}.json").read_text())
            yield {**rec["meta"], "spec": rec["spec"]}, base64.b64decode(rec["blob_b64"])

    return serve_seeded(out / "bench-server.db", uploads())


def _plot(out: Path, startup: dict, quality: list[dict], tuning: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["heuristic build (a)", "autotune (b)", "plancache fetch (c)"]
    vals = [startup["heuristic_s"], startup["autotune_s"], startup["fetch_s"]]
    ax.barh(labels, vals, color=["tab:orange", "tab:red", "tab:green"])
    ax.set_xscale("log")
    ax.set_xlabel(f"seconds for {startup['graphs']} graphs (log)")
    ax.set_title(f"start-up: (a)/(c) = {startup['a_over_c']:.0f}x, (b)/(c) = {startup['b_over_c']:.0f}x")
    fig.tight_layout()
    fig.savefig(out / "startup.png", dpi=110)
    for fam in ("conv", "matmul", "sdpa"):
        rows = [r for r in quality if r["family"] == fam]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.5))
        x = range(len(rows))
        for off, key, color in ((-0.27, "tuned", "tab:green"), (0, "heuristic", "tab:orange"), (0.27, "torch", "tab:blue")):
            med = [r[key]["median"] for r in rows]
            err = [[m - r[key]["p10"] for m, r in zip(med, rows)], [r[key]["p90"] - m for m, r in zip(med, rows)]]
            ax.bar([i + off for i in x], med, width=0.27, yerr=err, label=key, color=color)
        ax.set_xticks(list(x))
        ax.set_xticklabels([r["name"].replace("resnet50_", "").replace("sdpa_causal_", "") for r in rows], rotation=75,
                           fontsize=6)
        ax.set_ylabel("ms (median, p10–p90)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title(f"plan quality: {fam}")
        fig.tight_layout()
        fig.savefig(out / f"quality_{fam}.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None, help="only the first N graphs (smoke runs)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--no-parallel-probe", action="store_true", help="skip timing threaded candidate builds")
    ap.add_argument("--server", default=None)
    ap.add_argument("--token", default=None)
    args = ap.parse_args()
    out: Path = args.out
    if args.child:
        {"tune": lambda: child_tune(out, args.limit, not args.no_parallel_probe),
         "heuristic": lambda: child_heuristic(out, args.limit),
         "fetch": lambda: child_fetch(out, args.limit, args.server, args.token),
         "quality": lambda: child_quality(out, args.limit)}[args.child]()
        return
    from plancache.signing import keygen

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "keys" / "bench.key").exists():
        keygen(out / "keys", "bench")
    # Each phase is skipped when its result exists, so an interrupted run resumes where it stopped.
    if not (out / "tuning.json").exists():
        _child("tune", out, args.limit, *(["--no-parallel-probe"] if args.no_parallel_probe else []))
    if not (out / "heuristic.json").exists():
        _child("heuristic", out, args.limit)
    if not (out / "fetch.json").exists():
        proc, url, token = _serve_and_seed(out, args.limit)
        try:
            _child("fetch", out, args.limit, "--server", url, "--token", token)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if not (out / "quality.json").exists():
        _child("quality", out, args.limit)

    tuning = json.loads((out / "tuning.json").read_text())
    heuristic = json.loads((out / "heuristic.json").read_text())
    fetch = json.loads((out / "fetch.json").read_text())
    quality = json.loads((out / "quality.json").read_text())
    n = len(heuristic["graphs"])
    startup = {"graphs": n, "heuristic_s": heuristic["total_s"], "autotune_s": tuning["total_s"], "fetch_s": fetch["total_s"],
               "fetch_prefetch_s": fetch["prefetch_s"], "client_construct_s": fetch["construct_s"],
               "cuda_init_s": {"heuristic": heuristic["init_s"], "fetch": fetch["init_s"]},
               "a_over_c": heuristic["total_s"] / fetch["total_s"], "b_over_c": tuning["total_s"] / fetch["total_s"],
               "plans_per_s": n / fetch["total_s"], "max_error": max(fetch["errors"].values()), "client_stats": fetch["stats"]}
    geo = {}
    for key in ("heuristic", "torch"):
        ratios = [r[key]["median"] / r["tuned"]["median"] for r in quality]
        geo[f"{key}_over_tuned"] = statistics.geometric_mean(ratios)
    slower = [r["name"] for r in quality if r["tuned"]["median"] > r["heuristic"]["p90"] * 1.02]
    summary = {"startup": startup, "quality_geomean": geo, "tuned_slower_than_heuristic_beyond_noise": slower}
    (out / "startup.json").write_text(json.dumps(summary, indent=1))
    _plot(out, startup, quality, tuning)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
