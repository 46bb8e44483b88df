"""The job queue contract, on SQLite and Postgres: de-duplication, claims, leases, fencing (secret lease tokens
bound to the claiming API token), retries, and lease times on the database's clock."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from plancache import errors
from plancache.protocol import TargetEnvironment, Withdrawal
from plancache.signing import Signer, keygen
from tests.factories import OTHER_GPU

ANY = TargetEnvironment()


def test_a_target_and_the_tables_follow_the_validity_fields():
    """The validity fields and their bounds are defined once (plancache.environment): a job's target names each
    of them, optional but bounded alike, and the plans, jobs and misses tables hold each in a column."""
    from plancache.environment import VALIDITY_FIELDS, Environment
    from plancache.store.models import jobs, misses, plans

    assert tuple(TargetEnvironment.model_fields) == VALIDITY_FIELDS
    assert all(f in table.c for f in VALIDITY_FIELDS for table in (jobs, misses, plans))
    for field, bad in (("sm", 9), ("sm_count", 0), ("cudnn_version", 2**31), ("driver_version", 0),
                       ("frontend_version", "")):
        with pytest.raises(ValidationError):
            TargetEnvironment(**{field: bad})
        with pytest.raises(ValidationError):
            Environment(**{**OTHER_GPU.model_dump(), field: bad})


@pytest.fixture
def key(store, make_spec):
    k, spec = make_spec(0)
    store.put_spec(k, spec)
    return k


def test_enqueue_deduplicates_queued_and_running_jobs(store, key, gpu_env):
    job, created = store.enqueue(key, TargetEnvironment(sm=90), priority=3, max_attempts=2)
    assert created and job.status == "queued" and job.priority == 3 and job.max_attempts == 2
    assert job.attempts == 0 and job.lease_owner is None and job.lease_holder is None
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
    store.fail(job.id, "w1", claimed.lease_token, "boom", retryable=False)
    new, created = store.enqueue(key, ANY)
    assert created and new.id != job.id


def test_a_job_queued_after_its_plan_was_published_replaces_it(store, key, gpu_env, clock, make_plan):
    """Before: re-enqueuing a key after its job succeeded (a re-tune) tuned it again, and the completion with the new
    blob was refused 409 (a different plan is stored), so the worker failed the job for good and the old plan stayed.
    After: the plan of a job queued after the stored record was written replaces it; a job queued before it (two
    tunings racing) is still refused, as is an older revision."""
    first, _ = store.enqueue(key, ANY)
    claim = store.claim(gpu_env, "w1", lease_seconds=60)
    store.publish_plan(*make_plan(key, gpu_env, b"old-plan"), job_id=first.id, worker_id="w1",
                       lease_token=claim.lease_token)
    clock.advance(1)
    retune, created = store.enqueue(key, ANY)
    racing, _ = store.enqueue(key, TargetEnvironment(sm=gpu_env.sm))  # queued too, before the re-tune's plan
    assert created and retune.id != first.id
    claims = {c.job.id: c for c in (store.claim(gpu_env, "w2", lease_seconds=60) for _ in range(2))}
    clock.advance(1)
    stale, blob = make_plan(key, gpu_env, b"stale-plan", revision=0)
    with pytest.raises(errors.StaleRevision):
        store.publish_plan(stale, blob, job_id=retune.id, worker_id="w2", lease_token=claims[retune.id].lease_token)
    record = store.publish_plan(*make_plan(key, gpu_env, b"new-plan"), job_id=retune.id, worker_id="w2",
                                lease_token=claims[retune.id].lease_token)
    assert store.get_plan(key, gpu_env).blob_sha256 == record.blob_sha256 != make_plan(key, gpu_env, b"old-plan")[0].blob_sha256
    assert store.get_job(retune.id).status == "succeeded" and record.job_id == retune.id
    with pytest.raises(errors.Conflict, match="different plan"):
        store.publish_plan(*make_plan(key, gpu_env, b"racing-plan"), job_id=racing.id, worker_id="w2",
                           lease_token=claims[racing.id].lease_token)


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
    got = {store.claim(gpu_env, "w", lease_seconds=60).job.id, store.claim(gpu_env, "w", lease_seconds=60).job.id}
    assert got == {exact.id, wildcard.id}
    assert store.claim(gpu_env, "w", lease_seconds=60) is None
    assert store.claim(OTHER_GPU, "w", lease_seconds=60).job.graph_key == keys[0]


def test_claim_order_is_priority_then_age(store, make_spec, gpu_env):
    ids = []
    for i, prio in enumerate([0, 5, 0, 5]):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        ids.append(store.enqueue(k, ANY, priority=prio)[0].id)
    order = [store.claim(gpu_env, "w", lease_seconds=60).job.id for _ in ids]
    assert order == [ids[1], ids[3], ids[0], ids[2]]


def test_claim_sets_lease_attempts_and_a_secret_lease_token(store, key, gpu_env, clock):
    from plancache.store.jobs import hash_lease_token
    from plancache.store.models import jobs

    job, _ = store.enqueue(key, ANY)
    claim = store.claim(gpu_env, "w1", lease_seconds=30, holder="token:1")
    claimed = claim.job
    assert claimed.id == job.id and claimed.status == "running" and claimed.lease_owner == "w1"
    assert claimed.attempts == 1 and claimed.lease_holder == "token:1"
    assert claimed.lease_expires_at == clock.now + timedelta(seconds=30)
    assert isinstance(claim.lease_token, str) and len(claim.lease_token) >= 40  # 256 random bits
    assert claim.lease_token not in repr(claim) and claim.lease_token not in claimed.model_dump_json()
    with store.engine.connect() as conn:  # only its hash is stored
        stored = conn.execute(sa.select(jobs.c.lease_token_hash).where(jobs.c.id == job.id)).scalar_one()
    assert stored == hash_lease_token(claim.lease_token) and claim.lease_token not in stored
    with pytest.raises(ValueError, match="lease_seconds"):
        store.claim(gpu_env, "w1", lease_seconds=0)


def test_every_claim_draws_a_new_unguessable_token(store, make_spec, gpu_env):
    tokens = set()
    for i in range(20):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        store.enqueue(k, ANY)
        tokens.add(store.claim(gpu_env, "w1", lease_seconds=60).lease_token)
    assert len(tokens) == 20 and not any(t.isdigit() for t in tokens)


def test_heartbeat_extends_the_lease_and_keeps_the_job(store, key, gpu_env, clock):
    store.enqueue(key, ANY)
    claim = store.claim(gpu_env, "w1", lease_seconds=10)
    for _ in range(3):
        clock.advance(8)
        job = store.heartbeat(claim.job.id, "w1", claim.lease_token, lease_seconds=10)
    assert job.lease_expires_at == clock.now + timedelta(seconds=10)
    assert store.claim(gpu_env, "w2", lease_seconds=10) is None


def test_heartbeat_refuses_non_holders(store, key, gpu_env):
    store.enqueue(key, ANY)
    claim = store.claim(gpu_env, "w1", lease_seconds=10)
    job_id = claim.job.id
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(job_id, "w2", claim.lease_token, lease_seconds=10)
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(job_id, "w1", claim.lease_token + "x", lease_seconds=10)
    with pytest.raises(errors.LeaseLost):  # the old counters are no tokens
        store.heartbeat(job_id, "w1", "1", lease_seconds=10)
    with pytest.raises(errors.NotFound):
        store.heartbeat(job_id + 100, "w1", claim.lease_token, lease_seconds=10)


def test_a_lease_is_bound_to_the_api_token_that_claimed_it(store, key, gpu_env, make_plan):
    job, _ = store.enqueue(key, ANY)
    claim = store.claim(gpu_env, "w1", lease_seconds=10, holder="token:1")
    meta, blob = make_plan(key, gpu_env, blob=b"from token 2", worker_id="w1")
    for other in ("token:2", None):  # the right lease token from another API token (or none) is refused
        with pytest.raises(errors.NotLeaseHolder, match="another API token"):
            store.heartbeat(job.id, "w1", claim.lease_token, lease_seconds=10, holder=other)
        with pytest.raises(errors.NotLeaseHolder):
            store.fail(job.id, "w1", claim.lease_token, "sabotage", retryable=False, holder=other)
        with pytest.raises(errors.NotLeaseHolder):
            store.publish_plan(meta, blob, job_id=job.id, worker_id="w1", lease_token=claim.lease_token, holder=other)
    assert store.get_job(job.id).status == "running" and store.get_plan(key, gpu_env) is None
    assert store.heartbeat(job.id, "w1", claim.lease_token, lease_seconds=10, holder="token:1").status == "running"
    store.publish_plan(meta, blob, job_id=job.id, worker_id="w1", lease_token=claim.lease_token, holder="token:1")
    assert store.completed_with(job.id, "w1", claim.lease_token, holder="token:1")
    assert not store.completed_with(job.id, "w1", claim.lease_token, holder="token:2")


def test_expired_lease_not_yet_taken_over_is_still_held(store, key, gpu_env, clock):
    store.enqueue(key, ANY)
    claim = store.claim(gpu_env, "w1", lease_seconds=10)
    clock.advance(11)
    assert store.heartbeat(claim.job.id, "w1", claim.lease_token, lease_seconds=10).status == "running"


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_a_dead_workers_lease_is_reclaimed_when_the_clock_is_stepped(store, key, gpu_env, clock, step):
    """Before: a server clock stepped back 1 h (SQLite's clock is the server host's) stranded a dead worker's lease
    for that hour. After: a lease granted or extended more than a lease length in the future counts as expired; a
    step forward expires it as before. A live lease within its length is not taken."""
    store.enqueue(key, ANY)
    first = store.claim(gpu_env, "w1", lease_seconds=120)
    assert store.claim(gpu_env, "w2", lease_seconds=120) is None  # held, within its lease
    clock.advance(step)
    second = store.claim(gpu_env, "w2", lease_seconds=120)
    assert second is not None and second.job.id == first.job.id and second.job.attempts == 2
    assert store.claim(gpu_env, "w3", lease_seconds=120) is None  # the new lease is held again


def test_a_shorter_lease_setting_takes_no_live_lease(store, key, gpu_env, clock):
    """Before: with PLANCACHE_LEASE_SECONDS lowered from 600 to 60, the stepped-back-clock rule (a lease ending more
    than two lease lengths ahead) took every live 600 s lease at the next claim. After: a lease's own grant time
    decides; a live one stays its holder's until it runs out."""
    store.enqueue(key, ANY)
    first = store.claim(gpu_env, "w1", lease_seconds=600)
    clock.advance(5)
    assert store.claim(gpu_env, "w2", lease_seconds=60) is None
    clock.advance(590)
    assert store.heartbeat(first.job.id, "w1", first.lease_token, lease_seconds=60).lease_owner == "w1"
    clock.advance(61)
    assert store.claim(gpu_env, "w2", lease_seconds=60).job.id == first.job.id


