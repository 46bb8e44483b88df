"""The status page (``GET /ui``): what it shows of a seeded store, who may read it (a bearer token, the session
cookie of its sign-in form, open reads), that stored text is escaped, and that a real browser (headless Chromium
from Debian's ``chromium`` package) renders it; docs/status-page.png is its screenshot of realistic data."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plancache.protocol import TargetEnvironment
from tests.live_server import LiveServer
from tests.server_util import open_api


def seed(store, make_spec, make_plan, gpu_env) -> dict[str, str]:
    """Two tuned plans, a failed job whose error holds markup, a queued job, and misses of each kind."""
    keys = {}
    for i, name in enumerate(["tuned_a", "tuned_b", "failed", "queued", "registered"]):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        keys[name] = key
    for i, name in enumerate(["tuned_a", "tuned_b"]):
        meta, blob = make_plan(keys[name], gpu_env, blob=f"blob-{i}".encode(), winner_median_ms=0.05,
                               heuristic_median_ms=0.05 * (2 + i))
        store.publish_plan(meta, blob)
    job, _ = store.enqueue(keys["failed"], TargetEnvironment(sm=gpu_env.sm), max_attempts=1)
    claimed = store.claim(gpu_env, "w1", lease_seconds=60)
    store.fail(job.id, "w1", claimed.lease_token, "no candidate passed <script>alert(1)</script>", retryable=False)
    store.enqueue(keys["queued"], TargetEnvironment(sm=gpu_env.sm))
    keys["unknown"] = "f" * 64
    store.record_misses(gpu_env, [keys["failed"], keys["queued"], keys["registered"], keys["unknown"]])
    return keys


def test_the_page_shows_coverage_misses_with_reasons_jobs_and_gains(store, make_spec, make_plan, gpu_env):
    keys = seed(store, make_spec, make_plan, gpu_env)
    with open_api(store) as api:
        assert api.client.get("/ui").status_code == 401  # reader role, like every read
        r = api.client.get("/ui", headers=api.reader)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"] and "<script" not in r.text
    page = r.text
    for heading in ("Workers", "Jobs: failures first", "Plan coverage by environment", "Most missed graphs",
                    "Tuned versus heuristic"):
        assert heading in page
    assert gpu_env.describe() in page and "2 / 6" in page  # 2 graphs planned of 6 planned or missed
    assert "the spec is registered, missed 1 time on" in page and "autotune queues it at 3 misses" in page
    assert "never seen this graph&#x27;s spec" in page
    assert "queued for tuning (job" in page  # the reasons of POST /v1/plans/explain
    # a worker's error text is for admins (GET /v1/jobs/{id}); the page, a reader's, says where to read it
    assert "no candidate passed" not in page and "attempts): an admin reads its error (GET /v1/jobs/1" in page
    assert "2.00x" in page and "3.00x" in page  # heuristic / tuned
    assert keys["unknown"][:12] in page and page.count("<svg") == 1


def test_a_graph_missed_on_two_environments_shows_each_environment_s_reason(store, make_spec, gpu_env):
    """The reasons were kept by graph key alone: a key missed on two GPUs showed one GPU's reason on both rows (a job
    that failed for good on one hidden behind "registered" from the other)."""
    from tests.factories import OTHER_GPU

    key, spec = make_spec(0)
    store.put_spec(key, spec)
    job, _ = store.enqueue(key, TargetEnvironment.exactly(OTHER_GPU), max_attempts=1)
    claimed = store.claim(OTHER_GPU, "w1", lease_seconds=60)
    store.fail(job.id, "w1", claimed.lease_token, "no candidate passed", retryable=False)
    store.record_misses(OTHER_GPU, [key])
    store.record_misses(gpu_env, [key])
    with open_api(store) as api:
        page = api.client.get("/ui", headers=api.reader).text
    rows = {line for line in page.split("<tr>") if key[:12] in line and "<td class='n'>1</td>" in line}
    here = [r for r in rows if gpu_env.describe() in r]
    there = [r for r in rows if OTHER_GPU.describe() in r]
    assert len(here) == 1 and "the spec is registered" in here[0] and "no candidate passed" not in here[0]
    assert len(there) == 1 and "tuning failed" in there[0] and "no candidate passed" not in there[0], there


def test_open_reads_let_a_browser_in(store):
    with open_api(store, open_reads=True) as api:
        r = api.client.get("/ui")
    assert r.status_code == 200 and "No plans and no misses yet." in r.text


def realistic(store, make_spec, make_plan, clock) -> None:
    """A fleet's store as the docs' screenshot shows it: three GPU types, one of whose workers is gone (its queued
    jobs flagged), tuned plans with their gains, a failed job, and misses of each kind."""
    from plancache.environment import Environment
    from tests.factories import H200
    from tests.factories import OTHER_GPU as A100

    h100 = Environment(sm=90, sm_count=114, cudnn_version=91900, driver_version=13000, frontend_version="1.32.0",
                       device_name="NVIDIA H100 PCIe")
    specs = iter(range(100))

    def key() -> str:
        k, spec = make_spec(next(specs))
        store.put_spec(k, spec)
        return k

    def tune(env: Environment, worker: str, gain: float) -> str:
        k = key()
        store.enqueue(k, TargetEnvironment.exactly(env))
        claim = store.claim(env, worker, lease_seconds=120)
        meta, blob = make_plan(k, env, blob=k.encode(), worker_id=worker, winner_median_ms=0.04,
                               heuristic_median_ms=0.04 * gain, plan_name=f"eng{int(gain * 10)}")
        store.publish_plan(meta, blob, job_id=claim.job.id, worker_id=worker, lease_token=claim.lease_token)
        return k

    for gain in (1.0, 1.31, 1.08):
        tune(A100, "a100-node-3", gain)
    clock.advance(3 * 3600)  # the A100 workers were retired
    for gain in (1.02, 1.18, 1.0, 1.52):
        tune(h100, "h100-pcie-1", gain)
    clock.advance(25 * 60)
    for gain in (1.0, 1.12, 1.0, 1.07, 1.26, 1.0, 1.04):
        tune(H200, "h200-node-7", gain)
    failed = key()
    store.enqueue(failed, TargetEnvironment.exactly(H200), max_attempts=1)
    claim = store.claim(H200, "h200-node-7", lease_seconds=120)
    store.fail(claim.job.id, "h200-node-7", claim.lease_token, "no candidate passed the numerics check: the best "
               "normalised error 4.1e-02 is over the bf16 tolerance 2.0e-02 (12 candidates)", retryable=False)
    running = key()
    store.enqueue(running, TargetEnvironment.exactly(H200))
    store.claim(H200, "h200-node-7", lease_seconds=120)
    stranded = [key(), key()]
    for k in stranded:
        store.enqueue(k, TargetEnvironment(sm=80), source="auto")
    queued = key()
    store.enqueue(queued, TargetEnvironment(sm=90), source="capture")
    registered = key()
    for _ in range(2):
        store.record_misses(H200, [failed, running, queued, registered, "e" * 64])
    store.record_misses(A100, stranded)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_chromium_renders_the_page(tmp_path, make_spec, make_plan):
    """Headless Chromium renders the page of a realistic store (docs/status-page.png is this screenshot:
    UPDATE_STATUS_SCREENSHOT=1 retakes it), and, without open reads, the sign-in form."""
    from datetime import UTC, datetime, timedelta

    from plancache.store import open_store
    from tests.conftest import FakeClock

    clock = FakeClock(datetime.now(UTC) - timedelta(hours=3, minutes=25))  # the seed's history ends now

    store = open_store(f"sqlite:///{tmp_path / 'ui.db'}", create=True, clock=clock)
    realistic(store, make_spec, make_plan, clock)
    shot = tmp_path / "status.png"
    flags = [*FLAGS, f"--user-data-dir={tmp_path / 'p'}"]
    with LiveServer(tmp_path / "srv", store=store, open_reads=True) as srv:
        dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", f"{srv.url}/ui"], capture_output=True, text=True,
                             timeout=120)
        subprocess.run([CHROMIUM, *flags, "--window-size=1240,3000", f"--screenshot={shot}", f"{srv.url}/ui"],
                       capture_output=True, timeout=120, check=True)
    with LiveServer(tmp_path / "srv2", store=store) as srv:
        login = subprocess.run([CHROMIUM, *flags, "--dump-dom", f"{srv.url}/ui"], capture_output=True, text=True,
                               timeout=120)
    store.close()
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Plan coverage by environment" in dom.stdout and "<rect" in dom.stdout  # the DOM the browser built
    assert "2 queued jobs no serving worker can take" in dom.stdout and "NVIDIA H100 PCIe sm_90 x114 SMs" in dom.stdout
    assert "<script" not in dom.stdout
    assert 'action="/ui/login"' in login.stdout and 'type="password"' in login.stdout, login.stdout[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    docs_shot = Path(__file__).resolve().parents[2] / "docs" / "status-page.png"
    if os.environ.get("UPDATE_STATUS_SCREENSHOT"):  # UPDATE_STATUS_SCREENSHOT=1 pytest -k chromium: retake it
        shutil.copyfile(shot, docs_shot)
    assert docs_shot.is_file(), "docs/ shows a screenshot of the page taken this way"


def test_a_missed_graph_whose_plan_is_older_than_the_plans_shown_is_not_counted_as_without_a_plan(
        store, make_spec, make_plan, gpu_env, clock, monkeypatch):
    """The page read the newest PLANS_SHOWN plans and counted every missed key outside them as "missed, no plan":
    a graph missed before it was tuned (its miss row stays) whose plan was older showed as having none."""
    from plancache.server import status_page

    monkeypatch.setattr(status_page, "PLANS_SHOWN", 1)
    (old, old_spec), (new, new_spec) = make_spec(0), make_spec(1)
    store.put_spec(old, old_spec)
    store.put_spec(new, new_spec)
    store.record_misses(gpu_env, [old])
    store.publish_plan(*make_plan(old, gpu_env, blob=b"old"))
    clock.advance(60)
    store.publish_plan(*make_plan(new, gpu_env, blob=b"new"))
    with open_api(store) as api:
        page = api.client.get("/ui", headers=api.reader).text
    row = next(r for r in page.split("<tr>") if r.startswith(f"<td>{gpu_env.describe()}"))
    assert "<td class='n'>1</td><td class='n'>0</td></tr>" in row, row   # 1 plan shown; no missed graph lacks one
    assert "a tuned plan exists" in page


BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def test_a_browser_signs_in_with_a_reader_token_into_an_httponly_strict_cookie(store):
    token, _ = store.create_token("people", "reader")
    with open_api(store) as api:
        asked = api.client.get("/ui", headers=BROWSER)  # no token, no open reads: the form, not a JSON error
        assert asked.status_code == 401 and asked.headers["content-type"].startswith("text/html")
        assert "<form method='post' action='/ui/login'>" in asked.text and "name='token'" in asked.text
        assert api.client.get("/ui").json()["error"]["code"] == "unauthorized"  # an API client: JSON, as before

        r = api.client.post("/ui/login", content=f"token={token}", headers=FORM, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui"
        cookie = r.headers["set-cookie"]
        attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")}
        assert cookie.startswith(f"plancache_session={token};") and {"httponly", "path", "max-age"} <= attrs
        assert "samesite=strict" in cookie.lower() and "path=/ui" in cookie.lower() and "secure" not in attrs

        page = api.client.get("/ui", headers=BROWSER)
        assert page.status_code == 200 and "signed in as people" in page.text and "action='/ui/logout'" in page.text
        assert "form-action 'self'" in page.headers["content-security-policy"]
        # the cookie is the page's alone: an API route does not take it
        assert api.client.post("/v1/plans/resolve", json={}).status_code == 401

        out = api.client.post("/ui/logout", headers=FORM)
        assert out.status_code == 200 and "signed out" in out.text and 'plancache_session=""' in out.headers["set-cookie"]
        assert api.client.get("/ui", headers=BROWSER).status_code == 401


def test_the_cookie_is_secure_over_https_and_a_revoked_token_signs_out(store):
    token, _ = store.create_token("people", "reader")
    with open_api(store, token_cache_seconds=0) as api:
        r = api.client.post("/ui/login", content=f"token={token}", follow_redirects=False,
                            headers={**FORM, "X-Forwarded-Proto": "https"})
        assert r.status_code == 303 and "secure" in {a.strip().lower() for a in r.headers["set-cookie"].split(";")}
        api.client.cookies.set("plancache_session", token, path="/ui")
        assert api.client.get("/ui", headers=BROWSER).status_code == 200
        store.revoke_token("people")
        again = api.client.get("/ui", headers=BROWSER)
    assert again.status_code == 401 and "action='/ui/login'" in again.text
    assert 'plancache_session=""' in again.headers["set-cookie"]  # the stale cookie is cleared


@pytest.mark.parametrize(("role", "reason"), [("worker", "a worker token is refused here"),
                                              ("admin", "an admin token is refused here")])
def test_only_a_reader_token_is_kept_in_a_cookie(store, role, reason):
    token, _ = store.create_token(f"t-{role}", role)
    with open_api(store) as api:
        r = api.client.post("/ui/login", content=f"token={token}", headers=FORM, follow_redirects=False)
    assert r.status_code == 401 and "set-cookie" not in r.headers and "sign in with a reader token" in r.text


def test_a_bad_sign_in_is_refused_with_a_reason(store):
    with open_api(store) as api:
        wrong = api.client.post("/ui/login", content="token=pct_not-a-token", headers=FORM, follow_redirects=False)
        assert wrong.status_code == 401 and "unknown or revoked token" in wrong.text and "set-cookie" not in wrong.headers
        assert api.client.post("/ui/login", content="token=", headers=FORM).status_code == 401
        other_site = api.client.post("/ui/login", content="token=x", follow_redirects=False,
                                     headers={**FORM, "Origin": "https://evil.example"})
        assert other_site.status_code == 403 and other_site.json()["error"]["code"] == "forbidden"
        assert api.client.post("/ui/login", json={"token": "x"}).status_code == 415
        many = api.client.post("/ui/login", content="&".join(f"f{i}=1" for i in range(20)), headers=FORM)
        assert many.status_code == 422 and many.json()["error"]["code"] == "invalid_value"
        big = api.client.post("/ui/login", content="token=" + "a" * 5000, headers=FORM)
        assert big.status_code == 413
        assert api.client.post("/ui/logout", headers={"Origin": "https://evil.example"}).status_code == 403


def test_workers_panel_flags_queued_jobs_no_serving_worker_can_take(store, make_spec, gpu_env, clock):
    from tests.factories import OTHER_GPU

    (here, spec_here), (there, spec_there) = make_spec(0), make_spec(1)
    store.put_spec(here, spec_here)
    store.put_spec(there, spec_there)
    store.claim(OTHER_GPU, "w-a100", lease_seconds=60)  # a worker on the A100 claimed (nothing queued) ...
    clock.advance(2 * 3600)  # ... two hours ago: gone
    store.claim(gpu_env, "w-h200", lease_seconds=60)  # the H200's worker claims now
    store.enqueue(here, TargetEnvironment(sm=gpu_env.sm))
    store.enqueue(there, TargetEnvironment(sm=OTHER_GPU.sm))
    with open_api(store) as api:
        page = api.client.get("/ui", headers=api.reader).text
    workers = page.split("<h2>Workers</h2>", 1)[1].split("<h2>", 1)[0]
    h200 = next(r for r in workers.split("<tr>") if gpu_env.env_id[:12] in r)
    a100 = next(r for r in workers.split("<tr>") if OTHER_GPU.env_id[:12] in r)
    assert "claiming now" in h200 and "gone" in a100 and "2 h ago" in a100
    assert "1 queued job no serving worker can take" in workers and "sm_80 (1)" in workers
    rows = [r for r in page.split("<tr") if "(no serving worker)" in r]
    assert len(rows) == 1 and there[:12] in rows[0]


def test_failures_are_listed_above_successes_even_when_older_than_the_jobs_shown(
        store, make_spec, make_plan, gpu_env, monkeypatch):
    from plancache.server import status_page

    monkeypatch.setattr(status_page, "JOBS_SHOWN", 2)
    keys = []
    for i in range(4):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        keys.append(key)
    failed, _ = store.enqueue(keys[0], TargetEnvironment(sm=gpu_env.sm), max_attempts=1)
    claim = store.claim(gpu_env, "w1", lease_seconds=60)
    store.fail(failed.id, "w1", claim.lease_token, "no candidate passed the numerics check", retryable=False)
    for key in keys[1:]:  # three newer jobs, two of them among the newest JOBS_SHOWN
        store.enqueue(key, TargetEnvironment(sm=gpu_env.sm))
    with open_api(store) as api:
        page = api.client.get("/ui", headers=api.reader).text
    jobs = page.split("<h2>Jobs: failures first</h2>", 1)[1].split("<h2>", 1)[0]
    rows = jobs.split("<tr")[2:]  # after the header
    assert rows[0].startswith(" class='pinned'>") and "GET /v1/jobs/" in rows[0]  # the error itself is for admins
    assert [re.search(r"<td class='(\w+)'>\1</td>", r).group(1) for r in rows] == ["failed", "queued", "queued"]


def test_environment_labels_and_counts_are_whole(store, make_spec, make_plan, gpu_env):
    env = gpu_env.model_copy(update={"device_name": "NVIDIA H200 NVL 141GB HBM3e with a long product name"})
    for i in range(3):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        store.publish_plan(*make_plan(key, env, blob=f"b{i}".encode()))
    with open_api(store) as api:
        page = api.client.get("/ui", headers=api.reader).text
    assert f"<td>{env.describe()}</td>" in page  # not cut at 58 characters
    assert "3 / 3<div class='bar'" in page
