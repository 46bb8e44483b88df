"""What the server's hot queries cost as a store grows: resolve, claim, ``/ui`` and ``/metrics`` on SQLite and Postgres.

    python bench/db_scale.py [--sizes 1000:0,10000:20000,100000:500000] [--databases sqlite,postgres]
                             [--runs 50] [--claims 200] [--analyze] [--json OUT]

Each size is ``PLANS:JOBS``: a fresh database (migrated by this checkout's ``open_store``) is filled in a few
``INSERT … SELECT`` statements with PLANS plan records over 4 environments and JOBS jobs: up to 20,000 queued for the
other environments, the rest finished on every environment (as a fleet's history leaves them); then 200 jobs queued
for the environment that claims. Table statistics are as the migration left them (no ``ANALYZE`` after the fill, as with
autovacuum off), unless ``--analyze``. Per size, medians of ``--runs``:

- ``resolve_ms`` / ``resolve_cpu_ms``: the server's records-only resolve of 49 stored keys (``_answer_heads`` of
  ``POST /v1/plans/resolve``) with an empty record memo, so the records are read: wall time and this process's CPU;
- ``versions_ms``: its first query alone (a warm memo's whole database cost);
- ``new_pair_ms``: the reads of a resolve of two stored keys, blobs inline (versions, records, blobs), as the server
  makes them (Postgres: in autocommit, no ``BEGIN``/``COMMIT`` round trips), and ``new_pair_in_transactions_ms``:
  the same, each read in a transaction of its own, the two taking turns;
- ``env_plans_ms``: the first page (100) of one environment's records, newest first (``plancache plans list
  --environment``), the environment whose records are the store's oldest;
- ``siblings_ms``: the specs of 16 plans of a graph's other shapes on that environment (``POST /v1/plans/siblings``),
  of a graph whose siblings are one in ten of every environment's records;
- ``explain_ms``: explain of those 49 keys (each with a plan here, and finished jobs elsewhere);
- ``claim_ms``: one claim handing out a job of the claiming environment (median of ``--claims``), ``poll_ms``: a
  claim for an environment with nothing queued;
- ``ui_ms``: what ``/ui`` reads (``status_page.gather``), ``metrics_ms``: what ``/metrics`` reads (``job_counts``).

Postgres is a temporary database made via ``--postgres-url`` (default ``PLANCACHE_TEST_POSTGRES_URL``) and dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from bench.claim_throughput import postgres_db, sqlite_db  # noqa: E402
from examples.generate import sdpa_causal  # noqa: E402
from plancache.environment import Environment  # noqa: E402
from plancache.protocol import TargetEnvironment  # noqa: E402
from plancache.server.memo import RecordMemo  # noqa: E402
from plancache.server.routes.plans import _answer_heads  # noqa: E402
from plancache.server.status_page import gather  # noqa: E402
from plancache.spec.axes import sibling_key  # noqa: E402
from plancache.store import Store, open_store  # noqa: E402
from plancache.store.jobs import insert_jobs, target_key  # noqa: E402
from plancache.store.models import plans as plans_table  # noqa: E402

#: The environment that resolves and claims, and three others that share the store.
ENVS = [Environment(sm=90, sm_count=132 - 2 * j, cudnn_version=91900 + j, driver_version=13000,
                    frontend_version="1.32.0", device_name="bench") for j in range(4)]
IDLE = Environment(sm=100, sm_count=148, cudnn_version=91900, driver_version=13000, frontend_version="1.32.0")
QUEUED_ELSEWHERE = 20_000
OWN_JOBS = 200
KEYS_PER_RESOLVE = 49
#: The fill's records fall in this many groups of siblings (each record's ``sibling_key``: the group's, from
#: ``SIBLING_BASE`` on), so that one graph has as siblings one in ten of every environment's records.
GROUPS, SIBLING_BASE = 10, 1 << 40
_T = "2026-01-01 00:00:00"


def _numbers(dialect: str, n_param: str) -> tuple[str, str]:
    """A WITH prefix and FROM item giving ``n.i`` = 0 .. :n_param - 1."""
    if dialect == "postgresql":
        return "", f"generate_series(0, :{n_param} - 1) AS n(i)"
    return f"WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < :{n_param}) ", "n"


def _key(dialect: str, expr: str) -> str:
    return f"lpad(to_hex({expr}), 64, '0')" if dialect == "postgresql" else f"printf('%064x', {expr})"


def key(i: int) -> str:
    return f"{i:064x}"


def fill(store: Store, plans: int, jobs: int) -> None:
    """PLANS records over :data:`ENVS`, JOBS jobs (queued for the other environments, then finished on each), and
    :data:`OWN_JOBS` queued for ``ENVS[0]``."""
    per_env = plans // len(ENVS)
    queued = min(jobs, QUEUED_ELSEWHERE)
    n_specs = max(per_env, queued // 3 + 1, OWN_JOBS)
    with store.db.write() as conn:
        d = conn.dialect.name
        ts = "TIMESTAMPTZ '2026-01-01 00:00:00+00'" if d == "postgresql" else f"'{_T}.000000'"
        w, frm = _numbers(d, "n")
        conn.execute(sa.text(f"{w}INSERT INTO specs (graph_key, canonical_json, created_at) "
                             f"SELECT {_key(d, 'i')}, '{{}}', {ts} FROM {frm}"), {"n": n_specs})
        blob = "0" * 64
        conn.execute(sa.text(f"INSERT INTO blobs (sha256, size, data, created_at) VALUES (:s, 1, :b, {ts})"),
                     {"s": blob, "b": b"x"})
        for env in ENVS:
            conn.execute(sa.text(
                f"{w}INSERT INTO plans (graph_key, env_id, sm, sm_count, cudnn_version, driver_version, frontend_version, "
                "device_name, cuda_runtime, torch_version, blob_sha256, blob_size, revision, engine_id, knobs, plan_name, "
                "workspace_bytes, winner_median_ms, heuristic_median_ms, worst_median_ms, tuning_seconds, worker_id, "
                f"numerics_check, created_at, sibling_key) SELECT {_key(d, 'i')}, :env_id, :sm, :sm_count, :cudnn_version, "
                ":driver_version, :frontend_version, 'bench', '', '', :blob, 1, 1, 7, '{\"k\": 1}', 'engine7', 0, 0.5, "
                f"1.0, 2.0, 1.5, 'w', 'reference', {ts}, {_key(d, f'{SIBLING_BASE} + i % {GROUPS}')} FROM {frm}"),
                {"n": per_env, "env_id": env.env_id, "blob": blob, **env.validity()})
        others = [TargetEnvironment.exactly(env) for env in ENVS[1:]]
        cols = "graph_key, sm, sm_count, cudnn_version, driver_version, frontend_version, target_key"
        for j, target in enumerate(others):  # queued: key i // 3 for the target i % 3
            conn.execute(sa.text(
                f"{w}INSERT INTO jobs ({cols}, status, priority, attempts, max_attempts, fencing_token, created_at, "
                f"updated_at, source) SELECT {_key(d, 'i / 3')}, :sm, :sm_count, :cudnn_version, :driver_version, "
                f":frontend_version, :tk, 'queued', 0, 0, 3, 0, {ts}, {ts}, 'admin' FROM {frm} WHERE i % 3 = :j"),
                {"n": queued, "j": j, "tk": target_key(target), **target.model_dump()})
        finished = jobs - queued
        for j, env in enumerate(ENVS):  # finished: every environment's history, own included
            target = TargetEnvironment.exactly(env)
            conn.execute(sa.text(
                f"{w}INSERT INTO jobs ({cols}, status, priority, attempts, max_attempts, fencing_token, created_at, "
                f"updated_at, finished_at, source) SELECT {_key(d, f'i % {n_specs}')}, :sm, :sm_count, :cudnn_version, "
                ":driver_version, :frontend_version, :tk, CASE WHEN i % 10 = 0 THEN 'failed' ELSE 'succeeded' END, 0, 1, "
                f"3, 1, {ts}, {ts}, {ts}, 'admin' FROM {frm} WHERE i % 4 = :j"),
                {"n": finished, "j": j, "tk": target_key(target), **target.model_dump()})
        insert_jobs(conn, [key(i) for i in range(OWN_JOBS)], TargetEnvironment.exactly(ENVS[0]), now=store.db.now(conn),
                    priority=0, max_attempts=3, source="admin")


def median_ms(fn: Callable[[], Any], runs: int) -> tuple[float, float]:
    """Median wall and process-CPU milliseconds of ``fn`` over ``runs`` calls."""
    walls, cpus = [], []
    for _ in range(runs):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append((time.perf_counter() - t0) * 1000)
        cpus.append((time.process_time() - c0) * 1000)
    return statistics.median(walls), statistics.median(cpus)


def _new_pair(store: Store, pair: list[str], runs: int) -> tuple[float, float]:
    """Median wall milliseconds of the reads a resolve of a new pair makes (versions, records, blobs inline): as
    the store makes them (:meth:`~plancache.store.db.Database.query`: on Postgres in autocommit), and each in a
    transaction of its own (:meth:`~plancache.store.db.Database.read`), the two taking turns, ``runs`` each."""
    def reads() -> None:
        versions = store.plan_versions(ENVS[0], pair)
        assert len(store.plan_records(ENVS[0], pair)) == len(pair)
        assert store.get_blobs({v.blob_sha256 for v in versions.values()})

    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(runs):
        for in_transactions in (False, True):
            if in_transactions:
                store.db.query = store.db.read  # type: ignore[method-assign]
            try:
                t0 = time.perf_counter()
                reads()
                times[in_transactions].append((time.perf_counter() - t0) * 1000)
            finally:
                vars(store.db).pop("query", None)
    return statistics.median(times[False]), statistics.median(times[True])


def _siblings(store: Store, plans: int) -> Callable[[], None]:
    """A real attention graph's siblings lookup: its spec stored, and the records of one group of the fill (one in
    :data:`GROUPS` of every environment's) made its siblings."""
    spec = sdpa_causal(batch=2, heads=16, seq=1024, d=128)
    store.put_spec(spec.graph_key, spec.to_json())
    with store.db.write() as conn:
        conn.execute(sa.update(plans_table).where(plans_table.c.sibling_key == f"{SIBLING_BASE:064x}")
                     .values(sibling_key=sibling_key(spec)))

    want = min(16, -(-(plans // len(ENVS)) // GROUPS))  # the group's records on ENVS[0], 16 at most

    def lookup() -> None:
        assert len(store.plan_siblings(ENVS[0], [spec.graph_key], 16)) == want

    return lookup


def measure(url: str, plans: int, jobs: int, args: argparse.Namespace) -> dict[str, Any]:
    store = open_store(url, create=True, blob_store="database")
    try:
        t0 = time.perf_counter()
        fill(store, plans, jobs)
        if args.analyze:
            with store.db.write() as conn:
                conn.exec_driver_sql("ANALYZE")
        filled = time.perf_counter() - t0
        rng = random.Random(1)
        keys = [key(i) for i in rng.sample(range(plans // len(ENVS)), KEYS_PER_RESOLVE)]

        def resolve() -> None:
            found = _answer_heads(store, RecordMemo(), ENVS[0], keys)
            assert len(found) == KEYS_PER_RESOLVE, len(found)

        def claim() -> None:
            assert store.claim(ENVS[0], "bench", lease_seconds=600) is not None

        def poll() -> None:
            assert store.claim(IDLE, "bench", lease_seconds=600) is None

        resolve()  # warm: connections, statement caches
        out: dict[str, Any] = {"plans": plans, "jobs": jobs, "fill_s": round(filled, 1)}
        out["resolve_ms"], out["resolve_cpu_ms"] = median_ms(resolve, args.runs)
        out["versions_ms"], _ = median_ms(lambda: store.plan_versions(ENVS[0], keys), args.runs)
        out["new_pair_ms"], out["new_pair_in_transactions_ms"] = _new_pair(store, keys[:2], args.runs)
        out["env_plans_ms"], _ = median_ms(lambda: store.list_plans(env_id=ENVS[0].env_id), args.runs)
        out["siblings_ms"], _ = median_ms(_siblings(store, plans), args.runs)
        out["explain_ms"], _ = median_ms(lambda: store.explain_misses(ENVS[0], keys), args.runs)
        out["claim_ms"], _ = median_ms(claim, min(args.claims, OWN_JOBS))
        out["poll_ms"], _ = median_ms(poll, args.runs)
        out["ui_ms"], _ = median_ms(lambda: gather(store), max(3, args.runs // 10))
        out["metrics_ms"], _ = median_ms(store.job_counts, max(3, args.runs // 10))
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000:0,10000:20000,100000:500000")
    ap.add_argument("--databases", default="sqlite,postgres")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--claims", type=int, default=OWN_JOBS)
    ap.add_argument("--analyze", action="store_true", help="ANALYZE after the fill")
    ap.add_argument("--postgres-url", default=os.environ.get("PLANCACHE_TEST_POSTGRES_URL",
                                                             "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    least = len(ENVS) * KEYS_PER_RESOLVE
    try:
        sizes = [tuple(int(x) for x in size.split(":")) for size in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(size) != 2 or size[0] < least or size[1] < 0 for size in sizes):
        ap.error(f"--sizes takes PLANS:JOBS pairs, comma-separated, each of at least {least} plans (a resolve reads "
                 f"{KEYS_PER_RESOLVE} keys of one of {len(ENVS)} environments) and no negative jobs")
    results = []
    for database in args.databases.split(","):
        for plans, jobs in sizes:
            with (sqlite_db() if database == "sqlite" else postgres_db(args.postgres_url)) as url:
                row = {"database": database, **measure(url, plans, jobs, args)}
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
