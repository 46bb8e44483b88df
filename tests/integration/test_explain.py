"""Every miss explained: ``Store.explain_misses`` and ``POST /v1/plans/explain`` give each reason a graph key can
have no plan on an environment, in words a user acts on; the client notes them in its ``PlanMiss``."""

from __future__ import annotations

import json

from plancache.protocol import ExplainResponse, TargetEnvironment
from tests.server_util import api, open_api  # noqa: F401


def seed(store, make_spec, make_plan, gpu_env, other_env) -> dict[str, str]:
    keys = {}
    for i, name in enumerate(["planned", "running", "queued", "failed", "elsewhere", "registered"]):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        keys[name] = key
    meta, blob = make_plan(keys["planned"], gpu_env)
    store.publish_plan(meta, blob)
    meta, blob = make_plan(keys["elsewhere"], other_env, blob=b"other-plan")
    store.publish_plan(meta, blob)
    target = TargetEnvironment.exactly(gpu_env)
    failed, _ = store.enqueue(keys["failed"], target, max_attempts=1)
    claim = store.claim(gpu_env, "w1", lease_seconds=60)
    assert claim is not None and claim.job.id == failed.id
    store.fail(failed.id, "w1", claim.lease_token, "no candidate passed the numerics check", retryable=False)
    running, _ = store.enqueue(keys["running"], target)
    assert store.claim(gpu_env, "w1", lease_seconds=60).job.id == running.id
    store.enqueue(keys["queued"], target)
    store.enqueue(keys["elsewhere"], TargetEnvironment.exactly(other_env))  # for the other environment only
    keys["unknown"] = "e" * 64
    return keys


def other(gpu_env):
    return gpu_env.model_copy(update={"cudnn_version": gpu_env.cudnn_version + 100, "driver_version": 12080})


def test_each_reason(store, make_spec, make_plan, gpu_env):
    keys = seed(store, make_spec, make_plan, gpu_env, other(gpu_env))
    reasons = store.explain_misses(gpu_env, list(keys.values()) + [keys["queued"]])
    got = {name: reasons[key] for name, key in keys.items()}
    assert {name: r.reason for name, r in got.items()} == {
        "planned": "planned", "running": "running", "queued": "queued", "failed": "failed",
        "elsewhere": "other_environments", "registered": "not_queued", "unknown": "not_registered"}
    assert "no candidate passed the numerics check" in got["failed"].message and got["failed"].job_id
    assert "1 of 1 attempts" in got["failed"].message
    assert got["elsewhere"].differs == ["cudnn_version", "driver_version"]
    assert f"cudnn_version {gpu_env.cudnn_version}" in got["elsewhere"].message
    assert "POST /v1/admin/tune/misses" in got["registered"].message
    assert "never seen this graph's spec" in got["unknown"].message
    assert got["running"].job_id and "being tuned" in got["running"].message
    assert store.explain_misses(gpu_env, []) == {}


def test_a_registered_key_never_queued_says_what_autotune_will_do(store, make_spec, gpu_env):
    """With the server's autotune policy, ``not_queued`` says how many times the key missed here, and whether
    autotune will queue it (at how many misses, or at its next step) or cannot (no worker serves this GPU)."""
    from datetime import timedelta

    from plancache.store.autotune import AutotunePolicy

    key, spec = make_spec(0)
    store.put_spec(key, spec)
    policy = AutotunePolicy(min_misses=3, jobs_per_hour=20, worker_window=timedelta(hours=2))

    def message() -> str:
        reason = store.explain_misses(gpu_env, [key], autotune=policy)[key]
        assert reason.reason == "not_queued"
        return reason.message

    assert "autotune is off" in store.explain_misses(gpu_env, [key])[key].message
    store.record_misses(gpu_env, [key])
    assert "missed 1 time on" in message() and "no worker claimed jobs for this environment in the last 2 h" in message()
    assert store.claim(gpu_env, "w1", lease_seconds=60) is None  # a worker polls for this GPU: it serves it now
    assert "autotune queues it at 3 misses (PLANCACHE_AUTOTUNE_MIN_MISSES)" in message()
    store.record_misses(gpu_env, [key])
    store.record_misses(gpu_env, [key])
    assert "missed 3 times" in message() and "autotune queues it at its next step" in message()


