"""The candidates table of a tuning run over HTTP and in the store, on SQLite and Postgres: capped, stored apart from
its plan record, read by an admin, never in a resolve answer, a record or a client's cache.

The incident: a worker completed its own job with a valid 6,000-candidate record (52 MiB). Before: the server
accepted it and every resolve of the key answered 51 MiB, records only, and every client's disk cache took a 51 MiB
entry. After: that upload is refused (413 from its declared length, over a plan upload's body limit; a table of
valid rows that fits the body limit but not the table's bound is 422) and nothing is stored; the best 512 of the
same run (``best_of``) are stored apart, and the resolve answer is about 1 KiB.
"""

from __future__ import annotations

import json

import sqlalchemy as sa

from plancache.client.cache import DiskCache
from plancache.protocol import MAX_CANDIDATES, Candidate, CandidateTable, PlanRecord, ResolveResponse
from plancache.store.models import plan_candidates
from tests.factories import make_candidates
from tests.server_util import api, env_query, put_blob, upload_json  # noqa: F401


def _incident_rows(n: int = 6000) -> list[Candidate]:
    """``n`` valid candidates as large as a candidate may be (64 knobs, a 512-character name, a 4,000-character
    error): about 9 KiB each."""
    knobs = {f"KNOB_{j:02d}".ljust(64, "X"): -(2**62) for j in range(64)}
    return [Candidate(index=i, engine_id=i, knobs=knobs, name="n" * 512, status="ok" if i % 2 else "run_failed",
                      median_ms=0.05 + i / 1000 if i % 2 else None, error=None if i % 2 else "e" * 4000)
            for i in range(n)]


def _publish(api, make_spec, make_plan, gpu_env, **upload):
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env)
    put_blob(api.client, blob, api.admin)
    return key, blob, api.client.put("/v1/plans", json=upload_json(meta, spec, **upload), headers=api.admin)


def test_the_6000_candidate_upload_is_refused_and_nothing_stored(api, make_spec, make_plan, gpu_env):
    rows = [c.model_dump(mode="json") for c in _incident_rows()]
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env)
    put_blob(api.client, blob, api.admin)
    r = api.client.put("/v1/plans", json=upload_json(meta, spec, candidates=rows), headers=api.admin)
    assert len(r.request.content) > 45 << 20  # 47 MiB, as the incident's 52 MiB
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text[:300]
    assert "candidates table" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env) is None
    small = [{**c.model_dump(mode="json"), "knobs": {}, "name": "", "error": None if c.error is None else "e"}
             for c in _incident_rows(600)]  # 600 rows of 100 bytes or so
    r = api.client.put("/v1/plans", json=upload_json(meta, spec, candidates=small), headers=api.admin)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text[:300]
    assert "600 candidates; a plan carries at most 512" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env) is None

    # the same through the completion of a job the worker holds
    job = api.client.post("/v1/admin/tune", json={"specs": [spec], "targets": [{"sm": gpu_env.sm}]},
                          headers=api.admin).json()["jobs"][0]
    claim = api.client.post("/v1/jobs/claim", json={"environment": gpu_env.model_dump(), "worker_id": "w1"},
                            headers=api.worker).json()
    meta, blob = make_plan(key, gpu_env, worker_id="w1")
    put_blob(api.client, blob, api.worker, job=(job["id"], "w1", claim["lease_token"]))
    body = {"worker_id": "w1", "lease_token": claim["lease_token"], "plan": upload_json(meta, candidates=rows)}
    r = api.client.post(f"/v1/jobs/{job['id']}/complete", json=body, headers=api.worker)
    assert r.status_code == 413 and "candidates table" in r.json()["error"]["message"]
    body["plan"] = upload_json(meta, candidates=small)
    r = api.client.post(f"/v1/jobs/{job['id']}/complete", json=body, headers=api.worker)
    assert r.status_code == 422 and "at most 512" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env) is None and api.store.get_job(job["id"]).status == "running"


def test_a_full_table_fits_a_plan_upload_beside_its_record_and_spec(api, make_spec, make_plan, gpu_env):
    """best_of fills a table up to MAX_CANDIDATES_BYTES (1 MiB): with its record and spec the body is over
    PLANCACHE_MAX_JSON_BYTES (1 MiB), and a plan upload's limit leaves room for it."""
    failed = [Candidate(index=i, engine_id=i, knobs={"SPLIT_K": 4}, name=f"engine{i}", status="run_failed",
                        error="e" * 2000) for i in range(6000)]
    table = CandidateTable.best_of(failed)
    key, _, r = _publish(api, make_spec, make_plan, gpu_env, **table.model_dump(mode="json"))
    assert len(r.request.content) > api.app.state.settings.max_json_bytes
    assert r.status_code == 201, r.text[:300]
    assert len(api.store.get_candidates(key, gpu_env).candidates) == len(table.candidates) > 400


