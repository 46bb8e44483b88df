"""Tuning without a person: the autotune policy (plancache.store.autotune) on SQLite and Postgres — miss counts,
the worker window, the hourly budget, most-missed first, environments no worker serves, several replicas at once —
its background thread and admin routes, and the source every job carries."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest

from plancache.protocol import TargetEnvironment
from plancache.store.autotune import AutotunePolicy, run_autotune
from tests.factories import OTHER_GPU
from tests.server_util import api, open_api  # noqa: F401

POLICY = AutotunePolicy(min_misses=3, jobs_per_hour=20, worker_window=timedelta(hours=1))


def specs(store, make_spec, n: int) -> list[str]:
    keys = []
    for i in range(n):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        keys.append(key)
    return keys


def miss(store, env, key: str, times: int) -> None:
    for _ in range(times):
        store.record_misses(env, [key])


def poll(store, env) -> None:
    """A worker asks for a job for ``env`` (there is none it can run)."""
    assert store.claim(env, "w1", lease_seconds=60) is None


def test_keys_missed_n_times_on_a_served_environment_are_enqueued_most_missed_first(store, make_spec, make_plan,
                                                                                     gpu_env):
    keys = specs(store, make_spec, 4)
    miss(store, gpu_env, keys[0], 3)
    miss(store, gpu_env, keys[1], 5)
    miss(store, gpu_env, keys[2], 2)              # below N
    miss(store, gpu_env, keys[3], 9)              # planned meanwhile
    miss(store, gpu_env, "f" * 64, 9)             # no spec stored: cannot be tuned
    store.publish_plan(*make_plan(keys[3], gpu_env))
    assert run_autotune(store, POLICY) == []      # no worker serves the environment yet
    poll(store, gpu_env)
    jobs = run_autotune(store, POLICY)
    assert [j.graph_key for j in jobs] == [keys[1], keys[0]]
    assert all(j.source == "auto" and j.target == TargetEnvironment.exactly(gpu_env) for j in jobs)
    assert run_autotune(store, POLICY) == []      # once per key: queued now
    miss(store, gpu_env, keys[2], 1)              # the N-th miss
    assert [j.graph_key for j in run_autotune(store, POLICY)] == [keys[2]]


def test_the_budget_is_per_environment_and_hour(store, make_spec, clock, gpu_env):
    keys = specs(store, make_spec, 5)
    for i, key in enumerate(keys):
        miss(store, gpu_env, key, 10 - i)
        miss(store, OTHER_GPU, key, 3)
    poll(store, gpu_env)
    poll(store, OTHER_GPU)
    policy = AutotunePolicy(min_misses=3, jobs_per_hour=2, worker_window=timedelta(hours=2))
    first = run_autotune(store, policy)
    assert Counter(j.target.sm for j in first) == {gpu_env.sm: 2, OTHER_GPU.sm: 2}
    assert [j.graph_key for j in first if j.target.sm == gpu_env.sm] == keys[:2]
    clock.advance(3599)
    assert run_autotune(store, policy) == []      # budget spent for this hour
    clock.advance(2)
    assert [j.graph_key for j in run_autotune(store, policy) if j.target.sm == gpu_env.sm] == keys[2:4]
    assert run_autotune(store, AutotunePolicy(jobs_per_hour=0)) == []


def test_only_environments_a_worker_claimed_for_within_the_window(store, make_spec, clock, gpu_env):
    (key,) = specs(store, make_spec, 1)
    miss(store, OTHER_GPU, key, 5)
    miss(store, gpu_env, key, 5)
    poll(store, gpu_env)                          # no worker ever asks for OTHER_GPU
    clock.advance(3601)
    assert run_autotune(store, POLICY) == []      # the H200 worker's claim is older than the window
    poll(store, gpu_env)
    (job,) = run_autotune(store, POLICY)
    assert job.target == TargetEnvironment.exactly(gpu_env)


def test_keys_with_a_job_that_covers_the_environment_are_left_alone(store, make_spec, gpu_env):
    keys = specs(store, make_spec, 3)
    for key in keys:
        miss(store, gpu_env, key, 3)
    failed, _ = store.enqueue(keys[1], TargetEnvironment.exactly(gpu_env), max_attempts=1)
    claim = store.claim(gpu_env, "w1", lease_seconds=60)
    assert claim is not None and claim.job.id == failed.id
    store.fail(failed.id, "w1", claim.lease_token, "boom", retryable=False)
    store.enqueue(keys[0], TargetEnvironment(sm=gpu_env.sm))        # an admin's wildcard job, queued
    assert [j.graph_key for j in run_autotune(store, POLICY)] == [keys[2]]  # a failed key waits for an admin


def test_replicas_stepping_at_once_neither_duplicate_nor_overrun(store, make_spec, gpu_env):
    keys = specs(store, make_spec, 12)
    for i, key in enumerate(keys):
        miss(store, gpu_env, key, 3 + i)
    poll(store, gpu_env)
    policy = AutotunePolicy(min_misses=3, jobs_per_hour=5)
    results: list[list[str]] = []
    start = threading.Barrier(4)

    def replica() -> None:
        start.wait()
        results.append([j.graph_key for j in run_autotune(store, policy)])

    threads = [threading.Thread(target=replica) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    created = [k for r in results for k in r]
    assert sorted(created) == sorted(keys[-5:])   # the 5 most missed, each once
    assert len(store.list_jobs()) == 5


def test_policy_bounds_are_checked():
    from plancache import errors

    for bad in ({"min_misses": 0}, {"jobs_per_hour": -1}, {"worker_window": timedelta(0)}):
        with pytest.raises(errors.InvalidValue):
            AutotunePolicy(**bad)


def resolve(api, env, keys, process: str = "p"):  # noqa: F811
    """A resolve by the reader from client ``process`` (a miss counts once per caller and process)."""
    body = {"environment": env.model_dump(mode="json"), "graph_keys": keys}
    r = api.client.post("/v1/plans/resolve", json=body, headers={**api.reader, "X-Plancache-Process": process})
    assert r.status_code == 200, r.text


def test_the_background_policy_enqueues_soon_after_the_nth_miss(store, make_spec, gpu_env):
    (key,) = specs(store, make_spec, 1)
    with open_api(store, autotune_interval=1, autotune_min_misses=3) as a:
        r = a.client.post("/v1/jobs/claim", json={"environment": gpu_env.model_dump(mode="json"), "worker_id": "w1"},
                          headers=a.worker)
        assert r.status_code == 204
        for n in range(3):
            resolve(a, gpu_env, [key], process=f"p{n}")
        nth_miss = time.monotonic()
        while not store.list_jobs() and time.monotonic() - nth_miss < 10:
            time.sleep(0.05)
        waited = time.monotonic() - nth_miss
        (job,) = store.list_jobs()
        assert job.source == "auto" and job.graph_key == key
        assert waited < 2.5, waited               # within one interval (1 s) and a step
        status = a.client.get("/v1/admin/autotune", headers=a.admin).json()
        assert status["enabled"] and status["min_misses"] == 3 and status["last_run_at"] is not None
        assert "plancache_autotune_jobs_total 1.0" in a.client.get("/metrics").text
        print(f"autotune: job enqueued {waited:.2f} s after the 3rd miss (interval 1 s)")


def test_turned_off_no_background_step_but_an_admin_may_run_one(store, make_spec, gpu_env):
    (key,) = specs(store, make_spec, 1)
    miss(store, gpu_env, key, 3)
    poll(store, gpu_env)
    with open_api(store, autotune=False, autotune_interval=1) as a:
        assert a.app.state.autotuner._thread is None
        time.sleep(1.5)
        assert store.list_jobs() == []
        status = a.client.get("/v1/admin/autotune", headers=a.admin).json()
        assert status["enabled"] is False and status["last_run_at"] is None
        assert a.client.post("/v1/admin/autotune/run", headers=a.worker).status_code == 403
        r = a.client.post("/v1/admin/autotune/run", headers=a.admin)
        assert r.status_code == 200, r.text
        assert [(j["graph_key"], j["source"]) for j in r.json()["jobs"]] == [(key, "auto")]


def test_every_job_shows_its_source(api, make_spec, gpu_env):  # noqa: F811
    keys = specs(api.store, make_spec, 4)
    target = {"sm": gpu_env.sm}
    for key, source in ((keys[0], None), (keys[1], "capture")):
        body = {"graph_keys": [key], "targets": [target], **({"source": source} if source else {})}
        assert api.client.post("/v1/admin/tune", json=body, headers=api.admin).status_code == 200
    r = api.client.post("/v1/admin/tune", json={"graph_keys": [keys[2]], "targets": [target], "source": "auto"},
                        headers=api.admin)
    assert r.status_code == 422                  # only the server's own policy enqueues as auto
    r = api.client.post("/v1/admin/campaigns", json={"target": {"cudnn_version": 92000}}, headers=api.admin)
    assert r.status_code == 200, r.text
    miss(api.store, OTHER_GPU, keys[3], 3)
    poll(api.store, OTHER_GPU)
    assert api.client.post("/v1/admin/autotune/run", headers=api.admin).status_code == 200
    jobs = api.client.get("/v1/jobs", headers=api.admin).json()["jobs"]
    assert Counter(j["source"] for j in jobs) == {"admin": 1, "capture": 1, "campaign": 4, "auto": 1}
    page = api.client.get("/ui", headers=api.admin).text
    assert "<th>source</th>" in page and "<td>capture</td>" in page and "<td>auto</td>" in page
