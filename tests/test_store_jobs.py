"""The job queue contract, on SQLite and Postgres: de-duplication, claims, leases, fencing, retries."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from pydantic import ValidationError

from plancache import errors
from plancache.environment import Environment
from plancache.protocol import TargetEnvironment

ANY = TargetEnvironment()


@pytest.fixture
def key(store, make_spec):
    k, spec = make_spec(0)
    store.put_spec(k, spec)
    return k


def test_enqueue_deduplicates_queued_and_running_jobs(store, key, gpu_env):
    job, created = store.enqueue(key, TargetEnvironment(sm=90), priority=3, max_attempts=2)
    assert created and job.status == "queued" and job.priority == 3 and job.max_attempts == 2
    assert job.attempts == 0 and job.fencing_token == 0 and job.lease_owner is None
    again, created = store.enqueue(key, TargetEnvironment(sm=90))
    assert not created and again.id == job.id
    other, created = store.enqueue(key, TargetEnvironment(sm=90, sm_count=132))
    assert created and other.id != job.id
    store.claim(gpu_env, "w1", lease_seconds=60)
    assert store.enqueue(key, TargetEnvironment(sm=90))[0].id in {job.id, other.id}
    assert store.job_counts() == {"queued": 1, "running": 1, "succeeded": 0, "failed": 0}


def test_enqueue_after_the_job_finished_creates_a_new_one(store, key, gpu_env):
    job, _ = store.enqueue(key, ANY, max_attempts=1)
    claimed = store.claim(gpu_env, "w1", lease_seconds=60)
    store.fail(job.id, "w1", claimed.fencing_token, "boom", retryable=False)
    new, created = store.enqueue(key, ANY)
    assert created and new.id != job.id


def test_enqueue_needs_the_spec_and_a_sane_max_attempts(store, key):
    with pytest.raises(errors.NotFound):
        store.enqueue("f" * 64, ANY)
    with pytest.raises(ValueError, match="max_attempts"):
        store.enqueue(key, ANY, max_attempts=0)


def test_enqueue_defaults_max_attempts_from_the_store(db_url, make_spec):
    from plancache.store import open_store

    with open_store(db_url, create=True, job_max_attempts=5) as s:
        k, spec = make_spec(1)
        s.put_spec(k, spec)
        assert s.enqueue(k, ANY)[0].max_attempts == 5


def test_claim_matches_environment_with_wildcards(store, make_spec, gpu_env):
    keys = []
    for i in range(4):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        keys.append(k)
    store.enqueue(keys[0], TargetEnvironment(sm=80))
    store.enqueue(keys[1], TargetEnvironment(sm=90, cudnn_version=90100))
    exact, _ = store.enqueue(keys[2], TargetEnvironment.exactly(gpu_env))
    wildcard, _ = store.enqueue(keys[3], TargetEnvironment(frontend_version="1.32.0"))
    got = {store.claim(gpu_env, "w", lease_seconds=60).id, store.claim(gpu_env, "w", lease_seconds=60).id}
    assert got == {exact.id, wildcard.id}
    assert store.claim(gpu_env, "w", lease_seconds=60) is None
    a100 = Environment(sm=80, sm_count=108, cudnn_version=91900, driver_version=13000, frontend_version="1.32.0")
    assert store.claim(a100, "w", lease_seconds=60).graph_key == keys[0]


def test_claim_order_is_priority_then_age(store, make_spec, gpu_env):
    ids = []
    for i, prio in enumerate([0, 5, 0, 5]):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        ids.append(store.enqueue(k, ANY, priority=prio)[0].id)
    order = [store.claim(gpu_env, "w", lease_seconds=60).id for _ in ids]
    assert order == [ids[1], ids[3], ids[0], ids[2]]


def test_claim_sets_lease_attempts_and_fencing_token(store, key, gpu_env, clock):
    job, _ = store.enqueue(key, ANY)
    claimed = store.claim(gpu_env, "w1", lease_seconds=30)
    assert claimed.id == job.id and claimed.status == "running" and claimed.lease_owner == "w1"
    assert claimed.attempts == 1 and claimed.fencing_token == 1
    assert claimed.lease_expires_at == clock.now + timedelta(seconds=30)
    with pytest.raises(ValueError, match="lease_seconds"):
        store.claim(gpu_env, "w1", lease_seconds=0)


def test_heartbeat_extends_the_lease_and_keeps_the_job(store, key, gpu_env, clock):
    store.enqueue(key, ANY)
    job = store.claim(gpu_env, "w1", lease_seconds=10)
    for _ in range(3):
        clock.advance(8)
        job = store.heartbeat(job.id, "w1", job.fencing_token, lease_seconds=10)
    assert job.lease_expires_at == clock.now + timedelta(seconds=10)
    assert store.claim(gpu_env, "w2", lease_seconds=10) is None


def test_heartbeat_refuses_non_holders(store, key, gpu_env):
    store.enqueue(key, ANY)
    job = store.claim(gpu_env, "w1", lease_seconds=10)
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(job.id, "w2", job.fencing_token, lease_seconds=10)
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(job.id, "w1", job.fencing_token + 1, lease_seconds=10)
    with pytest.raises(errors.NotFound):
        store.heartbeat(job.id + 100, "w1", job.fencing_token, lease_seconds=10)


def test_expired_lease_not_yet_taken_over_is_still_held(store, key, gpu_env, clock):
    store.enqueue(key, ANY)
    job = store.claim(gpu_env, "w1", lease_seconds=10)
    clock.advance(11)
    assert store.heartbeat(job.id, "w1", job.fencing_token, lease_seconds=10).status == "running"


def test_stopped_worker_loses_its_job_and_only_the_new_holder_completes(store, key, gpu_env, clock, make_plan):
    store.enqueue(key, ANY)
    first = store.claim(gpu_env, "w1", lease_seconds=10)
    store.heartbeat(first.id, "w1", first.fencing_token, lease_seconds=10)
    clock.advance(11)  # w1 stops heartbeating
    second = store.claim(gpu_env, "w2", lease_seconds=10)
    assert second.id == first.id and second.fencing_token == first.fencing_token + 1 and second.attempts == 2

    stale_meta, stale_blob = make_plan(key, gpu_env, blob=b"from w1", worker_id="w1")
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(first.id, "w1", first.fencing_token, lease_seconds=10)
    with pytest.raises(errors.LeaseLost):
        store.publish_plan(stale_meta, stale_blob, job_id=first.id, worker_id="w1", lease_token=first.fencing_token)
    with pytest.raises(errors.LeaseLost):
        store.fail(first.id, "w1", first.fencing_token, "late failure")
    assert store.get_blob(stale_meta.blob_sha256) is None and store.get_plan(key, gpu_env) is None

    meta, blob = make_plan(key, gpu_env, blob=b"from w2", worker_id="w2")
    record = store.publish_plan(meta, blob, job_id=second.id, worker_id="w2", lease_token=second.fencing_token)
    assert record.worker_id == "w2" and record.job_id == second.id
    done = store.get_job(second.id)
    assert done.status == "succeeded" and done.finished_at == clock.now and done.lease_expires_at is None
    with pytest.raises(errors.LeaseLost):
        store.publish_plan(stale_meta, stale_blob, job_id=first.id, worker_id="w1", lease_token=first.fencing_token)
    assert store.get_plan(key, gpu_env).blob_sha256 == meta.blob_sha256
    assert store.list_plans() == [record]


def test_same_worker_reclaiming_gets_a_new_token_and_the_old_one_is_fenced(store, key, gpu_env, clock):
    store.enqueue(key, ANY)
    old = store.claim(gpu_env, "w1", lease_seconds=10)
    clock.advance(11)
    new = store.claim(gpu_env, "w1", lease_seconds=10)
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(old.id, "w1", old.fencing_token, lease_seconds=10)
    assert store.heartbeat(new.id, "w1", new.fencing_token, lease_seconds=10).fencing_token == new.fencing_token


def test_failures_retry_until_max_attempts_then_fail_with_the_error(store, key, gpu_env):
    job, _ = store.enqueue(key, ANY, max_attempts=3)
    for attempt in (1, 2):
        claimed = store.claim(gpu_env, "w1", lease_seconds=10)
        assert claimed.attempts == attempt
        back = store.fail(job.id, "w1", claimed.fencing_token, f"error {attempt}")
        assert back.status == "queued" and back.error == f"error {attempt}" and back.lease_owner is None
    claimed = store.claim(gpu_env, "w1", lease_seconds=10)
    final = store.fail(job.id, "w1", claimed.fencing_token, "error 3")
    assert final.status == "failed" and final.error == "error 3" and final.attempts == 3 and final.finished_at
    assert store.claim(gpu_env, "w1", lease_seconds=10) is None
    assert store.get_job(job.id) == final


def test_non_retryable_failure_ends_the_job_at_once(store, key, gpu_env):
    job, _ = store.enqueue(key, ANY, max_attempts=5)
    claimed = store.claim(gpu_env, "w1", lease_seconds=10)
    failed = store.fail(job.id, "w1", claimed.fencing_token, "spec cannot be lowered", retryable=False)
    assert failed.status == "failed" and failed.attempts == 1 and failed.error == "spec cannot be lowered"


def test_lease_expiry_on_the_last_attempt_fails_the_job(store, key, gpu_env, clock):
    job, _ = store.enqueue(key, ANY, max_attempts=2)
    for _ in range(2):
        assert store.claim(gpu_env, "w1", lease_seconds=10).id == job.id
        clock.advance(11)
    assert store.claim(gpu_env, "w2", lease_seconds=10) is None
    failed = store.get_job(job.id)
    assert failed.status == "failed" and failed.error == "lease expired after 2 attempts"
    assert failed.finished_at == clock.now


def test_list_jobs_and_counts(store, make_spec, gpu_env):
    ids = []
    for i in range(3):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        ids.append(store.enqueue(k, ANY)[0].id)
    store.claim(gpu_env, "w", lease_seconds=10)
    assert [j.id for j in store.list_jobs()] == ids[::-1]
    assert [j.id for j in store.list_jobs(status="running")] == [ids[0]]
    assert [j.id for j in store.list_jobs(limit=1, offset=1)] == [ids[1]]
    assert [j.id for j in store.list_jobs(graph_key=make_spec(2)[0])] == [ids[2]]
    assert store.job_counts() == {"queued": 2, "running": 1, "succeeded": 0, "failed": 0}
    with pytest.raises(ValueError, match="status"):
        store.list_jobs(status="done")
    with pytest.raises(errors.NotFound):
        store.get_job(12345)


def test_concurrent_claimers_claim_every_job_exactly_once(store, make_spec, gpu_env):
    """8 threads drain 200 jobs: each job is handed out exactly once."""
    n_jobs, n_workers = 200, 8
    for i in range(n_jobs):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        store.enqueue(k, ANY)
    claims: list[tuple[str, int]] = []
    lock = threading.Lock()
    start = threading.Barrier(n_workers)

    def work(worker: str) -> None:
        start.wait()
        while (job := store.claim(gpu_env, worker, lease_seconds=300)) is not None:
            with lock:
                claims.append((worker, job.id))

    with ThreadPoolExecutor(n_workers) as pool:
        for f in [pool.submit(work, f"w{i}") for i in range(n_workers)]:
            f.result(timeout=120)
    per_job = Counter(job_id for _, job_id in claims)
    assert len(per_job) == n_jobs and set(per_job.values()) == {1}
    assert store.job_counts()["running"] == n_jobs
    assert len({w for w, _ in claims}) > 1  # the claimers really ran concurrently


def test_out_of_range_values_are_refused_clearly(store, key, gpu_env):
    from plancache.errors import InvalidValue

    with pytest.raises(InvalidValue, match="priority"):
        store.enqueue(key, ANY, priority=2**40)
    with pytest.raises(ValidationError):  # the wire model refuses it first ...
        TargetEnvironment(cudnn_version=10**12)
    with pytest.raises(InvalidValue, match="cudnn_version"):  # ... and the store when a caller skips validation
        store.enqueue(key, TargetEnvironment.model_construct(cudnn_version=10**12))
    with pytest.raises(InvalidValue, match="driver_version"):
        store.claim(gpu_env.model_copy(update={"driver_version": 10**30}), "w", lease_seconds=10)
    with pytest.raises(InvalidValue, match="limit"):
        store.list_jobs(limit=-1)
    for job_id in (0, -1, 10**30):
        with pytest.raises(errors.NotFound):
            store.get_job(job_id)
        with pytest.raises(errors.NotFound):
            store.heartbeat(job_id, "w", 1, lease_seconds=10)


def test_concurrent_identical_enqueues_make_one_job(store, key):
    start = threading.Barrier(8)

    def enqueue():
        start.wait()
        return store.enqueue(key, TargetEnvironment(sm=90))

    with ThreadPoolExecutor(8) as pool:
        results = [f.result(timeout=60) for f in [pool.submit(enqueue) for _ in range(8)]]
    assert len({job.id for job, _ in results}) == 1 and sum(created for _, created in results) == 1
    assert store.job_counts()["queued"] == 1