def test_a_claim_sent_again_with_its_proposed_token_gets_the_same_job(store, make_spec, gpu_env):
    """Before: a claim whose answer was lost and was sent again leased a second job, the first held by nobody until
    its lease ran out (an attempt spent). After: the same proposed lease token gets the job it leased then."""
    for i in range(2):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        store.enqueue(k, ANY)
    token = "t" * 43
    first = store.claim(gpu_env, "w1", lease_seconds=10, holder="token:1", lease_token=token)
    again = store.claim(gpu_env, "w1", lease_seconds=10, holder="token:1", lease_token=token)
    assert first.lease_token == again.lease_token == token and again.job.id == first.job.id
    assert again.job.attempts == 1 and store.job_counts()["queued"] == 1
    assert store.heartbeat(first.job.id, "w1", token, lease_seconds=10, holder="token:1").status == "running"
    with pytest.raises(errors.Conflict, match="in use"):  # the same token from another API token or worker
        store.claim(gpu_env, "w2", lease_seconds=10, holder="token:1", lease_token=token)
    with pytest.raises(errors.InvalidValue, match="at least 32"):
        store.claim(gpu_env, "w1", lease_seconds=10, lease_token="short")
    other = store.claim(gpu_env, "w1", lease_seconds=10, holder="token:1", lease_token="u" * 43)
    assert other.job.id != first.job.id


