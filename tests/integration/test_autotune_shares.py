"""No one token takes the autotune budget (issue 37, finding 2): a miss counts once per caller and process, a
caller's share of the keys it alone raises is bounded, and automatic jobs come after admin and campaign jobs.

Figure (this module's first test: one reader registers 40 junk specs and resolves them 50 times, each time as
another process; 10 real keys are missed by 5 other readers each; one autotune step, default policy), on main
4d1a308: the junk took 20 of the 20 automatic jobs, the 10 real keys none. With the fix: each real key gets its
job (10 of 10), the junk at most its caller's share (half the budget). Who counted what is in the database, so a
restart forgets nothing and two replicas on one database count a caller once and give it one share.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import sqlalchemy as sa
from fastapi.testclient import TestClient

from plancache.server import create_app
from plancache.server.autotune import policy_from
from plancache.settings import Settings
from plancache.store import open_store
from plancache.store.autotune import run_autotune
from plancache.store.history import prune_history
from plancache.store.misses import DISTINCT_MISS_PERIOD, MissCaller
from plancache.store.models import miss_callers
from tests.live_server import LiveServer
from tests.server_util import ADMIN_TOKEN, bearer, open_api

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


def test_a_restarted_server_remembers_who_counted_a_miss(store, make_spec, gpu_env):
    """A process missing a key before and after its server restarts counts once (in memory it counted twice)."""
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    token, _ = store.create_token("host", "reader")
    for _ in range(2):  # the server, then the server restarted
        app = create_app(Settings(database_url="sqlite:///unused.db", admin_token=ADMIN_TOKEN), store=store)
        with TestClient(app) as client:
            r = client.post("/v1/plans/resolve", json={"environment": gpu_env.model_dump(), "graph_keys": [key]},
                            headers={**bearer(token), "X-Plancache-Process": "one"})
            assert r.status_code == 200, r.text
    (miss,) = store.list_misses()
    assert miss.count == 1


def test_two_replicas_count_a_caller_once_and_give_it_one_share(db_url, tmp_path, make_spec, gpu_env):
    """Two servers on one database: a caller's process counts a key once across both, and its share (1 key an
    hour with a budget of 2 jobs) spent on one replica is spent on the other (each had its own in memory)."""
    stores = [open_store(db_url, create=True) for _ in range(2)]
    try:
        keys = []
        for i in range(2):
            key, spec = make_spec(i)
            stores[0].put_spec(key, spec)
            keys.append(key)
        token, _ = stores[0].create_token("host", "reader")
        k1, k2 = keys
        with LiveServer(tmp_path / "a", store=stores[0], autotune_jobs_per_hour=2) as a, \
                LiveServer(tmp_path / "b", store=stores[1], autotune_jobs_per_hour=2) as b:
            def resolve(srv: LiveServer, wanted: list[str], process: str) -> None:
                r = httpx.post(f"{srv.url}/v1/plans/resolve", json={"environment": gpu_env.model_dump(),
                                                                    "graph_keys": wanted},
                               headers={**bearer(token), "X-Plancache-Process": process})
                assert r.status_code == 200, r.text

            resolve(a, keys, "p0")  # first counts, free: 1 and 1
            resolve(b, keys, "p0")  # the same caller and process through the other replica: nothing
            resolve(a, [k1], "p1")  # another process raises k1 from the share: 2
            resolve(b, [k2], "p2")  # the share is spent (on a): k2 stays 1
            resolve(b, [k1], "p3")  # k1 took the share this hour: free for the rest of it, 3
        assert {m.graph_key: m.count for m in stores[1].list_misses()} == {k1: 3, k2: 1}
    finally:
        for s in stores:
            s.close()


def test_who_counted_a_miss_expires_after_a_week(store, clock, gpu_env):
    """A caller's row counts for DISTINCT_MISS_PERIOD: after it the key counts again, and the row is deleted by the
    autotune step and by ``plans gc`` (prune_history), so the table holds about a week of counted misses."""
    who = MissCaller("token:x", "p")
    key = "a" * 64
    assert store.countable_misses(gpu_env.env_id, who, [key], share=1).keys == [key]
    store.record_misses(gpu_env, [key], who)
    assert store.countable_misses(gpu_env.env_id, who, [key], share=1).keys == []
    store.record_misses(gpu_env, ["b" * 64], MissCaller("token:y"))
    clock.advance((DISTINCT_MISS_PERIOD + timedelta(minutes=1)).total_seconds())
    assert store.countable_misses(gpu_env.env_id, who, [key], share=1).keys == [key]
    store.record_misses(gpu_env, [key], who)  # the expired row renewed
    assert {m.graph_key: m.count for m in store.list_misses()}[key] == 2

    def rows() -> int:
        with store.db.read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(miss_callers)).scalar_one())

    assert rows() == 2
    run_autotune(store, policy_from(SETTINGS))
    assert rows() == 1  # y's row, a week old
    clock.advance((DISTINCT_MISS_PERIOD + timedelta(minutes=1)).total_seconds())
    prune_history(store)
    assert rows() == 0
