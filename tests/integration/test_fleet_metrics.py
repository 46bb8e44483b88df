"""Metrics an operator scales and alerts on: the fleet's queue, misses and workers per GPU environment, reported
the same by every replica, so that the KEDA query of deploy/ (``max by`` over replicas) counts each job once with
two replicas; ``/metrics`` and ``/readyz`` answer within their bound while the database hangs; blob-store errors,
client rejects and the build are counted."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from plancache import __version__
from plancache.errors import BlobStoreUnavailable
from plancache.http import API_VERSION
from plancache.protocol import TargetEnvironment
from plancache.server import create_app
from plancache.server.bounded import Bounded
from plancache.server.metrics import ENV_LABELS
from plancache.settings import Settings
from plancache.store import open_store
from tests.factories import H200, OTHER_GPU
from tests.server_util import ADMIN_TOKEN, bearer

ROOT = Path(__file__).resolve().parents[2]
KEDA = ROOT / "deploy" / "kubernetes" / "40-keda.yaml"


def keda_query() -> str:
    (doc,) = [d for d in yaml.safe_load_all(KEDA.read_text()) if d]
    (trigger,) = doc["spec"]["triggers"]
    return str(trigger["metadata"]["query"])


def evaluate(query: str, scrapes: list[str]) -> float:
    """``sum(max by (LABELS) (METRIC{label=~"re", …}))`` over the samples of ``scrapes`` (one per replica), as
    Prometheus evaluates it: the only query shape deploy/'s KEDA example uses."""
    m = re.fullmatch(r"sum\(max by \(([\w, ]+)\) \((\w+)\{(.*)\}\)\)", " ".join(query.split()))
    assert m, query
    by = [s.strip() for s in m.group(1).split(",")]
    matchers = dict(re.findall(r'(\w+)=~"([^"]*)"', m.group(3)))
    groups: dict[tuple[str, ...], float] = {}
    for text in scrapes:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != m.group(2):
                    continue
                if all(re.fullmatch(rx, sample.labels.get(name, "")) for name, rx in matchers.items()):
                    key = tuple(sample.labels[b] for b in by)
                    groups[key] = max(groups.get(key, 0.0), sample.value)
    return sum(groups.values())


def sample(text: str, name: str, labels: dict[str, str]) -> float:
    """The value of the sample ``name{labels}`` in the exposition ``text``."""
    (value,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and s.labels == labels]
    return float(value)


def replica(store: Any) -> TestClient:
    return TestClient(create_app(Settings(database_url="sqlite:///unused.db", admin_token=ADMIN_TOKEN), store=store))


@pytest.fixture
def store(tmp_path):
    with open_store(f"sqlite:///{tmp_path / 'db.sqlite'}", create=True) as s:
        yield s


def h200_target(**open_fields: None) -> TargetEnvironment:
    return TargetEnvironment(**{**H200.validity(), **open_fields})


def test_two_replicas_report_the_queue_once_per_gpu_type_and_keep_running_jobs(store, make_spec):
    """Before: each replica reported the database-wide plancache_jobs and KEDA summed them (twice the queue with two
    replicas), with no environment label (every GPU type scaled on every queue) and without running jobs."""
    keys = []
    for i in range(5):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        keys.append(key)
    store.enqueue(keys[0], h200_target())                    # H200's exact environment
    store.enqueue(keys[1], h200_target(cudnn_version=None))  # any cuDNN on that GPU: H200 workers take it too
    store.enqueue(keys[2], TargetEnvironment(sm=90))         # any sm_90 GPU
    store.enqueue(keys[3], TargetEnvironment(**OTHER_GPU.validity()))  # another GPU type: not H200's
    store.enqueue(keys[4], h200_target())
    assert store.claim(H200, "w-1", lease_seconds=60) is not None  # running: keeps its worker
    store.record_misses(H200, keys[:3])
    with replica(store) as a, replica(store) as b:
        scrapes = [a.get("/metrics").text, b.get("/metrics").text]
    query = keda_query()
    assert evaluate(query, scrapes) == 4  # keys 0, 1, 2 and 4; one of them running; once, not once per replica
    assert evaluate(query.replace('"queued|running"', '"queued"'), scrapes) == 3
    assert evaluate(query.replace("max by", "max by"), scrapes[:1]) == 4  # one replica says the same
    naive = [s for t in scrapes for s in t.splitlines() if s.startswith('plancache_jobs{status="queued"}')]
    assert sum(float(s.split()[-1]) for s in naive) == 8  # the old query: sum over replicas, every GPU type
    h200 = {label: str(value) for label, value in zip(ENV_LABELS, H200.validity().values(), strict=True)}
    for text in scrapes:
        assert sample(text, "plancache_fleet_missed_keys", h200) == 3
        assert sample(text, "plancache_fleet_misses", h200) == 3
        assert time.time() - sample(text, "plancache_fleet_worker_last_claim_timestamp_seconds", h200) < 60
        assert sample(text, "plancache_build_info", {"api_version": API_VERSION, "release": __version__}) == 1
        assert sample(text, "plancache_store_up", {}) == 1