def test_a_table_over_the_byte_cap_is_refused(api, make_spec, make_plan, gpu_env):
    rows = [c.model_dump(mode="json") for c in _incident_rows(200)]  # 200 rows, 1.2 MiB
    key, _, r = _publish(api, make_spec, make_plan, gpu_env, candidates=rows)
    assert r.status_code == 422 and "bytes of JSON; at most 1048576" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env) is None


def test_the_capped_run_is_stored_apart_and_every_answer_stays_small(api, make_spec, make_plan, gpu_env, tmp_path):
    table = CandidateTable.best_of(_incident_rows())
    assert len(table.candidates) < MAX_CANDIDATES and sum(table.candidates_omitted.values()) + len(table.candidates) == 6000
    key, blob, r = _publish(api, make_spec, make_plan, gpu_env, **table.model_dump(mode="json"))
    assert r.status_code == 201, r.text[:300]
    assert "candidates" not in r.json()

    r = api.client.post("/v1/plans/resolve", json={"environment": gpu_env.model_dump(), "graph_keys": [key]},
                        headers=api.reader)
    assert r.status_code == 200 and len(r.content) < 2048, len(r.content)  # before: 51 MiB
    record = ResolveResponse.model_validate_json(r.content).plans[key].record
    assert "candidates" not in r.json()["plans"][key]["record"]
    r = api.client.get(f"/v1/plans/{key}", params=env_query(gpu_env), headers=api.reader)
    assert r.status_code == 200 and len(r.content) < 2048 and "candidates" not in r.json()

    cache = DiskCache(tmp_path, gpu_env)
    assert cache.save(record, blob)
    assert (tmp_path / gpu_env.env_id / f"{key}.json").stat().st_size < 2048  # before: 51 MiB

    r = api.client.get(f"/v1/plans/{key}/candidates", params=env_query(gpu_env), headers=api.admin)
    assert r.status_code == 200
    got = r.json()
    assert CandidateTable.model_validate({k: got[k] for k in ("candidates", "candidates_omitted")}) == table
    assert (got["graph_key"], got["env_id"], got["blob_sha256"], got["revision"]) == (
        key, gpu_env.env_id, record.blob_sha256, record.revision)
    for who in (api.reader, api.worker):
        assert api.client.get(f"/v1/plans/{key}/candidates", params=env_query(gpu_env), headers=who).status_code == 403
    r = api.client.get(f"/v1/plans/{'0' * 64}/candidates", params=env_query(gpu_env), headers=api.admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_the_table_is_replaced_with_its_record_and_goes_with_it(store, make_spec, make_plan, gpu_env):
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    meta, blob = make_plan(key, gpu_env)
    store.publish_plan(meta, blob, candidates=make_candidates(2))
    assert len(store.get_candidates(key, gpu_env).candidates) == 2
    store.publish_plan(meta, blob, candidates=make_candidates(5))  # the same plan again: unchanged
    assert len(store.get_candidates(key, gpu_env).candidates) == 2
    newer, other = make_plan(key, gpu_env, blob=b"another plan")
    store.publish_plan(newer, other, replace=True, candidates=make_candidates(3, candidates_omitted={"ok": 7}))
    table = store.get_candidates(key, gpu_env)
    assert len(table.candidates) == 3 and table.candidates_omitted == {"ok": 7}
    assert table.blob_sha256 == newer.blob_sha256
    latest, third = make_plan(key, gpu_env, blob=b"a third plan")
    store.publish_plan(latest, third, replace=True)  # an upload without a table: none is kept
    assert store.get_candidates(key, gpu_env) == store.get_candidates(key, gpu_env).model_copy(
        update={"candidates": [], "candidates_omitted": {}})
    store.publish_plan(*make_plan(key, gpu_env, blob=b"a fourth plan"), replace=True, candidates=make_candidates(1))
    with store.engine.begin() as conn:
        plan_id = conn.execute(sa.text("SELECT id FROM plans")).scalar_one()
        conn.execute(sa.delete(sa.table("plans", sa.column("id"))).where(sa.column("id") == plan_id))
        assert conn.execute(sa.select(sa.func.count()).select_from(plan_candidates)).scalar_one() == 0  # cascade
    assert store.get_candidates(key, gpu_env) is None


def test_a_client_cache_entry_written_with_candidates_still_loads(tmp_path, make_plan, gpu_env):
    """An entry a client wrote when records held candidates loads (the candidates dropped); it is not refused."""
    meta, blob = make_plan("0" * 64, gpu_env)
    record = PlanRecord(**meta.model_dump(), env_id=gpu_env.env_id, created_at="2026-01-01T00:00:00Z")
    cache = DiskCache(tmp_path, gpu_env)
    assert cache.save(record, blob)
    path = tmp_path / gpu_env.env_id / f"{record.graph_key}.json"
    legacy = {**json.loads(path.read_text()), "candidates": [c.model_dump(mode="json") for c in _incident_rows(50)]}
    path.write_text(json.dumps(legacy))
    assert cache.record(record.graph_key) == record and cache.blobs.get(record.blob_sha256) == blob
