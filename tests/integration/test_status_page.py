"""The status page (``GET /ui``): what it shows of a seeded store, who may read it, that stored text is escaped,
and that a real browser (headless Chromium from Debian's ``chromium`` package) renders it."""

from __future__ import annotations

import os
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
    for heading in ("Plan coverage by environment", "Most missed graphs", "Queue and recent jobs",
                    "Tuned versus heuristic"):
        assert heading in page
    assert gpu_env.describe() in page and "2 / 6" in page  # 2 graphs planned of 6 planned or missed
    assert "the spec is registered, missed 1 time on" in page and "autotune queues it at 3 misses" in page
    assert "never seen this graph&#x27;s spec" in page
    assert "queued for tuning (job" in page  # the reasons of POST /v1/plans/explain
    # a worker's error text is for admins (GET /v1/jobs/{id}); the page, a reader's, says where to read it
    assert "no candidate passed" not in page and "attempts): an admin reads its error (GET /v1/jobs/1" in page
    assert "2.00x" in page and "3.00x" in page  # heuristic / tuned
    assert keys["unknown"][:12] in page and page.count("<svg") == 2


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


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_chromium_renders_the_page(tmp_path, make_spec, make_plan, gpu_env):
    from plancache.store import open_store

    store = open_store(f"sqlite:///{tmp_path / 'ui.db'}", create=True)
    seed(store, make_spec, make_plan, gpu_env)
    shot = tmp_path / "status.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'p'}"]
    with LiveServer(tmp_path / "srv", store=store, open_reads=True) as srv:
        dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", f"{srv.url}/ui"], capture_output=True, text=True,
                             timeout=120)
        subprocess.run([CHROMIUM, *flags, "--window-size=1240,1500", f"--screenshot={shot}", f"{srv.url}/ui"],
                       capture_output=True, timeout=120, check=True)
    store.close()
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Plan coverage by environment" in dom.stdout and "<rect" in dom.stdout  # the DOM the browser built
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
