"""Job-queue claim throughput (jobs/s) on SQLite and Postgres.

    python bench/claim_throughput.py [--jobs 2000] [--workers 1,8] [--postgres-url URL] [--json OUT]

For each database and each worker count, a fresh database gets ``--jobs`` queued jobs; the worker
threads then drain the queue (``claim`` until None) and, in a second phase on a refilled queue, run a
whole cycle per job: ``claim`` → ``heartbeat`` → ``publish_plan`` (blob + record + job completion).
Every job must be claimed exactly once; the figures are jobs per second of wall time. SQLite is a file
in a temporary directory; Postgres is a temporary database created via the admin URL
(``PLANCACHE_TEST_POSTGRES_URL``) and dropped afterwards. Bounded: ``--deadline`` seconds per phase.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from plancache.environment import Environment  # noqa: E402
from plancache.protocol import PlanMeta, TargetEnvironment  # noqa: E402
from plancache.spec import SpecBuilder, graph_key  # noqa: E402
from plancache.store import Store, open_store  # noqa: E402
from plancache.store.db import normalize_url  # noqa: E402

ENV = Environment(sm=90, sm_count=132, cudnn_version=91900, driver_version=13000, frontend_version="1.32.0")


def _spec(i: int) -> dict:
    b = SpecBuilder(io_data_type="bfloat16", name=f"bench_{i}")
    a = b.tensor("A", dim=[1, 16 + i, 64])
    w = b.tensor("B", dim=[1, 64, 32])
    b.relu(b.matmul(a, w)).set_output(True).set_name("Y")
    return b.build().to_json()


@contextmanager
def sqlite_db() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        yield f"sqlite:///{d}/bench.db"


@contextmanager
def postgres_db(admin_url: str) -> Iterator[str]:
    name = f"plancache_bench_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(normalize_url(admin_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield normalize_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def _fill(store: Store, keys: list[str]) -> None:
    for k in keys:
        store.enqueue(k, TargetEnvironment(sm=90))


def _run_threads(workers: int, body: Callable[[str], list[int]], deadline: float) -> tuple[float, list[int]]:
    start, claimed, lock = threading.Barrier(workers + 1), [], threading.Lock()

    def run(worker: str) -> None:
        start.wait()
        got = body(worker)
        with lock:
            claimed.extend(got)

    threads = [threading.Thread(target=run, args=(f"bench-{i}",), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout=max(0.0, deadline - (time.perf_counter() - t0)))
    elapsed = time.perf_counter() - t0
    if any(t.is_alive() for t in threads):
        raise SystemExit(f"a phase ran past the {deadline:.0f} s deadline")
    return elapsed, claimed


def _claim_only(store: Store, stop_at: float) -> Callable[[str], list[int]]:
    def body(worker: str) -> list[int]:
        got = []
        while time.perf_counter() < stop_at and (claim := store.claim(ENV, worker, lease_seconds=600)) is not None:
            got.append(claim.job.id)
        return got
    return body


def _full_cycle(store: Store, stop_at: float) -> Callable[[str], list[int]]:
    def body(worker: str) -> list[int]:
        got = []
        while time.perf_counter() < stop_at and (claim := store.claim(ENV, worker, lease_seconds=600)) is not None:
            job = claim.job
            store.heartbeat(job.id, worker, claim.lease_token, lease_seconds=600)
            blob = f"plan for job {job.id}".encode() * 64
            meta = PlanMeta(graph_key=job.graph_key, environment=ENV, blob_sha256=hashlib.sha256(blob).hexdigest(),
                            blob_size=len(blob), engine_id=1, workspace_bytes=0, winner_median_ms=0.1,
                            tuning_seconds=1.0, worker_id=worker)
            store.publish_plan(meta, blob, job_id=job.id, worker_id=worker, lease_token=claim.lease_token)
            got.append(job.id)
        return got
    return body


def measure(url: str, jobs: int, workers: int, deadline: float) -> dict[str, float]:
    store = open_store(url, create=True)
    try:
        keys = []
        for i in range(jobs):
            spec = _spec(i)
            key = graph_key(spec)
            store.put_spec(key, spec)
            keys.append(key)
        result = {}
        for phase, make_body in (("claim", _claim_only), ("cycle", _full_cycle)):
            if phase == "cycle":
                with store.engine.begin() as conn:  # the drained jobs are running; start from an empty queue
                    conn.exec_driver_sql("DELETE FROM jobs")
            _fill(store, keys)
            elapsed, claimed = _run_threads(workers, make_body(store, time.perf_counter() + deadline), deadline + 5)
            counts = Counter(claimed)
            if len(counts) != jobs or set(counts.values()) != {1}:
                raise SystemExit(f"{phase}: {len(counts)} of {jobs} jobs claimed, some more than once: {counts.most_common(1)}")
            result[f"{phase}_jobs_per_s"] = jobs / elapsed
        return result
    finally:
        store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--workers", default="1,8", help="comma-separated worker-thread counts")
    p.add_argument("--postgres-url", default=os.environ.get("PLANCACHE_TEST_POSTGRES_URL",
                                                            "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    p.add_argument("--no-postgres", action="store_true")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds allowed per phase")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    databases: list[tuple[str, Callable[[], object]]] = [("sqlite", sqlite_db)]
    if not args.no_postgres:
        databases.append(("postgres", lambda: postgres_db(args.postgres_url)))
    rows = []
    print(f"{'database':<10} {'workers':>7} {'jobs':>6} {'claim jobs/s':>13} {'claim+heartbeat+publish jobs/s':>31}")
    for name, make_db in databases:
        for workers in (int(w) for w in args.workers.split(",")):
            with make_db() as url:
                r = measure(url, args.jobs, workers, args.deadline)
            rows.append({"database": name, "workers": workers, "jobs": args.jobs, **r})
            print(f"{name:<10} {workers:>7} {args.jobs:>6} {r['claim_jobs_per_s']:>13.0f} {r['cycle_jobs_per_s']:>31.0f}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
