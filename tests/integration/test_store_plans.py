"""Plan records, resolve and misses, on SQLite and Postgres."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from plancache import errors
from plancache.protocol import TargetEnvironment
from plancache.store import open_store
from plancache.store.models import blobs, plans
from tests.factories import stored_plans

pytestmark = pytest.mark.both_blob_stores

@pytest.fixture
def key(store, make_spec):
    k, spec = make_spec(0)
    store.put_spec(k, spec)
    return k


def _rows(store, table) -> int:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()


def test_publish_stores_blob_and_full_record(store, key, gpu_env, make_plan, clock):
    meta, blob = make_plan(key, gpu_env)
    record = store.publish_plan(meta, blob)
    assert record.model_dump(exclude={"env_id", "job_id", "created_at"}) == meta.model_dump()
    assert record.env_id == gpu_env.env_id and record.job_id is None and record.created_at == clock.now
    assert record.environment == gpu_env  # info fields kept too
    assert store.get_blob(meta.blob_sha256) == blob
    assert store.get_plan(key, gpu_env) == record


def test_native_timings_are_stored_read_by_every_lookup_and_null_when_none(store, make_spec, gpu_env, make_plan):
    """A record's native kernel timings read back from each lookup (get, resolve's records, list); a record without
    any stores SQL NULL (as a row code of 0010 writes), which reads as none; a replacement changes them."""
    keys = []
    for i in range(2):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        keys.append(k)
    meta, blob = make_plan(keys[0], gpu_env, native_median_ms={"flash": 0.354, "cudnn_aten": 0.261})
    timed = store.publish_plan(meta, blob)
    untimed = store.publish_plan(*make_plan(keys[1], gpu_env, blob=b"another plan"))
    assert timed.native_median_ms == {"flash": 0.354, "cudnn_aten": 0.261} and untimed.native_median_ms == {}
    assert [store.get_plan(k, gpu_env) for k in keys] == [timed, untimed]
    assert stored_plans(store, gpu_env, keys, include_blobs=False)[0] == {keys[0]: (timed, None), keys[1]: (untimed, None)}
    assert sorted(store.list_plans(), key=lambda r: r.graph_key) == sorted([timed, untimed], key=lambda r: r.graph_key)
    with store.engine.connect() as conn:
        nulls = conn.execute(sa.select(plans.c.graph_key).where(plans.c.native_median_ms.is_(None))).scalars().all()
    assert nulls == [keys[1]]
    resigned = meta.model_copy(update={"revision": meta.revision + 1, "native_median_ms": {"flash": 0.3}})
    assert store.publish_plan(resigned, blob, replace=True).native_median_ms == {"flash": 0.3}
    assert store.get_plan(keys[0], gpu_env).native_median_ms == {"flash": 0.3}


def test_get_plan_matches_validity_fields_exactly(store, key, gpu_env, make_plan):
    store.publish_plan(*make_plan(key, gpu_env))
    same_validity = gpu_env.model_copy(update={"device_name": "other name", "torch_version": "9"})
    assert store.get_plan(key, same_validity) is not None
    for change in ({"sm": 100}, {"sm_count": 114}, {"cudnn_version": 91800}, {"driver_version": 12080},
                   {"frontend_version": "1.31.0"}):
        assert store.get_plan(key, gpu_env.model_copy(update=change)) is None, change


def test_publish_is_idempotent_and_never_silently_overwrites(store, key, gpu_env, make_plan):
    meta, blob = make_plan(key, gpu_env)
    first = store.publish_plan(meta, blob)
    again_meta, _ = make_plan(key, gpu_env, worker_id="w2", engine_id=99)
    assert store.publish_plan(again_meta, blob) == first  # same blob: stored record returned unchanged
    other_meta, other_blob = make_plan(key, gpu_env, blob=b"another plan")
    with pytest.raises(errors.Conflict, match="replace"):
        store.publish_plan(other_meta, other_blob)
    assert store.get_plan(key, gpu_env) == first
    replaced = store.publish_plan(other_meta, other_blob, replace=True)
    assert replaced.blob_sha256 == other_meta.blob_sha256 and store.get_plan(key, gpu_env) == replaced
    assert _rows(store, plans) == 1


def test_a_replacement_needs_a_higher_revision(store, key, gpu_env, make_plan):
    """An older record (a replay) cannot replace a newer one, even with ``replace``; the same record again is
    idempotent; the same blob signed again with a higher revision replaces its record."""
    new_meta, new_blob = make_plan(key, gpu_env, blob=b"the newer plan", revision=200)
    stored = store.publish_plan(new_meta, new_blob)
    old_meta, old_blob = make_plan(key, gpu_env, blob=b"the older plan", revision=100)
    for meta, blob in ((old_meta, old_blob), (old_meta.model_copy(update={"revision": 200}), old_blob),
                       (new_meta.model_copy(update={"revision": 199, "worker_id": "w2"}), new_blob)):
        with pytest.raises(errors.StaleRevision, match=rf"has revision 200; a replacement needs a higher revision "
                                                       rf"than that, this one has {meta.revision}") as err:
            store.publish_plan(meta, blob, replace=True)
        assert (err.value.code, err.value.http_status) == ("stale_revision", 409)
    assert store.publish_plan(new_meta, new_blob, replace=True) == stored  # a repeat: unchanged
    assert store.publish_plan(new_meta.model_copy(update={"revision": 1}), new_blob) == stored  # no replace: stands
    resigned = store.publish_plan(new_meta.model_copy(update={"revision": 201, "worker_id": "w2"}), new_blob,
                                  replace=True)
    assert (resigned.revision, resigned.worker_id) == (201, "w2") and store.get_plan(key, gpu_env) == resigned
    assert _rows(store, plans) == 1


def test_publish_checks_digest_size_and_spec(store, key, gpu_env, make_plan, make_spec):
    meta, blob = make_plan(key, gpu_env)
    with pytest.raises(errors.IntegrityError, match="sha256"):
        store.publish_plan(meta, blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(errors.IntegrityError, match="bytes"):
        store.publish_plan(meta.model_copy(update={"blob_size": len(blob) + 1}), blob)
    unknown, _ = make_spec(1)
    with pytest.raises(errors.NotFound, match="spec"):
        store.publish_plan(*make_plan(unknown, gpu_env))
    assert _rows(store, blobs) == 0 and _rows(store, plans) == 0


def test_publish_with_a_job_checks_key_and_target(store, key, gpu_env, make_plan, make_spec):
    other, spec = make_spec(1)
    store.put_spec(other, spec)
    job, _ = store.enqueue(key, TargetEnvironment(sm=90))
    lease = store.claim(gpu_env, "w1", lease_seconds=60)
    with pytest.raises(errors.Conflict, match="graph key"):
        store.publish_plan(*make_plan(other, gpu_env), job_id=job.id, worker_id="w1", lease_token=lease.lease_token)
    with pytest.raises(errors.LeaseLost):
        store.publish_plan(*make_plan(key, gpu_env), job_id=job.id)
    assert store.get_job(job.id).status == "running" and _rows(store, plans) == 0
    record = store.publish_plan(*make_plan(key, gpu_env), job_id=job.id, worker_id="w1", lease_token=lease.lease_token)
    assert record.job_id == job.id and store.get_job(job.id).status == "succeeded"


def _nothing_published(store, sha256):
    """No record. The bytes of a folder or bucket are written before the publish's transaction: a failure leaves
    them, with a catalog row that no record references (``plans gc`` collects it after its grace period)."""
    assert _rows(store, plans) == 0
    if store.blob_store.url == "database":
        assert _rows(store, blobs) == 0 and store.get_blob(sha256) is None


def test_a_failure_inside_publish_leaves_nothing_half_written(store, key, gpu_env, make_plan, monkeypatch, clock):
    from datetime import timedelta

    from plancache.store import plans as plans_module
    from plancache.store.retention import gc

    job, _ = store.enqueue(key, TargetEnvironment())
    lease = store.claim(gpu_env, "w1", lease_seconds=60)
    real = plans_module.upsert_insert

    def crash_on_record(conn, table):
        if table is plans:  # the job update and the blob insert already ran in this transaction
            raise RuntimeError("crash before the record insert")
        return real(conn, table)

    monkeypatch.setattr(plans_module, "upsert_insert", crash_on_record)
    meta, blob = make_plan(key, gpu_env)
    with pytest.raises(RuntimeError):
        store.publish_plan(meta, blob, job_id=job.id, worker_id="w1", lease_token=lease.lease_token)
    _nothing_published(store, meta.blob_sha256)
    assert store.get_job(job.id) == lease.job
    clock.advance(2 * 3600)
    gc(store, grace=timedelta(hours=1))
    assert _rows(store, blobs) == 0 and store.get_blob(meta.blob_sha256) is None


CRASHING_PUBLISHER = textwrap.dedent("""
    import os, sys
    from plancache.store import open_store, plans as plans_module
    from plancache.store.models import plans
    from plancache.protocol import PlanMeta
    real = plans_module.upsert_insert
    def die(conn, table):
        if table is plans:
            os._exit(17)  # the process dies mid-transaction, after the job update and blob insert
        return real(conn, table)
    plans_module.upsert_insert = die
    store = open_store(sys.argv[1])
    meta = PlanMeta.model_validate_json(sys.argv[2])
    store.publish_plan(meta, sys.argv[3].encode(), job_id=int(sys.argv[4]), worker_id="w1", lease_token=sys.argv[5])
