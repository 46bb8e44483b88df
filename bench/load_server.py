"""Load test of the HTTP service: resolve and blob GET throughput and latency under concurrent clients.

    python bench/load_server.py [--database-url URL] [--plans 200] [--clients 8] [--duration 10] [--out FILE]

A real ``plancache serve`` (uvicorn, one process) runs on a loopback port in a subprocess, on a fresh
SQLite file (default) or a fresh Postgres database created through ``--database-url`` (used as the
admin connection) and dropped afterwards. ``--plans`` synthetic plans with random blobs of
``--min-kib``..``--max-kib`` are seeded through the store directly. Then ``--clients`` concurrent
keep-alive connections (httpx, asyncio) run each scenario for ``--duration`` seconds or
``--max-requests`` requests, whichever ends first:

- ``resolve+blobs``  ``POST /v1/plans/resolve`` of ``--keys`` random keys with the blobs inline
- ``resolve``        the same, records only
- ``blob``           ``GET /v1/blobs/{sha256}`` of a random blob
- ``static``         the same blobs as files behind uvicorn + Starlette ``StaticFiles``: the ceiling

Every request must answer 200, and a first answer of each kind is checked byte for byte. Prints a
table and merges the figures, keyed by database, into ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import platform
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from plancache.environment import Environment  # noqa: E402
from plancache.protocol import Candidate, CandidateTable, PlanMeta  # noqa: E402
from plancache.spec import SpecBuilder, graph_key  # noqa: E402

ENV = Environment(sm=90, sm_count=132, cudnn_version=91900, driver_version=13000, frontend_version="1.32.0",
                  device_name="NVIDIA H200", cuda_runtime="13.0", torch_version="2.11.0")
HOST = "127.0.0.1"  # loopback only
START_TIMEOUT = 60.0
REQUEST_TIMEOUT = 120.0

Request = tuple[str, str, dict[str, Any]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ databases and servers


@contextmanager
def database(url: str | None) -> Iterator[tuple[str, str]]:
    """``(backend, url)`` of a fresh database: a SQLite file in a temporary folder, or a new Postgres
    database on the server of ``url`` (dropped afterwards)."""
    if url is None or url.startswith("sqlite"):
        with tempfile.TemporaryDirectory() as d:
            yield "sqlite", url or f"sqlite:///{d}/bench.db"
        return
    import sqlalchemy as sa

    from plancache.store.db import normalize_url

    name = f"plancache_bench_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(normalize_url(url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield "postgres", normalize_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextmanager
def server(args: list[str], env: dict[str, str], ready_path: str) -> Iterator[str]:
    """A subprocess serving on a free loopback port (its ``--port`` is appended); yields its base URL."""
    port = free_port()
    base = f"http://{HOST}:{port}"
    proc = subprocess.Popen([sys.executable, *args, "--port", str(port)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server {args} exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
            try:
                if httpx.get(base + ready_path, timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server {args} not ready within {START_TIMEOUT:.0f}s")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_static(directory: Path, port: int) -> None:
    """The baseline: files behind uvicorn + Starlette StaticFiles (same server stack, no auth, no database)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    app = Starlette(routes=[Route("/healthz", lambda _r: PlainTextResponse("ok")),
                            Mount("/", StaticFiles(directory=directory))])
    uvicorn.run(app, host=HOST, port=port)


# ------------------------------------------------------------------ seeding


def synthetic_spec(i: int) -> dict[str, Any]:
    """A small valid spec, distinct for each ``i`` (matmul + gelu of varying M)."""
    b = SpecBuilder(io_data_type="bfloat16", name=f"load_{i}")
    a = b.tensor("A", dim=[1, 32 + i, 256])
    w = b.tensor("W", dim=[1, 256, 128])
    b.gelu(b.matmul(a, w)).set_output(True).set_name("Y")
    return b.build().to_json()


