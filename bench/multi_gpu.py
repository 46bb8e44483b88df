"""Two GPUs of one host: the 49-graph workload tuned by one worker, then by a worker on each of two GPUs; and
client processes on the two devices starting at once.

    python bench/multi_gpu.py --out bench/results [--limit N]

Needs two CUDA devices (``CUDA_VISIBLE_DEVICES`` may pick them: the first two visible are used). Each tuning run is
a fresh ``plancache serve`` (SQLite) with the workload of ``bench/workload.py`` registered and enqueued for this
host's environment, drained by real ``plancache worker --once`` processes (``CUDA_CACHE_DISABLE=1``), timed from
the workers' start to their exit:

- ``one_worker``: ``plancache worker --device 0``, its builder processes sized for the whole host;
- ``two_workers``: ``plancache worker --all-devices`` on the two devices, each worker with half the host's cores.

Per graph: each run's winner (engine id and knobs) and, in the two-worker run, the GPU that tuned it; the winners
are the same, a tie (the one-worker run's candidates table, ``GET /v1/plans/{key}/candidates``, times the
two-worker winner within ``--noise`` of its own winner) or different. Per worker: graphs tuned and tuning seconds.

Clients: the two-worker run's plans are loaded by fresh processes, ``PlanCache(device=N)`` in strict mode with an
empty disk cache, each timed from just after its CUDA context on device N was created until every plan is ready
to execute: one process on device 0 alone (``alone``), then one on each device released at the same instant
(``together``). Writes ``multi_gpu.json`` into OUT and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.together import run_together  # noqa: E402
from bench.workload import family, workload  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_CACHE_DISABLE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


# ---------------------------------------------------------------- a client process (on the GPU)

def child_client(device: int, server: str, token: str, trusted: Path, limit: int | None) -> dict[str, Any]:
    """Load every plan of the workload on ``device`` once released (a line on stdin)."""
    import torch

    from plancache.client import PlanCache

    specs = [s.canonical_document() for s in workload()][:limit]
    torch.empty(1, device=torch.device("cuda", device))  # this process's CUDA context on its device, untimed
    cache_dir = tempfile.mkdtemp(prefix="plancache-multi-gpu-")
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    pc = PlanCache(server, token=token, trusted_keys=[trusted], cache_dir=cache_dir, mode="strict", device=device)
    pc.prefetch(specs)
    plans = [pc.plan(s) for s in specs]
    seconds = time.perf_counter() - t0
    assert all(p.source == "server" for p in plans), [p.source for p in plans]
    return {"device": device, "seconds": seconds, "plans": len(plans)}


def run_clients(devices: list[int], server: str, token: str, trusted: Path, limit: int | None) -> list[dict[str, Any]]:
    """One fresh client process per entry of ``devices``, released at the same instant once all are ready."""
    args = ["--server", server, "--token", token, "--trusted", str(trusted)] + (["--limit", str(limit)] if limit else [])
    procs = [subprocess.Popen([sys.executable, __file__, "--child-client", str(d), *args], env=_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for d in devices]
    return run_together(procs, "a client process")


# ---------------------------------------------------------------- tuning runs

def _cli(*args: str, db: Path) -> str:
    """``plancache ARGS`` against the server's database; its stdout."""
    return subprocess.run([sys.executable, "-m", "plancache", *args], env=_env(PLANCACHE_DATABASE_URL=f"sqlite:///{db}"),
                          check=True, capture_output=True, text=True).stdout.strip()


def tuning_run(name: str, worker_args: list[str], visible: str, work: Path, limit: int | None) -> dict[str, Any]:
    """A fresh server with the workload enqueued, drained by ``plancache worker WORKER_ARGS --once``; the run's wall
    time, per-graph records and candidate tables, and the server (left running for the clients)."""
    import httpx

    from bench.serve import serve_seeded
    from plancache.client.remote import Remote
    from plancache.environment import detect
    from plancache.http import Retry
    from plancache.protocol import PlanRecord, TargetEnvironment, TuneRequest
    from plancache.signing import keygen
    from plancache.worker import JobsApi

    folder = work / name
    folder.mkdir(parents=True)
    db = folder / "server.db"
    server, url, admin_token = serve_seeded(db, [])
    specs = [s.canonical_document() for s in workload()][:limit]
    env = detect(0)
    with JobsApi.open(url, admin_token, retry=Retry(within=10)) as admin:
        for s in specs:
            Remote(admin.http).register_spec(s)
        admin.enqueue(TuneRequest(graph_keys=[s.graph_key for s in specs], targets=[TargetEnvironment.exactly(env)]))
    worker_token = _cli("token", "create", "--role", "worker", "--name", name, db=db)
    reader_token = _cli("token", "create", "--role", "reader", "--name", f"{name}-reader", db=db)
    priv, pub, _ = keygen(folder / "keys", "bench")
    cmd = [sys.executable, "-m", "plancache", "worker", "--server", url, "--token", worker_token, "--signing-key",
           str(priv), "--spool-dir", str(folder / "spool"), "--worker-id", f"bench-{name}", "--once",
           "--poll-interval", "0.2", *worker_args]
    t0 = time.perf_counter()
    with open(folder / "worker.log", "w") as log:
        subprocess.run(cmd, env=_env(CUDA_VISIBLE_DEVICES=visible), stderr=log, check=True, timeout=4 * 3600)
    wall = time.perf_counter() - t0
    graphs = []
    admin_auth = {"Authorization": f"Bearer {admin_token}"}
    for s in specs:
        r = httpx.get(f"{url}/v1/plans/{s.graph_key}", params=env.validity(), headers=admin_auth, timeout=30)
        r.raise_for_status()
        rec = PlanRecord.model_validate(r.json())
        table = httpx.get(f"{url}/v1/plans/{s.graph_key}/candidates", params=env.validity(), headers=admin_auth,
                          timeout=30)
        table.raise_for_status()
        graphs.append({"name": s.name, "family": family(s.name), "engine_id": rec.engine_id, "knobs": rec.knobs,
                       "winner_ms": rec.winner_median_ms, "tuning_s": rec.tuning_seconds, "worker": rec.worker_id,
                       "candidates": [[c["engine_id"], c["knobs"], c["median_ms"]]
                                      for c in table.json()["candidates"] if c["median_ms"] is not None]})
    return {"wall_s": wall, "graphs": graphs, "server": server, "url": url, "reader_token": reader_token,
            "trusted": pub, "environment": env.describe()}


