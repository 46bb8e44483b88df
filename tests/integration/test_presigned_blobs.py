"""Blobs off the API server: a server whose blobs are in object storage (moto's S3 server) answers resolve with
presigned GET URLs; the client fetches the bytes there without its token, checks them as any others, and falls back
to the server's route once when a URL fails. Folder and database stores still answer the server's route. A client of
an https server refuses plain-http presigned URLs unless told otherwise."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import obstore
import obstore.store
import pytest

import plancache.client.server_step as server_step
from plancache.blobs.base import shard
from plancache.client import PlanCache
from plancache.protocol import ResolvedPlan, ResolveResponse
from plancache.store import open_store
from tests.client_fakes import RecordingBackend
from tests.factories import H200, PATIENT, make_meta, make_record, new_signer, trusted
from tests.live_server import LiveServer
from tests.server_util import api, open_api  # noqa: F401 (fixture)

from .test_client_ladder import CONV, SDPA, SPECS, blob_of


class Capture(httpx.HTTPTransport):
    """The real network, recording each request's host, path and headers; may rewrite resolve answers."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, httpx.Headers]] = []
        self.edit_url: Any = None  # (key, url) -> url, applied to each plan of a resolve answer

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.netloc.decode(), request.url.path, request.headers))
        resp = super().handle_request(request)
        if request.url.path != "/v1/plans/resolve" or self.edit_url is None:
            return resp
        answer = json.loads(resp.read())
        for key, plan in answer["plans"].items():
            plan["blob_url"] = self.edit_url(key, plan["blob_url"])
        return httpx.Response(200, json=answer)


@pytest.fixture
def signer() -> Any:
    return new_signer()


@pytest.fixture
def s3_server(tmp_path: Path, s3_blob_url: str) -> Iterator[LiveServer]:
    """A live server (SQLite) whose blobs are in a fresh moto bucket, presigning on (the default)."""
    with open_store(f"sqlite:///{tmp_path / 'srv.db'}", create=True, blob_store=s3_blob_url) as store, \
            LiveServer(tmp_path, store=store, blob_store=s3_blob_url) as srv:
        yield srv


def seed(srv: LiveServer, spec: Any, signer: Any) -> bytes:
    blob = blob_of(spec)
    srv.store.put_spec(spec.graph_key, spec.to_json())
    srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, signer), blob)
    return blob


def client(srv: LiveServer, tmp_path: Path, signer: Any, wire: Capture) -> PlanCache:
    return PlanCache(srv.url, backend=RecordingBackend(), token=srv.token("reader"), trusted_keys=trusted(signer),
                     cache_dir=tmp_path / "cache", transport=wire, **PATIENT)