def test_the_last_holder_completes_a_job_failed_for_its_expired_lease(store, key, gpu_env, clock, make_plan):
    """Before: a worker that lost the server for longer than its lease on the job's last attempt found the job
    failed ('lease expired after 1 attempts') and its spooled result was dropped. After: that lease's holder still
    completes it (blob upload and record); heartbeats and failures from it stay refused, as does anyone else."""
    job, _ = store.enqueue(key, ANY, max_attempts=1)
    claim = store.claim(gpu_env, "w1", lease_seconds=10, holder="token:1")
    clock.advance(11)
    assert store.claim(gpu_env, "w2", lease_seconds=10) is None
    assert store.get_job(job.id).error == "lease expired after 1 attempts"
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(job.id, "w1", claim.lease_token, lease_seconds=10, holder="token:1")
    with pytest.raises(errors.LeaseLost):
        store.check_held(job.id, "w1", claim.lease_token, holder="token:1")
    with pytest.raises(errors.LeaseLost):
        store.check_held(job.id, "w1", "x" * 43, holder="token:1", completing=True)
    with pytest.raises(errors.NotLeaseHolder):
        store.check_held(job.id, "w1", claim.lease_token, holder="token:2", completing=True)
    store.check_held(job.id, "w1", claim.lease_token, holder="token:1", completing=True)
    meta, blob = make_plan(key, gpu_env, worker_id="w1")
    record = store.publish_plan(meta, blob, job_id=job.id, worker_id="w1", lease_token=claim.lease_token,
                                holder="token:1")
    done = store.get_job(job.id)
    assert record.job_id == job.id and done.status == "succeeded" and done.error is None