""")


def test_a_process_killed_inside_publish_leaves_nothing_half_written(db_url, blob_store_url, key, store, gpu_env,
                                                                      make_plan):
    job, _ = store.enqueue(key, TargetEnvironment())
    lease = store.claim(gpu_env, "w1", lease_seconds=3600)
    meta, blob = make_plan(key, gpu_env, blob=b"plan-from-a-dying-worker")
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_PUBLISHER, db_url, meta.model_dump_json(), blob.decode(), str(job.id),
         lease.lease_token],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PLANCACHE_BLOB_STORE": blob_store_url},
    )
    assert proc.returncode == 17, proc.stderr
    with open_store(db_url, blob_store=blob_store_url) as fresh:
        _nothing_published(fresh, meta.blob_sha256)
        assert fresh.get_job(job.id).status == "running"
        record = fresh.publish_plan(meta, blob, job_id=job.id, worker_id="w1", lease_token=lease.lease_token)
        assert record.job_id == job.id


def test_concurrent_identical_publishes_make_one_record(store, key, gpu_env, make_plan):
    meta, blob = make_plan(key, gpu_env)
    start = threading.Barrier(16)

    def publish():
        start.wait()
        return store.publish_plan(meta, blob)

    with ThreadPoolExecutor(16) as pool:
        records = [f.result(timeout=60) for f in [pool.submit(publish) for _ in range(16)]]
    assert all(r == records[0] for r in records)
    assert _rows(store, plans) == 1 and _rows(store, blobs) == 1


def test_records_and_blobs_are_read_for_the_stored_keys_and_misses_are_counted(store, make_spec, gpu_env, make_plan,
                                                                               clock):
    """What the resolve route reads (plan_records, get_blobs) and what it records for the other keys (record_misses)."""
    keys = []
    for i in range(3):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        keys.append(k)
    store.publish_plan(*make_plan(keys[0], gpu_env, blob=b"plan 0"))
    store.publish_plan(*make_plan(keys[1], gpu_env, blob=b"plan 1"))
    unknown = "e" * 64

    def resolve(env, asked, include_blobs):
        found, missing = stored_plans(store, env, asked, include_blobs=include_blobs)
        store.record_misses(env, missing)
        return found, missing

    found, missing = resolve(gpu_env, [keys[2], keys[0], unknown, keys[0], keys[1], keys[2]], include_blobs=True)
    assert set(found) == {keys[0], keys[1]} and missing == [keys[2], unknown]
    assert found[keys[0]][1] == b"plan 0" and found[keys[1]][0].blob_sha256 == store.get_plan(keys[1], gpu_env).blob_sha256
    assert store.plan_versions(gpu_env, keys)[keys[0]].blob_sha256 == found[keys[0]][0].blob_sha256
    found, missing = resolve(gpu_env, keys, include_blobs=False)
    assert found[keys[0]][1] is None and missing == [keys[2]]
    assert resolve(gpu_env, [], include_blobs=True) == ({}, [])
    first_seen = clock.now
    clock.advance(5)
    resolve(gpu_env, [keys[2]], include_blobs=False)
    by_key = {m.graph_key: m for m in store.list_misses()}
    assert by_key[keys[2]].count == 3 and by_key[unknown].count == 1
    assert by_key[keys[2]].first_seen == first_seen and by_key[keys[2]].last_seen == clock.now
    assert by_key[keys[2]].environment == gpu_env and by_key[keys[2]].env_id == gpu_env.env_id
    other_env = gpu_env.model_copy(update={"sm": 100})
    found, missing = resolve(other_env, keys, include_blobs=True)
    assert found == {} and missing == keys


def test_misses_ordering_and_top_misses(store, make_spec, gpu_env, make_plan):
    keys = []
    for i in range(3):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        keys.append(k)
    no_spec = "d" * 64
    for _ in range(3):
        store.record_misses(gpu_env, [keys[1], no_spec])
    store.record_misses(gpu_env, [keys[0], keys[0]])  # duplicates in one call count once
    store.record_misses(gpu_env, [keys[1]])
    other_env = gpu_env.model_copy(update={"cudnn_version": 90100})
    store.record_misses(other_env, [keys[2]] * 10)
    assert [(m.graph_key, m.count) for m in store.list_misses(env_id=gpu_env.env_id)] == [
        (keys[1], 4), (no_spec, 3), (keys[0], 1)]
    assert [m.graph_key for m in store.list_misses(limit=1)] == [keys[1]]
    assert store.top_misses(gpu_env, 10) == [keys[1], no_spec, keys[0]]
    assert store.top_misses(gpu_env, 10, require_spec=True) == [keys[1], keys[0]]
    store.publish_plan(*make_plan(keys[1], gpu_env))
    assert store.top_misses(gpu_env, 2) == [no_spec, keys[0]]
    assert store.top_misses(other_env, 5) == [keys[2]]


def test_record_misses_handles_many_keys(store, gpu_env):
    keys = [f"{i:064x}" for i in range(1200)]
    store.record_misses(gpu_env, keys)
    store.record_misses(gpu_env, keys[:10])
    misses = store.list_misses(limit=2000)
    assert len(misses) == 1200 and sum(m.count for m in misses) == 1210


def test_list_plans_filters_and_pages(store, make_spec, gpu_env, make_plan, clock):
    other_env = gpu_env.model_copy(update={"sm_count": 114})
    published = []
    for i in range(3):
        k, spec = make_spec(i)
        store.put_spec(k, spec)
        clock.advance(1)
        published.append(store.publish_plan(*make_plan(k, gpu_env if i < 2 else other_env, blob=f"p{i}".encode())))
    assert store.list_plans() == published[::-1]
    assert store.list_plans(env_id=gpu_env.env_id) == published[1::-1]
    assert store.list_plans(graph_key=published[0].graph_key) == [published[0]]
    assert store.list_plans(limit=1, offset=1) == [published[1]]
    with pytest.raises(ValueError):
        store.list_plans(limit=-1)


def test_non_finite_candidate_figures_are_stored_as_null(store, key, gpu_env, make_plan):
    from plancache.protocol import Candidate, CandidateTable

    bad = Candidate(index=0, engine_id=1, status="mismatch", max_abs_err=float("nan"), median_ms=float("inf"))
    store.publish_plan(*make_plan(key, gpu_env), candidates=CandidateTable(candidates=[bad]))
    stored = store.get_candidates(key, gpu_env)
    assert stored.candidates[0].max_abs_err is None and stored.candidates[0].median_ms is None


def test_out_of_range_plan_fields_are_refused_clearly(store, key, gpu_env, make_plan):
    from plancache.errors import InvalidValue

    with pytest.raises(ValidationError):  # the wire model refuses it first ...
        make_plan(key, gpu_env, engine_id=2**64)
    meta, blob = make_plan(key, gpu_env)
    with pytest.raises(InvalidValue, match="engine_id"):  # ... and the store when a caller skips validation
        store.publish_plan(meta.model_copy(update={"engine_id": 2**64}), blob)
    with pytest.raises(InvalidValue, match="cudnn_version"):
        store.plan_versions(gpu_env.model_copy(update={"cudnn_version": 2**40}), [key])
    assert _rows(store, plans) == 0 and store.list_misses() == []


def test_concurrent_misses_are_all_counted(store, make_spec, gpu_env):
    keys = [make_spec(i)[0] for i in range(20)]
    start = threading.Barrier(8)

    def resolve(offset: int) -> None:
        start.wait()
        for _ in range(10):  # overlapping key sets in different orders: no deadlock, no lost update
            store.record_misses(gpu_env, keys[offset:] + keys[:offset])

    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(resolve, i) for i in range(8)]:
            f.result(timeout=120)
    assert {m.graph_key: m.count for m in store.list_misses(limit=100)} == {k: 80 for k in keys}


def test_a_graph_s_siblings_are_its_other_shapes_plans_on_that_environment_newest_first(store, gpu_env, make_plan,
                                                                                       clock):
    """``plan_siblings``: the specs of the plans of the asked graph's other shapes (its other batch sizes and sequence
    lengths) on exactly that environment, newest first, ``limit`` per graph, the asked keys left out; another
    graph, another environment and a record without a sibling key (written by a release before 0013) are not."""
    from examples.generate import sdpa_causal
    from plancache.spec import parse_spec
    from tests.factories import OTHER_GPU

    shapes = [sdpa_causal(batch=b, heads=16, seq=s, d=128) for b, s in ((2, 512), (2, 1024), (4, 512), (1, 4096))]
    other = sdpa_causal(batch=2, heads=8, seq=512, d=128)
    for spec in [*shapes, other]:
        store.put_spec(spec.graph_key, spec.to_json())
        store.publish_plan(*make_plan(spec.graph_key, gpu_env))
        clock.advance(1)
    store.publish_plan(*make_plan(shapes[1].graph_key, OTHER_GPU))
    with store.engine.begin() as conn:  # as a release before 0013 wrote it
        conn.execute(sa.update(plans).where(plans.c.graph_key == shapes[2].graph_key).values(sibling_key=None))
    asked = shapes[0].graph_key
    found = store.plan_siblings(gpu_env, [asked], 16)
    assert list(found) == [shapes[3].graph_key, shapes[1].graph_key]
    assert all(parse_spec(text).graph_key == key for key, text in found.items())
    assert list(store.plan_siblings(gpu_env, [asked], 1)) == [shapes[3].graph_key]
    assert store.plan_siblings(gpu_env, [asked], 0) == {}
    assert list(store.plan_siblings(OTHER_GPU, [asked], 16)) == [shapes[1].graph_key]
    assert list(store.plan_siblings(gpu_env, [asked, shapes[3].graph_key], 16)) == [shapes[1].graph_key]
    assert store.plan_siblings(gpu_env, [other.graph_key], 16) == {}  # no other shape of it has a plan here
    assert store.plan_siblings(gpu_env, ["ab" * 32], 16) == {}  # no spec stored
    with pytest.raises(errors.InvalidValue, match="limit"):
        store.plan_siblings(gpu_env, [asked], -1)
