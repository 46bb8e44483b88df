"""No one token takes the autotune budget (issue 37, finding 2): a miss counts once per caller and process, a
caller's share of the keys it alone raises is bounded, and automatic jobs come after admin and campaign jobs.

Figure (this module's first test: one reader registers 40 junk specs and resolves them 50 times, each time as
another process; 10 real keys are missed by 5 other readers each; one autotune step, default policy), on main
4d1a308: the junk took 20 of the 20 automatic jobs, the 10 real keys none. With the fix: each real key gets its
job (10 of 10), the junk at most its caller's share (half the budget).
"""

from __future__ import annotations

from typing import Any

from plancache.server.autotune import policy_from
from plancache.settings import Settings
from plancache.store.autotune import run_autotune
from tests.server_util import bearer, open_api

SETTINGS = Settings()


def _register(api: Any, spec: dict[str, Any], headers: dict[str, str]) -> str:
    r = api.client.post("/v1/specs", json=spec, headers=headers)
    assert r.status_code in (200, 201), r.text
    return r.json()["graph_key"]


def _resolve(api: Any, env: Any, keys: list[str], headers: dict[str, str], process: str) -> None:
    r = api.client.post("/v1/plans/resolve", json={"environment": env.model_dump(), "graph_keys": keys},
                        headers={**headers, "X-Plancache-Process": process})
    assert r.status_code == 200, r.text


def test_one_reader_cannot_take_the_automatic_budget(file_store, make_spec, gpu_env):
    with open_api(file_store) as api:
        junk = [_register(api, make_spec(i)[1], api.reader) for i in range(40)]
        real = [_register(api, make_spec(100 + i)[1], api.admin) for i in range(10)]
        for n in range(50):
            _resolve(api, gpu_env, junk, api.reader, process=f"forged-{n}")
        for r in range(5):
            token, _ = file_store.create_token(f"fleet-{r}", "reader")
            _resolve(api, gpu_env, real, bearer(token), process=f"host-{r}")
        assert file_store.claim(gpu_env, "w1", lease_seconds=60) is None  # a worker serves the environment
        jobs = run_autotune(file_store, policy_from(SETTINGS))
    tuned = {j.graph_key for j in jobs}
    assert set(real) <= tuned
    assert len(tuned & set(junk)) <= SETTINGS.autotune_jobs_per_hour // 2


def test_a_key_one_process_misses_again_and_again_counts_once(file_store, make_spec, gpu_env):
    with open_api(file_store) as api:
        key = _register(api, make_spec(0)[1], api.reader)
        for _ in range(10):
            _resolve(api, gpu_env, [key], api.reader, process="one")
        (miss,) = file_store.list_misses()
        assert miss.count == 1
        token, _ = file_store.create_token("other", "reader")
        _resolve(api, gpu_env, [key], bearer(token), process="one")  # another caller
        _resolve(api, gpu_env, [key], api.reader, process="two")  # another process of the first (its share)
        (miss,) = file_store.list_misses()
        assert miss.count == 3


def test_admin_and_campaign_jobs_are_claimed_before_automatic_ones(file_store, make_spec, gpu_env):
    with open_api(file_store) as api:
        auto = _register(api, make_spec(0)[1], api.admin)
        for r in range(3):
            token, _ = file_store.create_token(f"r{r}", "reader")
            _resolve(api, gpu_env, [auto], bearer(token), process="p")
        assert file_store.claim(gpu_env, "w1", lease_seconds=60) is None
        (job,) = run_autotune(file_store, policy_from(SETTINGS))
        assert job.graph_key == auto and job.source == "auto"
        admin_key = _register(api, make_spec(1)[1], api.admin)
        r = api.client.post("/v1/admin/tune", json={"graph_keys": [admin_key], "targets": [{}]}, headers=api.admin)
        assert r.status_code == 200, r.text
    first = file_store.claim(gpu_env, "w1", lease_seconds=60)
    assert first is not None and first.job.graph_key == admin_key