def test_resolve_answers_presigned_urls_that_work_without_a_token_and_expire(tmp_path, s3_blob_url, moto_s3, signer):
    """moto's server does not enforce a presigned URL's expiry, so the signed expiry itself is checked."""
    with open_store(f"sqlite:///{tmp_path / 'a.db'}", create=True, blob_store=s3_blob_url) as store, \
            open_api(store, presign_seconds=2) as api:
        blob = blob_of(CONV)
        store.put_spec(CONV.graph_key, CONV.to_json())
        store.publish_plan(make_meta(CONV.graph_key, H200, blob, signer), blob)
        for include_blobs in (False, True):  # never inline: the bytes bypass the API server
            body = {"environment": H200.model_dump(), "graph_keys": [CONV.graph_key], "include_blobs": include_blobs}
            plan = api.client.post("/v1/plans/resolve", json=body, headers=api.reader).json()["plans"][CONV.graph_key]
            assert plan["blob_b64"] is None and plan["blob_url"].startswith(moto_s3 + "/")
            url = plan["blob_url"]
            query = parse_qs(urlsplit(url).query)
            signed_at = datetime.strptime(query["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
            assert query["X-Amz-Expires"] == ["2"] and abs((signed_at - datetime.now(UTC)).total_seconds()) < 5
            assert "X-Amz-Signature" in query and "X-Amz-Credential" in query
            got = httpx.get(url, timeout=10)  # no Authorization header, no AWS credentials
            assert got.status_code == 200 and got.content == blob


@pytest.mark.parametrize("blob_store_url", ["database", "file"], indirect=True)
def test_folder_and_database_stores_answer_the_servers_route(api, gpu_env, make_plan, make_spec):
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env)
    api.store.put_spec(key, spec)
    api.store.publish_plan(meta, blob)
    body = {"environment": gpu_env.model_dump(), "graph_keys": [key]}
    plan = api.client.post("/v1/plans/resolve", json=body, headers=api.reader).json()["plans"][key]
    assert plan["blob_url"] == f"/v1/blobs/{meta.blob_sha256}" and api.app.state.settings.presign_blobs


def test_presigning_off_answers_the_servers_route(tmp_path, s3_blob_url, signer):
    with open_store(f"sqlite:///{tmp_path / 'a.db'}", create=True, blob_store=s3_blob_url) as store, \
            open_api(store, presign_blobs=False) as api:
        blob = blob_of(CONV)
        store.put_spec(CONV.graph_key, CONV.to_json())
        store.publish_plan(make_meta(CONV.graph_key, H200, blob, signer), blob)
        body = {"environment": H200.model_dump(), "graph_keys": [CONV.graph_key], "include_blobs": True}
        plan = api.client.post("/v1/plans/resolve", json=body, headers=api.reader).json()["plans"][CONV.graph_key]
        assert plan["blob_url"] is None and plan["blob_b64"] is not None  # inline again, as for a folder


def test_the_client_loads_through_presigned_urls_without_sending_its_token(s3_server, moto_s3, tmp_path, signer):
    blobs = {spec.graph_key: seed(s3_server, spec, signer) for spec in (CONV, SDPA)}
    wire = Capture()
    pc = client(s3_server, tmp_path, signer, wire)
    plans = pc.prefetch([CONV, SDPA])
    assert {k: p.source for k, p in plans.items()} == {k: "server" for k in blobs}
    assert sorted(pc._backend.deserialized) == sorted(blobs.values())
    s = pc.stats()
    assert s.blob_sources == {"presigned": 2} and s.presigned_fallbacks == 0 and s.rejects == {}
    moto_host = urlsplit(moto_s3).netloc
    to_store = [headers for host, _, headers in wire.seen if host == moto_host]
    to_server = [(path, headers) for host, path, headers in wire.seen if host != moto_host]
    assert len(to_store) == 2 and all("authorization" not in h for h in to_store)
    assert [p for p, _ in to_server] == ["/v1/plans/resolve"] and "authorization" in to_server[0][1]
    assert s3_server.requests["/v1/blobs/" + hashlib.sha256(blobs[CONV.graph_key]).hexdigest()] == 0


def test_tampered_bytes_in_the_object_store_are_rejected(s3_server, s3_blob_url, tmp_path, signer):
    blob = seed(s3_server, CONV, signer)
    sha = hashlib.sha256(blob).hexdigest()
    forged = blob[:-1] + bytes([blob[-1] ^ 1])  # same size, other bytes: planted behind the server's back
    obstore.put(obstore.store.from_url(s3_blob_url), shard(sha), forged)
    pc = client(s3_server, tmp_path, signer, Capture())
    plan = pc.plan(CONV)
    s = pc.stats()
    assert s.blob_sources == {"presigned": 1} and s.rejects == {"sha256": 1}
    assert plan.source == "rebuild" and pc._backend.deserialized == []  # the authentic record's engine config


@pytest.mark.parametrize("how", ["not_found", "unreachable"])
def test_a_failed_presigned_get_falls_back_to_the_servers_route_once(s3_server, tmp_path, signer, how):
    blob = seed(s3_server, CONV, signer)
    wire = Capture()
    if how == "not_found":  # an error answer from the store, as for an expired URL (403)
        wire.edit_url = lambda key, url: url.replace("/blobs/", "/elsewhere/")
    else:
        wire.edit_url = lambda key, url: "http://127.0.0.1:9" + url[url.index("/", len("http://")):]
    pc = client(s3_server, tmp_path, signer, wire)
    plan = pc.plan(CONV)
    s = pc.stats()
    assert plan.source == "server" and pc._backend.deserialized == [blob]
    assert s.blob_sources == {"server": 1} and s.presigned_fallbacks == 1 and s.remote_errors == 0
    assert s3_server.requests[f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}"] == 1


class Slow(Capture):
    """Object-store GETs take 0.2 s each; counts how many are in flight at once."""

    def __init__(self, store_host: str) -> None:
        super().__init__()
        self.store_host, self.now, self.most = store_host, 0, 0
        self.lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.netloc.decode() != self.store_host:
            return super().handle_request(request)
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.2)
            return super().handle_request(request)
        finally:
            with self.lock:
                self.now -= 1