def test_an_admin_cancels_a_queued_or_running_job(store, make_spec, gpu_env):
    jobs = []
    for i in range(2):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        jobs.append(store.enqueue(k, ANY)[0])
    claim = store.claim(gpu_env, "w1", lease_seconds=10)
    running = store.cancel_job(claim.job.id, by="ops", reason="no such GPU any more")
    assert running.status == "failed" and running.error == "cancelled by ops: no such GPU any more"
    assert running.finished_at is not None
    with pytest.raises(errors.LeaseLost):  # the worker tuning it is refused its next heartbeat
        store.heartbeat(claim.job.id, "w1", claim.lease_token, lease_seconds=10)
    queued = next(j for j in jobs if j.id != claim.job.id)
    assert store.cancel_job(queued.id, by="ops").error == "cancelled by ops"
    assert store.claim(gpu_env, "w1", lease_seconds=10) is None
    with pytest.raises(errors.Conflict, match="ended already"):
        store.cancel_job(queued.id, by="ops")
    with pytest.raises(errors.NotFound):
        store.cancel_job(10**6, by="ops")


def test_a_withdrawal_sets_the_revision_floor_of_its_environment(store, key, gpu_env, make_plan, tmp_path):
    assert store.revision_floor(key, gpu_env) == 0
    meta, blob = make_plan(key, gpu_env)
    record = store.publish_plan(meta, blob)
    signer = Signer.from_file(keygen(tmp_path, "admin")[0])
    w = signer.sign_withdrawal(Withdrawal(graph_key=key, environment=gpu_env, blob_sha256=record.blob_sha256,
                                          withdrawn_revision=record.revision, reason="wrong results"))
    store.withdraw_plan(w)
    assert store.revision_floor(key, gpu_env) == w.revision > record.revision
    assert store.revision_floor(key, OTHER_GPU) == 0