def test_metrics_and_readyz_answer_within_their_bound_while_the_database_hangs(store):
    """Before: both waited on the database for as long as its connection hung."""
    hang = threading.Event()
    calls = {"ping": 0}

    def hung(*_a: Any, **_k: Any) -> Any:
        calls["ping"] += 1
        hang.wait(30)
        raise TimeoutError("released")

    bound = 0.3
    with replica(store) as api:
        assert api.get("/readyz").status_code == 200
        api.app.state.readiness.timeout = api.app.state.metrics.store_figures.read.timeout = bound  # STORE_WAIT
        api.app.state.metrics.store_figures.read.max_age = 0
        store.ping = store.job_counts = store.fleet_counts = hung  # type: ignore[method-assign]
        try:
            for _ in range(2):
                t0 = time.monotonic()
                ready = api.get("/readyz")
                assert time.monotonic() - t0 < bound + 1.0
                assert ready.status_code == 503 and ready.json()["error"]["code"] == "database_unavailable"
                t0 = time.monotonic()
                metrics = api.get("/metrics")
                assert time.monotonic() - t0 < bound + 1.0
                assert metrics.status_code == 200 and "plancache_store_up 0.0" in metrics.text
                assert "plancache_http_requests_total" in metrics.text  # the process's own figures still come
            assert calls["ping"] == 2  # one hung ping and one hung scrape, shared by the later requests
        finally:
            hang.set()


def test_bounded_shares_one_call_and_keeps_its_result_for_max_age():
    gate, calls = threading.Event(), []

    def slow() -> int:
        calls.append(1)
        gate.wait(5)
        return len(calls)

    bounded = Bounded(slow, timeout=0.05, max_age=60)
    for _ in range(3):
        with pytest.raises(TimeoutError):
            bounded.get()
    gate.set()
    time.sleep(0.05)
    assert bounded.get() == 1 and bounded.get() == 1 and len(calls) == 1


def test_blob_store_errors_and_client_rejects_are_counted(store):
    reader, _ = store.create_token("r", "reader")
    with replica(store) as api:
        def unavailable(*_a: Any) -> Any:
            raise BlobStoreUnavailable("the bucket does not answer")

        store.get_blob_up_to = unavailable  # type: ignore[method-assign]
        assert api.get(f"/v1/blobs/{'a' * 64}", headers=bearer(reader)).status_code == 503
        sent = api.post("/v1/reports/rejects", json={"rejects": {"unknown_signer": 3, "sha256": 1}},
                        headers=bearer(reader))
        assert sent.status_code == 204
        refused = [api.post("/v1/reports/rejects", json=body, headers=bearer(reader)).status_code for body in (
            {"rejects": {"made_up_reason": 1}}, {"rejects": {}}, {"rejects": {"sha256": 0}}, {"rejects": {"sha256": 1},
                                                                                           "extra": 1})]
        assert refused == [422] * 4
        assert api.post("/v1/reports/rejects", json={"rejects": {"sha256": 1}}).status_code == 401
        text = api.get("/metrics").text
    assert 'plancache_blob_store_errors_total{code="blob_store_unavailable"} 1.0' in text
    assert 'plancache_client_rejects_total{reason="unknown_signer"} 3.0' in text
    assert 'plancache_client_rejects_total{reason="sha256"} 1.0' in text


def test_a_client_reports_its_rejects_to_the_server_when_it_closes(tmp_path):
    """Before: a client's rejects (a plan signed by a key it does not trust) never reached the server."""
    from plancache.client import PlanCache
    from plancache.spec import parse_spec
    from tests.client_fakes import RecordingBackend
    from tests.factories import PATIENT, make_meta, new_signer, trusted
    from tests.live_server import LiveServer

    spec = parse_spec((ROOT / "examples" / "conv_bias_relu.json").read_text())
    blob = b"a plan" * 50
    with LiveServer(tmp_path / "server") as srv:
        srv.store.put_spec(spec.graph_key, spec.to_json())
        srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, new_signer()), blob)  # a key not trusted
        with PlanCache(srv.url, backend=RecordingBackend(), token=srv.token("reader"), cache_dir=tmp_path / "cache",
                       trusted_keys=trusted(new_signer()), **PATIENT) as pc:
            pc.plan(spec)
            assert pc.stats().rejects == {"unknown_signer": 1}
        import httpx

        text = httpx.get(f"{srv.url}/metrics").text
    assert sample(text, "plancache_client_rejects_total", {"reason": "unknown_signer"}) == 1
