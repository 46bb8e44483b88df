"""Start-up on a GPU: plancache against local builds, against the floor, and 16 processes starting at once.

    python bench/burst.py --plans DIR --out DIR [--processes 16] [--repeats 5]

``--plans`` is the folder ``bench/tuning.py`` wrote (``plans.json``, signed by ``keys/bench.key``). A real
``plancache serve`` (SQLite) is seeded with those plans. Every figure is from fresh processes, timed from
just after CUDA context creation (``torch.cuda.init()``, not plancache's to save) until every plan of the
49-graph workload is ready to execute. ``floor``, ``plancache`` and their ``_from_start`` forms are each the median of
``--repeats`` processes, the four run in turn:

- ``heuristic_cold``: cuDNN handle + heuristic build of every graph, ``CUDA_CACHE_DISABLE=1``;
- ``heuristic_warm_jit``: the same with the driver's JIT cache already filled by an earlier process (a process
  restarting on the same host);
- ``floor``: cuDNN handle + device properties + deserialize of every blob from bytes, nothing else;
- ``plancache``: ``PlanCache()`` + ``prefetch`` + ``plan`` of every graph (one resolve, blob checks, signature
  checks, deserialize), strict mode, an empty disk cache; ``first_plan``: the same for the first graph alone;
- ``burst``: ``--processes`` fresh processes doing ``plancache`` at the same instant (each past its imports and
  CUDA start-up, released together): p50, p99 and max against ``plancache``; ``floor_burst``: the same for
  ``floor``, which bounds what any client can do when that many processes load plans at once;
- ``floor_from_start`` / ``plancache_from_start``: the same two, timed from the spawn of the process (``python``
  start, ``import torch`` and ``torch.cuda.init()`` as a PyTorch program does, ``import cudnn`` or ``plancache``; the
  harness's reading of ``plans.json`` left out); ``from_start``: ``--processes`` of each spawned at the same instant,
  each timed from its spawn (a host whose ranks all start at once).

``--profile`` also writes a cProfile summary of one ``plancache`` process alone, of the first process of a second
burst and of one ``plancache_from_start`` process (``profile_*.txt``). Writes ``startup_floor.json`` and
``startup_floor.png`` into OUT and prints the ratios.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import percentile, pyplot  # noqa: E402
from bench.together import run_together  # noqa: E402


def _plans(folder: Path) -> list[dict]:
    return json.loads((folder / "plans.json").read_text())


# ---------------------------------------------------------------- children (on the GPU)

def child(phase: str, plans_dir: Path, server: str | None, token: str | None, wait: bool, profile: bool = False) -> dict:
    """Run ``phase`` once. A phase ending in ``_from_start`` is timed from this process's spawn (``SPAWNED``, the
    parent's ``time.time()`` just before it started the interpreter): ``import torch`` and ``torch.cuda.init()`` (as
    a PyTorch program running plans on its tensors does, floor or not), the imports of cuDNN or plancache included,
    the harness's own reading of ``plans.json`` left out. Other phases are timed from just after
    ``torch.cuda.init()``, plancache imported before."""
    import torch

    from_start = phase.endswith("_from_start")
    phase = phase.removesuffix("_from_start")
    torch.cuda.init()  # a PyTorch program running plans on its tensors starts CUDA through torch, floor or not
    h0 = time.perf_counter()
    entries = _plans(plans_dir)
    blobs = [base64.b64decode(e["blob_b64"]) for e in entries]
    trusted = [plans_dir / "keys" / "bench.pub"]
    cache_dir = tempfile.mkdtemp(prefix="plancache-burst-")
    harness = time.perf_counter() - h0
    if not from_start and phase != "floor":
        from plancache.client import PlanCache  # noqa: F401 - imported before the clock starts
    if wait:  # released together with the other processes of a burst
        print("ready", flush=True)
        sys.stdin.readline()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    if phase != "floor":  # the specs are plancache's: parsing them counts (the floor needs none)
        from plancache.spec import parse_spec

        specs = [parse_spec(e["spec"]) for e in entries]
    if phase in ("heuristic_cold", "heuristic_warm_jit"):
        from plancache import gpu

        handle = gpu.create_handle(0)
        for spec in specs:
            gpu.build_heuristic(spec, handle)
    elif phase == "floor":
        import cudnn

        handle = cudnn.create_handle()
        props = cudnn.create_device_properties(0)
        graphs = []
        for blob in blobs:
            g = cudnn.pygraph(device_property=props)
            g.deserialize(handle, blob)
            graphs.append(g)
    else:
        from plancache.client import PlanCache

        pc = PlanCache(server, token=token, trusted_keys=trusted, cache_dir=cache_dir, mode="strict")
        if phase == "first_plan":
            pc.plan(specs[0])
        else:
            pc.prefetch(specs)
            plans = [pc.plan(s) for s in specs]
            assert all(p.source == "server" for p in plans), [p.source for p in plans]
    seconds = time.perf_counter() - t0
    if from_start:
        seconds = time.time() - float(os.environ["SPAWNED"]) - harness
    result: dict = {"phase": phase, "seconds": seconds, "from_start": from_start}
    if phase not in ("heuristic_cold", "heuristic_warm_jit", "floor"):
        result["client_stats"] = pc.stats().as_dict()
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        result["profile"] = text.getvalue()
    return result


# ---------------------------------------------------------------- the orchestrator

ALONE = ("floor", "plancache", "floor_from_start", "plancache_from_start")  # phases timed alone, --repeats times


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}
    return env


def _args(phase: str, plans: Path, server: str | None, token: str | None, wait: bool = False,
          profile: bool = False) -> list[str]:
    args = [sys.executable, __file__, "--child", phase, "--plans", str(plans)]
    if server:
        args += ["--server", server, "--token", token or ""]
    return args + (["--wait"] if wait else []) + (["--profile"] if profile else [])


def run_one(phase: str, plans: Path, server: str | None = None, token: str | None = None, profile: bool = False,
            **env: str) -> dict:
    """One fresh process doing ``phase``; its result (``seconds``, client counters, a profile when asked)."""
    out = subprocess.run(_args(phase, plans, server, token, profile=profile),
                         env=_env(**{"CUDA_CACHE_DISABLE": "1", **env, "SPAWNED": repr(time.time())}), check=True,
                         capture_output=True, text=True, timeout=600)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_burst(n: int, phase: str, plans: Path, server: str | None = None, token: str | None = None,
              profile_first: bool = False) -> list[dict]:
    """``n`` fresh processes doing ``phase``, released at the same instant once all have started CUDA."""
    procs = [subprocess.Popen(_args(phase, plans, server, token, wait=True, profile=profile_first and i == 0),
                              env=_env(CUDA_CACHE_DISABLE="1"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(n)]
    return run_together(procs, "a burst process")  # each imported everything and created its CUDA context


def run_spawned(n: int, phase: str, plans: Path, server: str | None = None, token: str | None = None) -> list[dict]:
    """``n`` fresh processes doing ``phase`` (a ``_from_start`` one), started at once: each timed from its spawn."""
    procs = [subprocess.Popen(_args(phase, plans, server, token), stdout=subprocess.PIPE, text=True,
                              env=_env(CUDA_CACHE_DISABLE="1", SPAWNED=repr(time.time())))
             for _ in range(n)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"a {phase} process failed ({p.returncode})")
        results.append(dict(json.loads(out.strip().splitlines()[-1])))
    return results


def serve_and_seed(plans: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    from bench.serve import serve_seeded

    db = Path(tempfile.mkdtemp(prefix="plancache-burst-db-")) / "server.db"
    return serve_seeded(db, (({**e["meta"], "spec": e["spec"]}, base64.b64decode(e["blob_b64"])) for e in _plans(plans)))


def plot(out: Path, res: dict) -> None:
    """``startup_floor.png``: time until every plan is ready, alone and in a burst, against the floor."""
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    bars = [("heuristic, cold", res["heuristic_cold_s"], "tab:orange"),
            ("heuristic, warm JIT cache", res["heuristic_warm_jit_s"], "tab:orange"),
            ("floor (deserialize only)", res["floor_s"], "tab:gray"),
            ("plancache", res["plancache_s"], "tab:green")]
    left.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    left.set_xscale("log")
    left.set_xlabel(f"seconds until {res['graphs']} plans are ready (log)")
    left.set_title("one fresh process")
    n = res["burst"]["processes"]
    right.boxplot([res["floor_burst"]["all_s"], res["burst"]["all_s"]])
    right.set_xticks([1, 2], ["floor", "plancache"])
    right.axhline(res["floor_s"], color="tab:gray", ls=":", label="floor, alone")
    right.axhline(res["plancache_s"], color="tab:green", ls=":", label="plancache, alone")
    right.set_ylabel("seconds")
    right.set_title(f"{n} processes at once")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "startup_floor.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--processes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5,
                    help="fresh processes per phase timed alone, interleaved; medians reported (default 5)")
    ap.add_argument("--child")
    ap.add_argument("--server")
    ap.add_argument("--token")
    ap.add_argument("--wait", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one plancache process alone (timed after CUDA's start, and from its spawn) "
                         "and the first of a burst (profile_*.txt in OUT)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.plans, args.server, args.token, args.wait, args.profile)))
        return
    profiles: dict[str, str] = {}
    if args.out is None:
        ap.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    n = len(_plans(args.plans))
    res: dict = {"graphs": n}
    res["heuristic_cold_s"] = run_one("heuristic_cold", args.plans)["seconds"]
    jit = tempfile.mkdtemp(prefix="plancache-jit-")
    warm = {"CUDA_CACHE_DISABLE": "0", "CUDA_CACHE_PATH": jit}
    run_one("heuristic_warm_jit", args.plans, **warm)  # fills the JIT cache
    res["heuristic_warm_jit_s"] = run_one("heuristic_warm_jit", args.plans, **warm)["seconds"]
    proc, url, token = serve_and_seed(args.plans)
    try:
        alone: dict[str, list[float]] = {p: [] for p in ALONE}
        for _ in range(args.repeats):  # interleaved, so that a slow spell of the machine falls on every phase
            for phase in ALONE:
                server = (url, token) if phase.startswith("plancache") else (None, None)
                result = run_one(phase, args.plans, *server)
                alone[phase].append(result["seconds"])
                if phase == "plancache":
                    res["plancache_client_stats"] = result["client_stats"]
        for phase, runs in alone.items():
            res[f"{phase}_s"] = statistics.median(runs)
            res[f"{phase}_runs_s"] = runs
        floor_burst = [r["seconds"] for r in run_burst(args.processes, "floor", args.plans)]
        floor_spawned = [r["seconds"] for r in run_spawned(args.processes, "floor_from_start", args.plans)]
        res["first_plan_s"] = run_one("first_plan", args.plans, url, token)["seconds"]
        burst_runs = run_burst(args.processes, "plancache", args.plans, url, token)
        spawned = [r["seconds"] for r in run_spawned(args.processes, "plancache_from_start", args.plans, url, token)]
        if args.profile:
            profiles["plancache_from_start"] = run_one("plancache_from_start", args.plans, url, token,
                                                       profile=True)["profile"]
            profiles["plancache"] = run_one("plancache", args.plans, url, token, profile=True)["profile"]
            profiles["burst_first_process"] = run_burst(args.processes, "plancache", args.plans, url, token,
                                                        profile_first=True)[0]["profile"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    burst = [r["seconds"] for r in burst_runs]
    res["burst"] = {"processes": args.processes, "p50_s": statistics.median(burst), "p99_s": percentile(burst, 0.99),
                    "max_s": max(burst), "all_s": burst,
                    "deserialize_s": [r["client_stats"]["deserialize_seconds"] for r in burst_runs]}
    res["floor_burst"] = {"p50_s": statistics.median(floor_burst), "p99_s": percentile(floor_burst, 0.99),
                          "max_s": max(floor_burst), "all_s": floor_burst}
    res["from_start"] = {
        "processes": args.processes,
        "burst": {"p50_s": statistics.median(spawned), "p99_s": percentile(spawned, 0.99), "all_s": spawned},
        "floor_burst": {"p50_s": statistics.median(floor_spawned), "p99_s": percentile(floor_spawned, 0.99),
                        "all_s": floor_spawned}}
    res["ratios"] = {"from_start_plancache_over_floor": res["plancache_from_start_s"] / res["floor_from_start_s"],
                     "from_start_burst_p99_over_floor_burst_p99": (res["from_start"]["burst"]["p99_s"]
                                                                   / res["from_start"]["floor_burst"]["p99_s"]),
                     "burst_p99_over_floor_burst_p99": res["burst"]["p99_s"] / res["floor_burst"]["p99_s"],
                     "heuristic_cold_over_plancache": res["heuristic_cold_s"] / res["plancache_s"],
                     "heuristic_warm_jit_over_plancache": res["heuristic_warm_jit_s"] / res["plancache_s"],
                     "plancache_over_floor": res["plancache_s"] / res["floor_s"],
                     "heuristic_cold_over_floor": res["heuristic_cold_s"] / res["floor_s"],
                     "burst_p99_over_single": res["burst"]["p99_s"] / res["plancache_s"],
                     "floor_burst_p99_over_floor": res["floor_burst"]["p99_s"] / res["floor_s"]}
    (args.out / "startup_floor.json").write_text(json.dumps(res, indent=1))
    plot(args.out, res)
    for name, text in profiles.items():
        (args.out / f"profile_{name}.txt").write_text(text)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