def test_stopped_worker_loses_its_job_and_only_the_new_holder_completes(store, key, gpu_env, clock, make_plan):
    store.enqueue(key, ANY)
    first = store.claim(gpu_env, "w1", lease_seconds=10)
    job_id = first.job.id
    store.heartbeat(job_id, "w1", first.lease_token, lease_seconds=10)
    clock.advance(11)  # w1 stops heartbeating
    second = store.claim(gpu_env, "w2", lease_seconds=10)
    assert second.job.id == job_id and second.lease_token != first.lease_token and second.job.attempts == 2

    stale_meta, stale_blob = make_plan(key, gpu_env, blob=b"from w1", worker_id="w1")
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(job_id, "w1", first.lease_token, lease_seconds=10)
    with pytest.raises(errors.LeaseLost):
        store.publish_plan(stale_meta, stale_blob, job_id=job_id, worker_id="w1", lease_token=first.lease_token)
    with pytest.raises(errors.LeaseLost):
        store.fail(job_id, "w1", first.lease_token, "late failure")
    assert store.get_blob(stale_meta.blob_sha256) is None and store.get_plan(key, gpu_env) is None

    meta, blob = make_plan(key, gpu_env, blob=b"from w2", worker_id="w2")
    record = store.publish_plan(meta, blob, job_id=job_id, worker_id="w2", lease_token=second.lease_token)
    assert record.worker_id == "w2" and record.job_id == job_id
    done = store.get_job(job_id)
    assert done.status == "succeeded" and done.finished_at == clock.now and done.lease_expires_at is None
    with pytest.raises(errors.LeaseLost):
        store.publish_plan(stale_meta, stale_blob, job_id=job_id, worker_id="w1", lease_token=first.lease_token)
    assert store.get_plan(key, gpu_env).blob_sha256 == meta.blob_sha256
    assert store.list_plans() == [record]


def test_same_worker_reclaiming_gets_a_new_token_and_the_old_one_is_fenced(store, key, gpu_env, clock):
    store.enqueue(key, ANY)
    old = store.claim(gpu_env, "w1", lease_seconds=10)
    clock.advance(11)
    new = store.claim(gpu_env, "w1", lease_seconds=10)
    assert new.lease_token != old.lease_token
    with pytest.raises(errors.LeaseLost):
        store.heartbeat(old.job.id, "w1", old.lease_token, lease_seconds=10)
    assert store.heartbeat(new.job.id, "w1", new.lease_token, lease_seconds=10).attempts == 2


def test_failures_retry_until_max_attempts_then_fail_with_the_error(store, key, gpu_env):
    job, _ = store.enqueue(key, ANY, max_attempts=3)
    for attempt in (1, 2):
        claimed = store.claim(gpu_env, "w1", lease_seconds=10, holder="token:1")
        assert claimed.job.attempts == attempt
        back = store.fail(job.id, "w1", claimed.lease_token, f"error {attempt}", holder="token:1")
        assert back.status == "queued" and back.error == f"error {attempt}" and back.lease_owner is None
        assert back.lease_holder is None
    claimed = store.claim(gpu_env, "w1", lease_seconds=10)
    final = store.fail(job.id, "w1", claimed.lease_token, "error 3")
    assert final.status == "failed" and final.error == "error 3" and final.attempts == 3 and final.finished_at
    assert store.claim(gpu_env, "w1", lease_seconds=10) is None
    assert store.get_job(job.id) == final


def test_non_retryable_failure_ends_the_job_at_once(store, key, gpu_env):
    job, _ = store.enqueue(key, ANY, max_attempts=5)
    claimed = store.claim(gpu_env, "w1", lease_seconds=10)
    failed = store.fail(job.id, "w1", claimed.lease_token, "spec cannot be lowered", retryable=False)
    assert failed.status == "failed" and failed.attempts == 1 and failed.error == "spec cannot be lowered"


def test_lease_expiry_on_the_last_attempt_fails_the_job(store, key, gpu_env, clock):
    job, _ = store.enqueue(key, ANY, max_attempts=2)
    for _ in range(2):
        assert store.claim(gpu_env, "w1", lease_seconds=10).job.id == job.id
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
        while (claim := store.claim(gpu_env, worker, lease_seconds=300)) is not None:
            with lock:
                claims.append((worker, claim.job.id))

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
            store.heartbeat(job_id, "w", "token", lease_seconds=10)