def test_the_route_answers_reasons_and_records_nothing(api, make_spec, make_plan, gpu_env):  # noqa: F811
    keys = seed(api.store, make_spec, make_plan, gpu_env, other(gpu_env))
    body = {"environment": json.loads(gpu_env.model_dump_json()), "graph_keys": [keys["unknown"], keys["failed"]]}
    r = api.client.post("/v1/plans/explain", json=body, headers=api.reader)
    assert r.status_code == 200, r.text
    reasons = ExplainResponse.model_validate(r.json()).reasons
    assert reasons[keys["unknown"]].reason == "not_registered" and reasons[keys["failed"]].reason == "failed"
    assert api.store.list_misses() == []  # explaining is not missing
    assert api.client.post("/v1/plans/explain", json=body).status_code == 401
    body["graph_keys"] = ["not-a-key"]
    assert api.client.post("/v1/plans/explain", json=body, headers=api.reader).status_code == 422


def test_the_explain_command_says_why_in_one_line_per_graph(tmp_path, make_spec, make_plan, gpu_env):
    from typer.testing import CliRunner

    from plancache.cli import make_app
    from plancache.store import open_store
    from tests.live_server import LiveServer

    store = open_store(f"sqlite:///{tmp_path / 'x.db'}", create=True)
    keys = seed(store, make_spec, make_plan, gpu_env, other(gpu_env))
    spec_file = tmp_path / "failed.json"
    spec_file.write_text(json.dumps(make_spec(3)[1]))
    with LiveServer(tmp_path / "srv", store=store, open_reads=True) as srv:
        result = CliRunner().invoke(make_app(), ["explain", str(spec_file), keys["unknown"], keys["elsewhere"],
                                                 "--environment", gpu_env.model_dump_json(), "--server", srv.url])
    store.close()
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"on {gpu_env.describe()}:"
    assert lines[1].startswith(f"{keys['failed'][:12]}  failed.json  failed: tuning failed (job ")
    assert lines[2].startswith(f"{keys['unknown'][:12]}  not_registered: the server has never seen")
    assert lines[3].startswith(f"{keys['elsewhere'][:12]}  other_environments: tuned only for other environments")


def test_explain_without_a_gpu_asks_for_the_environment(tmp_path):
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "plancache", "explain", "e" * 64, "--server", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "give --environment FILE" in proc.stderr and "Traceback" not in proc.stderr


def test_explain_with_only_the_admin_token_set_uses_it(tmp_path, make_spec, make_plan, gpu_env, monkeypatch):
    """A reader command sends PLANCACHE_TOKEN, else PLANCACHE_ADMIN_TOKEN (which outranks a reader): an operator with
    only the admin token set got a 401 whose fix named the admin token it had."""
    from typer.testing import CliRunner

    from plancache.cli import make_app
    from plancache.store import open_store
    from tests.live_server import LiveServer

    store = open_store(f"sqlite:///{tmp_path / 'x.db'}", create=True)
    keys = seed(store, make_spec, make_plan, gpu_env, other(gpu_env))
    monkeypatch.delenv("PLANCACHE_TOKEN", raising=False)
    with LiveServer(tmp_path / "srv", store=store) as srv:  # reads need a token
        monkeypatch.setenv("PLANCACHE_ADMIN_TOKEN", srv.admin_token)
        result = CliRunner().invoke(make_app(), ["explain", keys["unknown"], "--environment",
                                                 gpu_env.model_dump_json(), "--server", srv.url])
        monkeypatch.delenv("PLANCACHE_ADMIN_TOKEN")
        refused = CliRunner().invoke(make_app(), ["explain", keys["unknown"], "--environment",
                                                  gpu_env.model_dump_json(), "--server", srv.url])
    store.close()
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].startswith(f"{keys['unknown'][:12]}  not_registered:")
    assert refused.exit_code == 8 and "401" in refused.output, refused.output  # no token at all: still refused


