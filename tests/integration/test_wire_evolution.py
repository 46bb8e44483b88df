"""Releases of one fleet talk across a wire that evolves (docs/DEPLOYMENT.md "Upgrades"): a client and a worker of
this release work against a later server whose answers carry fields they do not know, and against an earlier
server that sends no API version; every caller names its agent and release, which the server counts."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from plancache import __version__
from plancache.client import PlanCache
from plancache.client.remote import Remote
from plancache.http import API_VERSION, API_VERSION_HEADER, USER_AGENT_PATTERN, Backoff, Retry, user_agent
from plancache.protocol import ClaimRequest, ResolveResponse, TargetEnvironment, TuneRequest
from plancache.signing import Signer, TrustedKeys, keygen
from plancache.spec import parse_spec
from plancache.validation import from_answer
from plancache.worker import JobsApi, Spool, Worker
from tests.client_fakes import RecordingBackend
from tests.factories import H200, PATIENT, make_meta, new_signer, trusted
from tests.live_server import LiveServer
from tests.worker_fakes import FAKE_ENV, FakeTuner

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONV = parse_spec((EXAMPLES / "conv_bias_relu.json").read_text())
SDPA = parse_spec((EXAMPLES / "sdpa_causal.json").read_text())
#: Answer fields that are maps (graph key -> entry, knob -> value, native kernel -> ms) or documents (a spec): a later
#: release adds no key to them, only to the objects inside the maps (a record naming a native kernel this release
#: does not know is read, tests/unit/test_record_bounds.py).
MAPS = frozenset({"plans", "reasons", "knobs", "native_median_ms"})
DOCUMENTS = frozenset({"spec"})
ONCE = Retry(Backoff(initial=0.05, cap=0.2), within=2.0)
FUTURE = {"added_in_a_later_release": {"nested": [1, "two"]}}


def with_future_fields(node: Any, *, is_map: bool = False) -> Any:
    """``node`` with :data:`FUTURE` added to every object of it (not to maps, nor inside documents)."""
    if isinstance(node, list):
        return [with_future_fields(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in DOCUMENTS else with_future_fields(v, is_map=k in MAPS) for k, v in node.items()}
    return out if is_map else {**out, **FUTURE}


class LaterServer:
    """ASGI middleware playing a server of a later minor API version: each JSON answer gains unknown fields at every
    depth. ``earlier=True`` plays an earlier server instead: no API version header, a bare ``/healthz``."""

    def __init__(self, app: Any, *, earlier: bool = False) -> None:
        self.app, self.earlier, self.rewritten = app, earlier, 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        body = bytearray()

        async def hold(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            headers = [(k, v) for k, v in start["headers"] if k not in (b"content-length",)]
            content = bytes(body)
            if self.earlier:
                headers = [(k, v) for k, v in headers if k != API_VERSION_HEADER.lower().encode()]
                if scope["path"] == "/healthz":
                    content = b'{"status":"ok"}'
            elif dict(headers).get(b"content-type", b"").startswith(b"application/json") and content:
                content = json.dumps(with_future_fields(json.loads(content))).encode()
                self.rewritten += 1
            await send({**start, "headers": [*headers, (b"content-length", str(len(content)).encode())]})
            await send({"type": "http.response.body", "body": content})

        await self.app(scope, receive, hold)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, TrustedKeys]:
    priv, pub, _ = keygen(tmp_path / "keys", "worker")
    return priv, TrustedKeys.from_files([pub])


def serve(tmp_path: Path, *, earlier: bool = False) -> tuple[LiveServer, LaterServer]:
    srv = LiveServer(tmp_path / "server")
    srv.app = wrapped = LaterServer(srv.app, earlier=earlier)  # LiveServer calls self.app per request
    return srv, wrapped


def test_unknown_fields_at_any_depth_are_ignored_in_answers_and_refused_in_requests():
    record = make_meta(CONV.graph_key, H200, b"x" * 64, new_signer())
    answer = {"plans": {CONV.graph_key: {"record": {**record.model_dump(mode="json"), "env_id": "e" * 32,
                                                    "created_at": "2026-01-01T00:00:00Z"},
                                         "blob_b64": None}}, "missing": []}
    later = json.dumps(with_future_fields(answer))
    assert from_answer(ResolveResponse, later).plans[CONV.graph_key].record.engine_id == record.engine_id
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        ResolveResponse.model_validate_json(later)  # the model itself stays strict: the server reads requests so
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        ClaimRequest.model_validate({"environment": FAKE_ENV.model_dump(), "worker_id": "w", **FUTURE})


def test_a_client_and_a_worker_work_against_a_later_server_that_added_fields(tmp_path, keys):
    key, trusted_keys = keys
    srv, later = serve(tmp_path)
    with srv:
        with JobsApi.open(srv.url, srv.admin_token, retry=ONCE) as admin:
            Remote(admin.http).register_spec(SDPA)
            jobs = admin.enqueue(TuneRequest(graph_keys=[SDPA.graph_key], targets=[TargetEnvironment()]))
            assert jobs[0].graph_key == SDPA.graph_key
        worker = Worker(JobsApi.open(srv.url, srv.token("worker"), retry=ONCE), FakeTuner(), Signer.from_file(key),
                        Spool(tmp_path / "spool"), worker_id="w-old", poll_interval=0.05, once=True)
        stats = worker.run(threading.Event())
        assert (stats.claimed, stats.succeeded, stats.failed) == (1, 1, 0)

        signer = new_signer()
        blob = b"a plan of conv" * 40
        srv.store.put_spec(CONV.graph_key, CONV.to_json())
        srv.store.publish_plan(make_meta(CONV.graph_key, H200, blob, signer), blob)
        with PlanCache(srv.url, backend=RecordingBackend(), token=srv.token("reader"), cache_dir=tmp_path / "cache",
                       trusted_keys=trusted(signer), **PATIENT) as pc:
            plan = pc.plan(CONV)
            assert plan.source == "server" and pc.stats().rejects == {} and pc.stats().remote_errors == 0
        assert later.rewritten >= 4  # enqueue, claim, the plan upload, resolve: each answer carried the new fields


def test_a_client_works_against_an_earlier_server_without_an_api_version(tmp_path):
    srv, _ = serve(tmp_path, earlier=True)
    signer = new_signer()
    blob = b"a plan of conv" * 40
    with srv:
        assert httpx.get(f"{srv.url}/healthz").json() == {"status": "ok"}
        srv.store.put_spec(CONV.graph_key, CONV.to_json())
        srv.store.publish_plan(make_meta(CONV.graph_key, H200, blob, signer), blob)
        with PlanCache(srv.url, backend=RecordingBackend(), token=srv.token("reader"), cache_dir=tmp_path / "cache",
                       trusted_keys=trusted(signer), **PATIENT) as pc:
            assert pc.plan(CONV).source == "server"


def test_answers_name_the_api_version_and_callers_are_counted_by_agent_and_release(tmp_path):
    with LiveServer(tmp_path) as srv, httpx.Client(timeout=30) as http:  # a loaded CI machine: not httpx's 5 s
        health = http.get(f"{srv.url}/healthz")
        assert health.headers[API_VERSION_HEADER] == API_VERSION
        assert health.json() == {"status": "ok", "api_version": API_VERSION, "release": __version__}
        assert http.get(f"{srv.url}/v1/nothing-here").headers[API_VERSION_HEADER] == API_VERSION  # errors too
        with JobsApi.open(srv.url, srv.admin_token) as admin:
            admin.jobs()
        for n in range(40):  # releases a caller claims are bounded in number
            http.get(f"{srv.url}/healthz", headers={"User-Agent": f"plancache-client/9.{n}.0"})
        http.get(f"{srv.url}/healthz", headers={"User-Agent": "curl/8.5.0"})
        text = http.get(f"{srv.url}/metrics").text
    assert f'plancache_callers_total{{agent="worker",release="{__version__}"}} 1.0' in text
    assert 'plancache_callers_total{agent="other",release=""}' in text
    releases = set(re.findall(r'plancache_callers_total\{agent="client",release="([^"]*)"\}', text))
    assert len(releases) == 16 and "other" in releases


def test_every_agent_names_itself_and_this_release():
    for agent in ("client", "worker", "cli"):
        assert re.match(USER_AGENT_PATTERN, user_agent(agent)).groups() == (agent, __version__)  # type: ignore[arg-type, union-attr]
    seen: list[str] = []
    transport = httpx.MockTransport(lambda r: seen.append(r.headers["user-agent"]) or httpx.Response(200, json={}))
    from plancache.http import HttpClient

    with HttpClient("http://plancache.invalid", "t", agent="worker", transport=transport) as http:
        http.request("GET", "/healthz")
    assert seen == [f"plancache-worker/{__version__}"]
