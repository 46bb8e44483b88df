"""Counts of jobs kept without counting history, and the retention of finished jobs, misses and withdrawals, on SQLite
and Postgres."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from plancache.protocol import TargetEnvironment
from plancache.store.history import prune_history
from plancache.store.models import jobs, misses
from tests.factories import OTHER_GPU


def _counted(store) -> dict[str, int]:
    """The jobs of each status, counted row by row."""
    with store.db.read() as conn:
        counts = dict(conn.execute(sa.select(jobs.c.status, sa.func.count()).group_by(jobs.c.status)).all())
    return {s: counts.get(s, 0) for s in ("queued", "running", "succeeded", "failed")}


@pytest.fixture
def keys(store, make_spec):
    out = []
    for i in range(6):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        out.append(key)
    return out


def test_job_counts_follow_every_way_a_job_ends(store, keys, make_plan, gpu_env, clock):
    target = TargetEnvironment.exactly(gpu_env)
    done, failed, expired, cancelled, _ = (store.enqueue(k, target, max_attempts=1)[0] for k in keys[:5])
    by_id = {}
    for _ in range(3):
        claim = store.claim(gpu_env, "w1", lease_seconds=60)
        by_id[claim.job.id] = claim
    meta, blob = make_plan(done.graph_key, gpu_env)
    store.publish_plan(meta, blob, job_id=done.id, worker_id="w1", lease_token=by_id[done.id].lease_token)
    store.fail(failed.id, "w1", by_id[failed.id].lease_token, "boom", retryable=False)
    store.cancel_job(cancelled.id, by="admin")
    assert store.job_counts() == _counted(store) == {"queued": 1, "running": 1, "succeeded": 1, "failed": 2}
    clock.advance(120)  # the lease of `expired` ends with no attempt left: the next claim fails it
    store.claim(OTHER_GPU, "w2", lease_seconds=60)
    assert store.job_counts() == _counted(store) == {"queued": 1, "running": 0, "succeeded": 1, "failed": 3}
    meta, blob = make_plan(expired.graph_key, gpu_env)  # its holder still delivers it
    store.publish_plan(meta, blob, job_id=expired.id, worker_id="w1", lease_token=by_id[expired.id].lease_token)
    assert store.job_counts() == _counted(store) == {"queued": 1, "running": 0, "succeeded": 2, "failed": 2}


def test_prune_history_deletes_what_ended_before_each_bound(store, keys, make_plan, gpu_env, clock):
    target = TargetEnvironment.exactly(gpu_env)
    tuned, old, recent = (store.enqueue(k, target)[0] for k in keys[:3])
    claims = {c.job.id: c for c in (store.claim(gpu_env, "w1", lease_seconds=60) for _ in range(3))}
    meta, blob = make_plan(tuned.graph_key, gpu_env)
    store.publish_plan(meta, blob, job_id=tuned.id, worker_id="w1", lease_token=claims[tuned.id].lease_token)
    store.fail(old.id, "w1", claims[old.id].lease_token, "boom", retryable=False)
    store.record_misses(gpu_env, keys[3:5])
    clock.advance(3 * 86400)
    store.fail(recent.id, "w1", claims[recent.id].lease_token, "boom", retryable=False)
    store.record_misses(gpu_env, keys[4:6])
    queued, _ = store.enqueue(keys[0], TargetEnvironment(sm=80))
    day = timedelta(days=1)

    dry = prune_history(store, jobs_older_than=day, misses_older_than=day, dry_run=True)
    assert (dry.jobs_deleted, dry.misses_deleted) == (1, 1)  # `tuned` tuned a stored plan; keys[4] was seen again
    assert _counted(store)["failed"] == 2
    report = prune_history(store, jobs_older_than=day, misses_older_than=day)
    assert (report.jobs_deleted, report.misses_deleted, report.withdrawals_deleted) == (1, 1, 0)
    with store.db.read() as conn:
        assert set(conn.execute(sa.select(jobs.c.id)).scalars()) == {tuned.id, recent.id, queued.id}
        assert set(conn.execute(sa.select(misses.c.graph_key)).scalars()) == set(keys[4:6])
    assert store.job_counts() == _counted(store) == {"queued": 1, "running": 0, "succeeded": 1, "failed": 1}
    with pytest.raises(ValueError, match="positive"):
        prune_history(store, jobs_older_than=timedelta(0))


def test_plans_gc_prunes_history_when_asked(store, keys, gpu_env, clock, db_url, monkeypatch):
    from typer.testing import CliRunner

    from plancache.cli import make_app

    clock.advance(-86400)  # a day before the real clock, which the CLI's store reads
    store.record_misses(gpu_env, keys[:2])
    monkeypatch.setenv("PLANCACHE_DATABASE_URL", db_url)
    out = CliRunner().invoke(make_app(), ["plans", "gc", "--misses-days", "0.5", "--jobs-days", "0.5"])
    assert out.exit_code == 0, out.output
    assert "deleted 0 finished jobs older than 0.5 days" in out.output
    assert "deleted 2 misses older than 0.5 days" in out.output