def test_blobs_are_fetched_concurrently_a_few_at_a_time(s3_server, moto_s3, tmp_path, signer, monkeypatch):
    monkeypatch.setattr(server_step, "FETCH_THREADS", 2)
    specs = list(SPECS.values())
    for spec in specs:
        seed(s3_server, spec, signer)
    wire = Slow(urlsplit(moto_s3).netloc)
    pc = client(s3_server, tmp_path, signer, wire)
    assert {p.source for p in pc.prefetch(specs).values()} == {"server"}
    assert pc.stats().blob_sources == {"presigned": len(specs)} and wire.most == 2  # 5 blobs, 2 at a time


class PresigningFake:
    """A server whose resolve answers give each blob as a presigned URL of ``{scheme}://store.test``, and that
    store, on ``httpx.MockTransport``; each request's scheme, host and path are recorded."""

    def __init__(self, scheme: str, signer: Any) -> None:
        self.scheme = scheme
        self.blobs = {spec.graph_key: blob_of(spec) for spec in (CONV, SDPA)}
        self.records = {key: make_record(key, H200, blob, signer) for key, blob in self.blobs.items()}
        self.seen: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(f"{request.url.scheme}://{request.url.host}{request.url.path}")
        if request.url.path == "/v1/plans/resolve":
            urls = {k: f"{self.scheme}://store.test/bucket/{r.blob_sha256}?X-Amz-Signature=1"
                    for k, r in self.records.items()}
            plans = {k: ResolvedPlan(record=self.records[k], blob_url=urls[k])
                     for k in json.loads(request.content)["graph_keys"]}
            return httpx.Response(200, content=ResolveResponse(plans=plans, missing=[]).model_dump_json())
        sha = request.url.path.rsplit("/", 1)[-1]
        return httpx.Response(200, content=next(b for k, b in self.blobs.items() if self.records[k].blob_sha256 == sha))


@pytest.mark.parametrize(("server", "store", "opt_in", "presigned"), [
    ("https", "http", False, False),  # the downgrade: refused, fetched from the server
    ("https", "http", True, True),  # PLANCACHE_INSECURE_ALLOW_HTTP_PRESIGNED: the operator's choice
    ("http", "http", False, True),  # nothing to downgrade
    ("https", "https", False, True),
])
def test_a_client_of_an_https_server_refuses_plain_http_presigned_urls(tmp_path, signer, monkeypatch, caplog, server,
                                                                       store, opt_in, presigned):
    """An http presigned URL was fetched by a client whose server is https: the plan bytes (and which plans a host
    loads) in clear text, and an on-path attacker able to stall or corrupt them into fallbacks."""
    if opt_in:
        monkeypatch.setenv("PLANCACHE_INSECURE_ALLOW_HTTP_PRESIGNED", "1")
    fake = PresigningFake(store, signer)
    pc = PlanCache(f"{server}://plancache.test", backend=RecordingBackend(), token="t", trusted_keys=trusted(signer),
                   cache_dir=tmp_path / "cache", transport=httpx.MockTransport(fake))
    with caplog.at_level(logging.INFO, logger="plancache"):
        plans = pc.prefetch([CONV, SDPA])
    assert {p.source for p in plans.values()} == {"server"}
    assert sorted(pc._backend.deserialized) == sorted(fake.blobs.values())
    s = pc.stats()
    to_store = [u for u in fake.seen if "store.test" in u]
    if presigned:
        assert s.blob_sources == {"presigned": 2} and s.presigned_fallbacks == 0 and len(to_store) == 2
    else:
        assert s.blob_sources == {"server": 2} and s.presigned_fallbacks == 2 and to_store == []
        assert sorted(u for u in fake.seen if u.startswith("https://plancache.test/v1/blobs/")) == sorted(
            f"https://plancache.test/v1/blobs/{r.blob_sha256}" for r in fake.records.values())
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "PLANCACHE_INSECURE_ALLOW_HTTP_PRESIGNED" in warned[0].getMessage()