def compare(one: dict[str, Any], two: dict[str, Any], noise: float) -> dict[str, Any]:
    """Per graph: the same winner, a tie within ``noise`` (in the one-worker run's table), or different."""
    per_graph, different = [], []
    for a, b in zip(one["graphs"], two["graphs"]):
        same = (a["engine_id"], a["knobs"]) == (b["engine_id"], b["knobs"])
        theirs = next((ms for eid, knobs, ms in a["candidates"] if (eid, knobs) == (b["engine_id"], b["knobs"])), None)
        gap = None if theirs is None else theirs / a["winner_ms"] - 1
        verdict = "same" if same else "tie" if gap is not None and gap <= noise else "different"
        per_graph.append({"name": a["name"], "one_worker_ms": a["winner_ms"], "two_workers_ms": b["winner_ms"],
                          "tuned_by": b["worker"], "gap_in_one_worker_run": gap, "verdict": verdict,
                          "one_worker_s": a["tuning_s"], "two_workers_s": b["tuning_s"]})
        if verdict == "different":
            different.append(a["name"])
    return {"per_graph": per_graph, "different": different}


def per_worker(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    workers: dict[str, dict[str, float]] = {}
    for g in run["graphs"]:
        w = workers.setdefault(g["worker"], {"graphs": 0, "tuning_s": 0.0})
        w["graphs"] += 1
        w["tuning_s"] += g["tuning_s"]
    return workers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None, help="only the first N graphs (smoke runs)")
    ap.add_argument("--noise", type=float, default=0.03, help="relative gap that is a tie (default 3%%)")
    ap.add_argument("--child-client", type=int, default=None)
    ap.add_argument("--server")
    ap.add_argument("--token")
    ap.add_argument("--trusted", type=Path)
    args = ap.parse_args()
    if args.child_client is not None:
        print(json.dumps(child_client(args.child_client, args.server, args.token, args.trusted, args.limit)))
        return
    import torch

    from plancache.environment import device_selector

    if torch.cuda.device_count() < 2:
        sys.exit(f"bench/multi_gpu.py needs two CUDA devices; torch sees {torch.cuda.device_count()}")
    two = ",".join(device_selector(d) for d in (0, 1))
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="plancache-multi-gpu-"))
    servers = []
    try:
        one_run = tuning_run("one", ["--device", "0"], two, work, args.limit)
        servers.append(one_run.pop("server"))
        two_run = tuning_run("two", ["--all-devices"], two, work, args.limit)
        servers.append(two_run.pop("server"))
        clients = [two_run["url"], two_run["reader_token"], two_run["trusted"], args.limit]
        alone = run_clients([0], *clients)
        together = run_clients([0, 1], *clients)
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    cmp = compare(one_run, two_run, args.noise)
    n = len(one_run["graphs"])
    summary = {
        "graphs": n, "environment": one_run["environment"], "cpu_cores": os.cpu_count(),
        "devices": [torch.cuda.get_device_name(d) for d in (0, 1)],
        "one_worker_s": one_run["wall_s"], "two_workers_s": two_run["wall_s"],
        "speedup": one_run["wall_s"] / two_run["wall_s"],
        "graphs_per_hour": {"one_worker": n * 3600 / one_run["wall_s"], "two_workers": n * 3600 / two_run["wall_s"]},
        "per_worker": {"one_worker": per_worker(one_run), "two_workers": per_worker(two_run)},
        "winners": {v: sum(g["verdict"] == v for g in cmp["per_graph"]) for v in ("same", "tie", "different")},
        "different": cmp["different"],
        "clients": {"alone_s": alone[0]["seconds"], "together_s": [c["seconds"] for c in together],
                    "together_slowdown": max(c["seconds"] for c in together) / alone[0]["seconds"]},
        "per_graph": cmp["per_graph"],
    }
    (args.out / "multi_gpu.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_graph"}, indent=1))


if __name__ == "__main__":
    main()
