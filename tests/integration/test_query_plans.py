"""The plans the databases choose for the hot statements: each through the index meant for it, with table statistics
fresh (ANALYZE after a fill) or stale (as the migration left them, on an empty store), so that their cost stays flat
in the plans and jobs a store keeps. ``bench/db_scale.py`` measures that cost at 100,000 plans (where Postgres with
stale statistics must not scan a table either); this guards the choice of index on a small store, fast."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from bench.db_scale import ENVS, fill, key
from plancache.server.status_page import gather
from plancache.store import Store
from plancache.store.db import analyze
from plancache.store.models import plans


@contextmanager
def statements(store: Store) -> Iterator[list[tuple[str, Any]]]:
    """The statements (SQL, parameters) run against the store while the block runs."""
    seen: list[tuple[str, Any]] = []

    def note(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        seen.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)


def plans_of(store: Store, call: Callable[[], Any], table: str) -> list[str]:
    """The query plan of each statement ``call`` runs that reads ``table``."""
    with statements(store) as seen:
        call()
    pg = store.engine.dialect.name == "postgresql"
    out = []
    with store.engine.connect() as conn:
        if pg:  # a small table is rightly scanned: only a scan with no index left to take is one here
            conn.exec_driver_sql("SET enable_seqscan = off")
        for sql, params in seen:
            if sql.startswith("SET LOCAL "):  # the planner settings the statements after it ran under
                conn.exec_driver_sql(sql)
            elif re.search(rf"\b(FROM|UPDATE) {table}\b", sql) and not sql.lstrip().upper().startswith("INSERT"):
                rows = conn.exec_driver_sql(("EXPLAIN " if pg else "EXPLAIN QUERY PLAN ") + sql, params).all()
                out.append("\n".join(str(r[-1]) for r in rows))
    assert out, f"no statement read {table}"
    return out


@pytest.fixture(params=["stale", "analyzed"])
def seeded(request: pytest.FixtureRequest, store: Store) -> Store:
    """2,000 plans over 4 environments; 3,000 jobs of the others (queued and finished); 200 queued for ENVS[0]."""
    fill(store, 2000, 3000)
    if request.param == "analyzed":
        with store.db.write() as conn:
            analyze(conn)
    return store


def _scans(plan: str, table: str) -> bool:
    """Whether ``plan`` reads ``table`` (or its alias) whole rather than seeking an index, or reading one in order (the
    running jobs' index is read whole: a claim fails the expired leases among them)."""
    return bool(re.search(rf"Seq Scan on {table}\b|^SCAN {table}\b(?! USING INDEX (ix_jobs_running|ix_plans_created_at"
                          rf"|ix_misses_count))", plan, re.M))


def test_resolve_seeks_the_keys_in_the_graph_key_index(seeded: Store) -> None:
    keys = [key(i) for i in range(49)]
    for plan in plans_of(seeded, lambda: (seeded.plan_versions(ENVS[0], keys), seeded.plan_records(ENVS[0], keys)),
                         "plans"):
        assert not _scans(plan, "plans"), plan
        assert re.search(r"(uq_plans_graph_key_env_id|sqlite_autoindex_plans_1|ix_plans_graph_key)\b", plan), plan


def test_explain_reads_the_rows_of_its_keys(seeded: Store) -> None:
    keys = [key(i) for i in range(49)]
    for table, index in (("jobs", "ix_jobs_graph_key_target_key_id"), ("plans", "graph_key"), ("misses", "graph_key"),
                         ("withdrawals", "graph_key")):
        plans = plans_of(seeded, lambda: seeded.explain_misses(ENVS[0], keys), table)
        assert any(index in plan for plan in plans) and not any(_scans(plan, table) for plan in plans), plans


def test_a_claim_seeks_its_environments_active_jobs(seeded: Store) -> None:
    plans = plans_of(seeded, lambda: seeded.claim(ENVS[0], "w", lease_seconds=60), "jobs")
    claim = [p for p in plans if re.search(r"uq_jobs_active_target \(target_key=|Index Cond: \(\(target_key\)", p)
             and "uq_jobs_active_target" in p]
    assert claim, plans
    assert all(not _scans(p, "candidate") and not _scans(p, "jobs") for p in plans), plans
    assert any("ix_jobs_running" in p for p in plans), plans  # the expired leases' step


def test_the_status_page_reads_the_newest_plans_and_top_misses_in_index_order(seeded: Store) -> None:
    seeded.record_misses(ENVS[0], [key(10_000 + i) for i in range(50)])
    for table, index in (("plans", "ix_plans_created_at"), ("misses", "ix_misses_count")):
        plan = plans_of(seeded, lambda: gather(seeded), table)[0]
        assert index in plan and not _scans(plan, table) and "TEMP B-TREE FOR ORDER BY" not in plan, plan


def test_job_counts_count_only_active_jobs_in_their_index(seeded: Store) -> None:
    """Ended jobs are counted from their tallies (tests/integration/test_history.py), not read."""
    (plan,) = plans_of(seeded, seeded.job_counts, "jobs")
    assert "uq_jobs_active_target" in plan and "Seq Scan" not in plan, plan


def test_migrating_leaves_table_statistics(store: Store) -> None:
    """``upgrade`` runs ANALYZE: the planner knows the tables from the start (the statements above need it not)."""
    with store.engine.connect() as conn:
        if store.engine.dialect.name == "postgresql":  # -1: never analyzed
            assert conn.exec_driver_sql("SELECT reltuples FROM pg_class WHERE relname = 'jobs'").scalar() >= 0
        else:
            assert conn.exec_driver_sql("SELECT count(*) FROM sqlite_master WHERE name = 'sqlite_stat1'").scalar() == 1


def test_statements_differing_only_in_the_named_index_compile_apart() -> None:
    from sqlalchemy.dialects import sqlite

    from plancache.store.db import indexed_alias
    from plancache.store.models import jobs

    first, second = (sa.select(indexed_alias(jobs, "j", index).c.id) for index in ("ix_one", "ix_two"))
    assert first._generate_cache_key() != second._generate_cache_key()
    assert "INDEXED BY ix_two" in str(second.compile(dialect=sqlite.dialect()))


@pytest.mark.parametrize("status", ["queued", "running", "failed", "succeeded"])
def test_jobs_of_a_status_are_read_through_its_index(seeded: Store, status: str) -> None:
    seeded.claim(ENVS[0], "w", lease_seconds=60)
    (plan,) = plans_of(seeded, lambda: seeded.list_jobs(status=status, limit=10), "jobs")  # type: ignore[arg-type]
    index = {"queued": "uq_jobs_active_target", "running": "ix_jobs_running"}.get(status, "ix_jobs_finished")
    if seeded.engine.dialect.name == "postgresql" and index != "ix_jobs_finished":
        assert "Seq Scan" not in plan, plan  # active jobs: as many as are queued or running, sorted
    else:
        assert index in plan, plan
    if index == "ix_jobs_finished" and seeded.engine.dialect.name == "postgresql":
        # ended jobs: the page read in the index's order, never every job of the status sorted, whatever the
        # statistics say (SQLite, which names the index, sorts the few of this store's: it counts them)
        assert "Index Scan Backward using ix_jobs_finished" in plan and "Sort" not in plan and "Bitmap" not in plan, plan


def test_an_environments_plans_are_read_newest_first_through_its_index(seeded: Store) -> None:
    """``plans list --environment``: the page walks the environment's index and stops, never reading every record of
    the environment to sort it, nor every record of the store newest first (this environment's are the oldest)."""
    (plan,) = plans_of(seeded, lambda: seeded.list_plans(env_id=ENVS[0].env_id, limit=10), "plans")
    assert "ix_plans_env_id_created_at" in plan and "TEMP B-TREE" not in plan, plan
    if seeded.engine.dialect.name == "postgresql":
        assert "Index Scan Backward using ix_plans_env_id_created_at" in plan and "Sort" not in plan \
            and "Bitmap" not in plan, plan


def test_a_graph_s_siblings_are_read_newest_first_through_their_index(seeded: Store) -> None:
    """``POST /v1/plans/siblings``: a graph's other shapes' plans on one environment, newest first, read through
    ``ix_plans_env_id_sibling_key`` and stopped at the limit: never the environment's every record, nor those of
    every environment, sorted."""
    from examples.generate import sdpa_causal
    from plancache.spec.axes import sibling_key
    from tests.factories import make_meta

    spec = sdpa_causal(batch=2, heads=16, seq=1024, d=128)
    seeded.put_spec(spec.graph_key, spec.to_json())
    seeded.publish_plan(make_meta(spec.graph_key, ENVS[0], b"plan"), b"plan")
    with seeded.engine.begin() as conn:  # siblings: a tenth of every environment's records
        conn.execute(sa.update(plans).where(plans.c.id % 10 == 0).values(sibling_key=sibling_key(spec)))
    found = seeded.plan_siblings(ENVS[0], [spec.graph_key], 16)
    assert len(found) == 16
    (plan,) = plans_of(seeded, lambda: seeded.plan_siblings(ENVS[0], [spec.graph_key], 16), "plans")
    assert "ix_plans_env_id_sibling_key" in plan and "TEMP B-TREE" not in plan, plan
    if seeded.engine.dialect.name == "postgresql":
        assert "Index Scan Backward using ix_plans_env_id_sibling_key" in plan and "Sort" not in plan \
            and "Bitmap" not in plan, plan