def test_a_job_queued_where_no_worker_claims_says_so(store, make_spec, gpu_env):
    """"Why is nothing getting tuned?": a queued job on an environment no worker asks for jobs for is never run; its
    explanation said only "queued for tuning" (and a withdrawn plan's, "queued to tune it again")."""
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    job, _ = store.enqueue(key, TargetEnvironment.exactly(gpu_env))
    reason = store.explain_misses(gpu_env, [key])[key]
    assert reason.reason == "queued" and reason.job_id == job.id
    assert "no worker claimed jobs for this environment in the last 1 h (never): start a worker" in reason.message
    elsewhere = other(gpu_env)
    assert store.claim(elsewhere, "w2", lease_seconds=60) is None  # a worker for another GPU does not count
    assert "(never)" in store.explain_misses(gpu_env, [key])[key].message
    assert store.claim(gpu_env, "w1", lease_seconds=60).job.id == job.id
    store.enqueue(key, TargetEnvironment(sm=gpu_env.sm), priority=1)  # queued, now that a worker serves the GPU
    served = store.explain_misses(gpu_env, [key])[key]
    assert served.reason in ("queued", "running") and "no worker" not in served.message


def test_a_graph_tuned_here_whose_plan_was_deleted_is_not_promised_to_autotune(store, make_spec, make_plan, gpu_env):
    """Once ``plans gc --keep-env`` deleted an environment's records, a graph tuned there (its job succeeded) said
    "autotune queues it at its next step"; autotune never queues a graph tuned for that environment before."""
    from datetime import timedelta

    from plancache.store.autotune import AutotunePolicy, run_autotune
    from plancache.store.retention import gc

    key, spec = make_spec(0)
    store.put_spec(key, spec)
    job, _ = store.enqueue(key, TargetEnvironment.exactly(gpu_env))
    claim = store.claim(gpu_env, "w1", lease_seconds=60)
    meta, blob = make_plan(key, gpu_env)
    store.publish_plan(meta, blob, job_id=job.id, worker_id="w1", lease_token=claim.lease_token)
    kept, kept_spec = make_spec(1)
    store.put_spec(kept, kept_spec)
    store.publish_plan(*make_plan(kept, other(gpu_env), blob=b"other-plan"))
    gc(store, grace=timedelta(0), keep_env_ids={other(gpu_env).env_id})
    policy = AutotunePolicy(min_misses=1)
    store.record_misses(gpu_env, [key])
    reason = store.explain_misses(gpu_env, [key], autotune=policy)[key]
    assert run_autotune(store, policy) == []
    assert reason.reason == "not_queued" and reason.job_id == job.id
    assert "no longer stored" in reason.message and "autotune does not queue" in reason.message


def test_a_failed_jobs_error_is_quoted_to_admins_only(file_store, make_spec, gpu_env):
    """A worker's job error (its paths, host names) reached every reader through explain and /ui (main 4d1a308); a
    reader is told the job failed and where an admin reads why."""
    key, spec = make_spec(0)
    file_store.put_spec(key, spec)
    job, _ = file_store.enqueue(key, TargetEnvironment.exactly(gpu_env), max_attempts=1)
    claim = file_store.claim(gpu_env, "w1", lease_seconds=60)
    assert claim is not None and claim.job.id == job.id
    secret = "cannot open /home/tuner/.secret-cache/libcudnn_engines.so on gpu-node-17"
    file_store.fail(job.id, "w1", claim.lease_token, secret, retryable=False)
    file_store.record_misses(gpu_env, [key])
    body = {"environment": gpu_env.model_dump(), "graph_keys": [key]}
    with open_api(file_store) as a:
        as_reader = a.client.post("/v1/plans/explain", json=body, headers=a.reader).json()["reasons"][key]
        as_admin = a.client.post("/v1/plans/explain", json=body, headers=a.admin).json()["reasons"][key]
        page = a.client.get("/ui", headers=a.reader).text
    assert as_reader["reason"] == "failed" and secret not in as_reader["message"]
    assert f"GET /v1/jobs/{job.id}" in as_reader["message"]
    assert secret in as_admin["message"]
    assert "secret-cache" not in page and f"GET /v1/jobs/{job.id} (admin)" in page
