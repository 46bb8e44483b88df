"""A start-up storm against one server process: how many client start-ups a second it sustains.

    python bench/storm.py [--database-url postgresql+psycopg://…] [--rates 2,4,8,16,32] [--duration 10] [--out FILE]

A real ``plancache serve`` (uvicorn, one process) on a fresh SQLite file or Postgres database (``bench/load_server.py``
makes both) holds a signed plan for each graph of the 49-graph workload (``bench/workload.py``, 64 KiB blobs). A
start-up is what a fresh client process sends the server: a new connection and one ``POST /v1/plans/resolve`` of the
49 keys with the blobs inline, the answer read whole (the client's own work -- imports, signature checks,
deserializing -- is per host and not the server's, so it is left out; ``bench/host_fetch.py`` runs real clients).
Start-ups arrive open-loop at each ``--rates`` value (per second) for ``--duration`` seconds; latency runs from a
start-up's scheduled arrival to its last byte, so queueing counts. Reports per rate: p50/p99/max, and the start-ups
that would fall back to local builds (an answer other than 200, or later than ``PLANCACHE_REQUEST_DEADLINE``, 5 s);
then the highest rate with p99 ≤ 1 s and the lowest rate with a fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.load_server import ENV, database, server  # noqa: E402
from bench.report import percentile  # noqa: E402
from bench.workload import workload  # noqa: E402
from plancache.signing import Signer, keygen  # noqa: E402
from plancache.store import open_store  # noqa: E402
from tests.factories import make_meta  # noqa: E402

BLOB_BYTES = 64 * 1024
DEADLINE_S = 5.0  # PLANCACHE_REQUEST_DEADLINE's default: past it a client builds locally
P99_GOAL_S = 1.0


def seed(url: str, keys_dir: Path) -> tuple[list[str], str]:
    """The workload's specs and signed plans in the store at ``url``; returns the graph keys and a reader token."""
    private, _, _ = keygen(keys_dir, "storm")
    signer = Signer.from_file(private)
    keys = []
    with open_store(url, create=True) as store:
        for spec in workload():
            blob = hashlib.sha256(spec.graph_key.encode()).digest() * (BLOB_BYTES // 32)
            store.put_spec(spec.graph_key, spec.to_json())
            store.publish_plan(make_meta(spec.graph_key, ENV, blob, signer), blob)
            keys.append(spec.graph_key)
        token, _ = store.create_token("storm-reader", "reader")
    return keys, token


async def start_up(base: str, token: str, body: dict[str, Any], n_keys: int) -> bool:
    """One client start-up's exchange with the server, on a connection of its own; True when all plans came."""
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(30.0)) as client:
        try:
            resp = await client.post("/v1/plans/resolve", json=body)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and len(resp.json()["plans"]) == n_keys


async def storm(base: str, token: str, keys: list[str], rate: float, duration: float) -> dict[str, Any]:
    body = {"environment": ENV.model_dump(), "graph_keys": keys, "include_blobs": True}
    t0 = time.perf_counter() + 0.05
    latencies: list[float] = []
    failed = 0

    async def one(at: float) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        ok = await start_up(base, token, body, len(keys))
        latencies.append(time.perf_counter() - at)
        failed += not ok

    n = max(1, int(rate * duration))
    await asyncio.gather(*(one(t0 + i / rate) for i in range(n)))
    latencies.sort()
    late = sum(x > DEADLINE_S for x in latencies)
    return {"rate": rate, "start_ups": n, "p50_s": round(percentile(latencies, 0.5), 3),
            "p99_s": round(percentile(latencies, 0.99), 3), "max_s": round(latencies[-1], 3),
            "failed": failed, "later_than_deadline": late, "fallbacks": failed + late}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url")
    parser.add_argument("--rates", default="2,4,8,16,32")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    with database(args.database_url) as (backend, url), tempfile.TemporaryDirectory() as tmp:
        keys, token = seed(url, Path(tmp) / "keys")
        env = {**os.environ, "PLANCACHE_DATABASE_URL": url, "PLANCACHE_ADMIN_TOKEN": secrets.token_urlsafe(24)}
        env.pop("PLANCACHE_OPEN_READS", None)
        rows = []
        with server(["-m", "plancache", "serve"], env, "/readyz") as base:
            asyncio.run(storm(base, token, keys, 2, 1))  # warm-up
            for rate in rates:
                rows.append(asyncio.run(storm(base, token, keys, rate, args.duration)))
                print(backend, rows[-1], flush=True)
    within = [r["rate"] for r in rows if r["p99_s"] <= P99_GOAL_S and not r["fallbacks"]]
    falling = [r["rate"] for r in rows if r["fallbacks"]]
    result = {"database": backend, "graphs": len(keys), "blob_bytes": BLOB_BYTES, "duration_s": args.duration,
              "sustained_per_s_p99_under_1s": max(within, default=None),
              "first_rate_with_fallbacks": min(falling, default=None), "rates": rows,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    print(json.dumps({k: v for k, v in result.items() if k != "rates"}))
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged[backend] = result
        args.out.write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