def seed(url: str, n: int, min_bytes: int, max_bytes: int, rng: random.Random) -> tuple[dict[str, bytes], str]:
    """``n`` plans (records and blobs via the store) and a reader token; returns ``({graph_key: blob}, token)``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from plancache.signing import Signer
    from plancache.store import open_store

    signer = Signer(Ed25519PrivateKey.generate())  # records carry real envelopes, as in production
    plans: dict[str, bytes] = {}
    with open_store(url, create=True) as store:
        for i in range(n):
            spec = synthetic_spec(i)
            key = graph_key(spec)
            store.put_spec(key, spec)
            blob = rng.randbytes(rng.randint(min_bytes, max_bytes))
            meta = PlanMeta(
                graph_key=key, environment=ENV, blob_sha256=hashlib.sha256(blob).hexdigest(), blob_size=len(blob),
                engine_id=rng.randint(0, 60),
                knobs={"tile": 2, "stages": 3}, plan_name="eng0_k2=2_k3=3", workspace_bytes=rng.randint(0, 1 << 22),
                winner_median_ms=0.05, heuristic_median_ms=0.06, worst_median_ms=1.2, tuning_seconds=3.0, worker_id="bench",
            )
            table = CandidateTable(candidates=[Candidate(index=c, engine_id=c, median_ms=0.05 + c / 100, status="ok")
                                               for c in range(8)])
            store.publish_plan(signer.sign(meta), blob, candidates=table)
            plans[key] = blob
        token, _ = store.create_token("bench-reader", "reader")
    return plans, token


# ------------------------------------------------------------------ the client loop


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values)) - 1))]


async def load(base: str, headers: dict[str, str], make_request: Callable[[], Request], clients: int,
               duration: float, max_requests: int) -> dict[str, Any]:
    """``clients`` concurrent connections issuing ``make_request()`` until the time or the count runs out."""
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    received = 0
    budget = max_requests
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=REQUEST_TIMEOUT, limits=limits) as http:
        stop_at = time.perf_counter() + duration

        async def one_client() -> None:
            nonlocal received, budget
            while budget > 0 and time.perf_counter() < stop_at:
                budget -= 1
                method, path, kwargs = make_request()
                t0 = time.perf_counter()
                async with http.stream(method, path, **kwargs) as r:
                    n = 0
                    async for chunk in r.aiter_raw():
                        n += len(chunk)
                latencies.append(time.perf_counter() - t0)
                statuses[r.status_code] += 1
                received += n

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    latencies.sort()
    return {
        "requests": len(latencies), "seconds": round(elapsed, 3), "requests_per_s": round(len(latencies) / elapsed, 1),
        "mb_per_s": round(received / elapsed / 1e6, 1), "mean_response_kb": round(received / max(1, len(latencies)) / 1e3, 1),
        "p50_ms": round(percentile(latencies, 50) * 1e3, 2), "p99_ms": round(percentile(latencies, 99) * 1e3, 2),
        "non_200": {str(s): c for s, c in statuses.items() if s != 200},
    }


def check_answers(base: str, static_base: str, headers: dict[str, str], plans: dict[str, bytes], keys_per_resolve: int) -> None:
    """One answer of each kind, verified byte for byte before measuring."""
    keys = list(plans)[:keys_per_resolve]
    with httpx.Client(base_url=base, headers=headers, timeout=REQUEST_TIMEOUT) as http:
        r = http.post("/v1/plans/resolve", json={"environment": ENV.model_dump(), "graph_keys": keys, "include_blobs": True})
        r.raise_for_status()
        got = r.json()
        assert got["missing"] == [] and set(got["plans"]) == set(keys), "resolve did not return every seeded key"
        for key, p in got["plans"].items():
            assert base64.b64decode(p["blob_b64"]) == plans[key], f"inline blob of {key} differs"
        blob = plans[keys[0]]
        assert http.get(f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}").content == blob, "blob GET differs"
    assert httpx.get(f"{static_base}/{hashlib.sha256(blob).hexdigest()}").content == blob, "static file differs"


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with database(args.database_url) as (backend, url), tempfile.TemporaryDirectory() as static_dir:
        t0 = time.perf_counter()
        plans, token = seed(url, args.plans, args.min_kib << 10, args.max_kib << 10, rng)
        seed_s = time.perf_counter() - t0
        for blob in plans.values():
            (Path(static_dir) / hashlib.sha256(blob).hexdigest()).write_bytes(blob)
        keys, digests = list(plans), [hashlib.sha256(b).hexdigest() for b in plans.values()]
        env = {**os.environ, "PLANCACHE_DATABASE_URL": url, "PLANCACHE_ADMIN_TOKEN": secrets.token_urlsafe(24)}
        env.pop("PLANCACHE_OPEN_READS", None)
        headers = {"Authorization": f"Bearer {token}"}

        def resolve(include_blobs: bool) -> Callable[[], Request]:
            env_json = ENV.model_dump()
            return lambda: ("POST", "/v1/plans/resolve", {"json": {
                "environment": env_json, "graph_keys": rng.sample(keys, min(args.keys, len(keys))),
                "include_blobs": include_blobs}})

        scenarios: list[tuple[str, Callable[[], Request], bool]] = [
            ("resolve+blobs", resolve(True), False),
            ("resolve", resolve(False), False),
            ("blob", lambda: ("GET", f"/v1/blobs/{rng.choice(digests)}", {}), False),
            ("static", lambda: ("GET", f"/{rng.choice(digests)}", {}), True),
        ]
        results: dict[str, Any] = {}
        with server(["-m", "plancache", "serve"], env, "/readyz") as base, \
                server([str(Path(__file__).resolve()), "--serve-static", static_dir], env, "/healthz") as static_base:
            check_answers(base, static_base, headers, plans, args.keys)
            for name, make_request, static in scenarios:
                target = static_base if static else base
                asyncio.run(load(target, headers, make_request, args.clients, 1.0, 2 * args.clients))  # warm-up
                results[name] = asyncio.run(load(target, headers, make_request, args.clients, args.duration,
                                                 args.max_requests))
                if results[name]["non_200"]:
                    raise SystemExit(f"{name}: answers other than 200: {results[name]['non_200']}")
    sizes = [len(b) for b in plans.values()]
    return {
        "database": backend, "plans": args.plans, "blob_bytes_min": min(sizes), "blob_bytes_max": max(sizes),
        "blob_bytes_mean": round(sum(sizes) / len(sizes)), "keys_per_resolve": min(args.keys, len(keys)),
        "clients": args.clients, "duration_s": args.duration, "max_requests": args.max_requests, "seed_s": round(seed_s, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "scenarios": results,
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['database']}: {result['plans']} plans, "
          f"blobs {result['blob_bytes_min'] >> 10}-{result['blob_bytes_max'] >> 10} KiB "
          f"(mean {result['blob_bytes_mean'] >> 10} KiB), {result['keys_per_resolve']} keys per resolve, "
          f"{result['clients']} clients, {result['machine']['cpus']} CPUs")
    print(f"{'scenario':<14} {'requests':>8} {'req/s':>8} {'MB/s':>8} {'KB/answer':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for name, r in result["scenarios"].items():
        print(f"{name:<14} {r['requests']:>8} {r['requests_per_s']:>8.1f} {r['mb_per_s']:>8.1f} {r['mean_response_kb']:>10.1f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", help="a Postgres server to create a scratch database on (default: SQLite in a temp dir)")
    p.add_argument("--plans", type=int, default=200)
    p.add_argument("--min-kib", type=int, default=64)
    p.add_argument("--max-kib", type=int, default=1024)
    p.add_argument("--keys", type=int, default=100, help="graph keys per resolve")
    p.add_argument("--clients", type=int, default=8, help="concurrent connections")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per scenario")
    p.add_argument("--max-requests", type=int, default=5000, help="requests per scenario at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "service.json")
    p.add_argument("--serve-static", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_static is not None:
        serve_static(args.serve_static, args.port)
        return
    if min(args.plans, args.keys, args.clients, args.max_requests) < 1 or not 0 < args.duration <= 600:
        p.error("--plans, --keys, --clients and --max-requests must be positive; --duration in (0, 600]")
    if not 1 <= args.min_kib <= args.max_kib:
        p.error("need 1 <= --min-kib <= --max-kib")
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    merged = json.loads(args.out.read_text()) if args.out.exists() else {}
    merged[result["database"]] = result
    args.out.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