def test_concurrent_identical_enqueues_make_one_job(store, key):
    start = threading.Barrier(8)

    def enqueue():
        start.wait()
        return store.enqueue(key, TargetEnvironment(sm=90))

    with ThreadPoolExecutor(8) as pool:
        results = [f.result(timeout=60) for f in [pool.submit(enqueue) for _ in range(8)]]
    assert len({job.id for job, _ in results}) == 1 and sum(created for _, created in results) == 1
    assert store.job_counts()["queued"] == 1


# ------------------------------------------------------------------ lease times are the database's


class _ReplicaDatetime(datetime):
    """``datetime`` for a replica whose process clock is ``skew`` off: patched into :mod:`plancache.store.db`,
    where the store reads the process clock (``utcnow``)."""

    skew = timedelta(0)

    @classmethod
    def now(cls, tz=None):  # type: ignore[override]
        return datetime.now(tz) + cls.skew


@pytest.fixture
def replica_clock(monkeypatch):
    """Set ``replica_clock.skew``: the store calls that follow run as on a replica whose clock is that far off."""
    import plancache.store.db as db

    monkeypatch.setattr(db, "datetime", _ReplicaDatetime)
    yield _ReplicaDatetime
    _ReplicaDatetime.skew = timedelta(0)


def _close_to(value: datetime, expected: datetime) -> bool:
    return abs(value - expected) < timedelta(seconds=5)


def test_a_replica_whose_clock_runs_ahead_does_not_steal_live_leases(db_url, make_spec, gpu_env, replica_clock):
    """Two store instances (replicas) on one database, B's clock 20 s ahead: a 10 s lease that A granted a moment
    ago is not expired for B (before: B took the job over at once), and B extends it from the database's time."""
    from plancache.store import open_store

    with open_store(db_url, create=True) as a, open_store(db_url) as b:
        k, spec = make_spec(0)
        a.put_spec(k, spec)
        a.enqueue(k, ANY)
        held = a.claim(gpu_env, "w-a", lease_seconds=10)
        replica_clock.skew = timedelta(seconds=20)
        assert b.claim(gpu_env, "w-b", lease_seconds=10) is None
        job = b.heartbeat(held.job.id, "w-a", held.lease_token, lease_seconds=10)
        assert job.attempts == 1 and _close_to(job.lease_expires_at, datetime.now(UTC) + timedelta(seconds=10))


def test_a_replica_whose_clock_runs_behind_reclaims_expired_leases_on_time(db_url, make_spec, gpu_env, replica_clock):
    """A replica restarted with its clock 1 h behind takes over a dead worker's expired lease at once (before:
    not for an hour), and the new lease ends 10 s after the database's now, not an hour early."""
    from plancache.store import open_store

    with open_store(db_url, create=True) as a, open_store(db_url) as c:
        k, spec = make_spec(0)
        a.put_spec(k, spec)
        a.enqueue(k, ANY)
        dead = a.claim(gpu_env, "w-dead", lease_seconds=0.5)
        time.sleep(0.8)
        replica_clock.skew = timedelta(hours=-1)
        taken = c.claim(gpu_env, "w-c", lease_seconds=10)
        assert taken is not None and taken.job.id == dead.job.id and taken.job.attempts == 2
        assert _close_to(taken.job.lease_expires_at, datetime.now(UTC) + timedelta(seconds=10))
        assert _close_to(taken.job.updated_at, datetime.now(UTC))


def test_an_injected_clock_still_drives_every_lease(store, key, gpu_env, clock, replica_clock):
    """Tests inject a clock (FakeClock): then it, not the database, is the time (and a skewed process clock
    changes nothing)."""
    replica_clock.skew = timedelta(hours=5)
    store.enqueue(key, ANY)
    claim = store.claim(gpu_env, "w1", lease_seconds=30)
    assert claim.job.lease_expires_at == clock.now + timedelta(seconds=30)
    clock.advance(31)
    assert store.claim(gpu_env, "w2", lease_seconds=30).job.attempts == 2
