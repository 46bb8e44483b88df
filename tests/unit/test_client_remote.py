"""The client's calls against ``httpx.MockTransport``: resolve, spec registration, blobs, behind a circuit breaker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from plancache.client.remote import Remote
from plancache.errors import Forbidden, NotFound, ServerUnavailable
from plancache.http import CircuitBreaker, HttpClient
from plancache.protocol import ExplainResponse, MissReason, ResolvedPlan, ResolveResponse, b64encode
from plancache.spec import parse_spec
from tests.factories import H200, make_record

URL = "http://plancache.test"
KEY = "d" * 64
BLOB = b"blob" * 16


NOT_SEEN = MissReason(reason="not_registered", message="never seen")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Server:
    """A scripted server: ``answer(request) -> httpx.Response``; every request is recorded."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.mode = "ok"
        self.api = "1.2"  # "1.1": resolve answers carry no reasons; "1.0": nor is there an explain route

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if self.mode == "slow":
            raise httpx.ReadTimeout("timed out", request=request)
        if self.mode == "500":
            return httpx.Response(500, json={"error": {"code": "internal", "message": "boom"}})
        if self.mode == "401":
            return httpx.Response(401, json={"error": {"code": "unauthorized", "message": "unknown token"}})
        if self.mode == "garbage":
            return httpx.Response(200, text="<html>proxy error page</html>")
        if request.url.path == "/v1/plans/resolve":
            body = json.loads(request.content)
            plans = {k: ResolvedPlan(record=make_record(k, H200, BLOB), blob_b64=b64encode(BLOB))
                     for k in body["graph_keys"] if k == KEY}
            missing = [k for k in body["graph_keys"] if k != KEY]
            reasons = {k: NOT_SEEN for k in missing} if self.api >= "1.2" else {}
            return httpx.Response(200, content=ResolveResponse(plans=plans, missing=missing,
                                                               reasons=reasons).model_dump_json(exclude_defaults=True))
        if request.url.path == "/v1/plans/explain" and self.api >= "1.1":
            keys = json.loads(request.content)["graph_keys"]
            return httpx.Response(200, content=ExplainResponse(reasons=dict.fromkeys(keys, NOT_SEEN)).model_dump_json())
        if request.url.path == "/v1/specs":
            if request.headers.get("authorization") != "Bearer worker-token":
                return httpx.Response(403, json={"error": {"code": "forbidden", "message": "needs a worker token"}})
            return httpx.Response(201, json={"graph_key": "e" * 64, "created": True})
        if request.url.path.startswith("/v1/blobs/"):
            return httpx.Response(200, content=BLOB)
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no route"}})


@pytest.fixture
def server() -> Server:
    return Server()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def remote(server: Server, clock: Clock, token: str | None = "reader-token", **kw) -> Remote:
    http = HttpClient(URL, token, policies=[CircuitBreaker(30.0, clock=clock)], transport=httpx.MockTransport(server))
    return Remote(http, **kw)


def test_resolve_sends_the_environment_and_keys_and_parses_the_answer(server, clock):
    r = remote(server, clock)
    resp = r.resolve(H200, [KEY, "f" * 64, KEY])
    assert list(resp.plans) == [KEY] and resp.missing == ["f" * 64]
    req = server.requests[0]
    body = json.loads(req.content)
    assert body["graph_keys"] == [KEY, "f" * 64] and body["include_blobs"] is True
    assert body["environment"]["sm"] == 90
    assert req.headers["authorization"] == "Bearer reader-token"


def test_resolve_splits_large_key_lists(server, clock):
    r = remote(server, clock, max_keys_per_request=2)
    keys = [KEY] + [f"{i:064x}" for i in range(4)]
    resp = r.resolve(H200, keys)
    assert len(server.requests) == 3
    assert list(resp.plans) == [KEY] and len(resp.missing) == 4 and len(resp.reasons) == 4


def test_resolve_says_why_each_missing_key_is_missing_in_its_one_round_trip(server, clock):
    resp = remote(server, clock).resolve(H200, [KEY, "f" * 64])
    assert resp.reasons == {"f" * 64: NOT_SEEN} and [r.url.path for r in server.requests] == ["/v1/plans/resolve"]


@pytest.mark.parametrize(("api", "paths", "explained"), [
    ("1.1", ["/v1/plans/resolve", "/v1/plans/explain"], True),
    ("1.0", ["/v1/plans/resolve", "/v1/plans/explain"], False),
])
def test_an_older_server_s_misses_are_explained_by_its_explain_route_if_it_has_one(server, clock, api, paths,
                                                                                   explained):
    """A server of API 1.1 gives no reasons in its resolve answer: they are asked of ``explain``; a server without
    that route leaves the misses unexplained, and the remote on."""
    server.api = api
    r = remote(server, clock)
    resp = r.resolve(H200, [KEY, "f" * 64])
    assert [q.url.path for q in server.requests] == paths and bool(resp.reasons) is explained and not r.is_off
    assert resp.missing == ["f" * 64]


@pytest.mark.parametrize("mode", ["down", "slow", "500", "401", "garbage"])
def test_one_failure_turns_the_remote_off_for_the_cooldown(server, clock, mode):
    r = remote(server, clock)
    server.mode = mode
    with pytest.raises(ServerUnavailable) as first:
        r.resolve(H200, [KEY])
    assert not first.value.skipped and r.is_off
    # While off: no request at all, an immediate failure that says so.
    server.mode = "ok"
    for _ in range(3):
        with pytest.raises(ServerUnavailable) as again:
            r.resolve(H200, [KEY])
        assert again.value.skipped
    assert len(server.requests) == 1
    # After the cool-down the next call tries again, and success closes the breaker.
    clock.t += 30.5
    assert not r.is_off
    assert KEY in r.resolve(H200, [KEY]).plans
    assert len(server.requests) == 2


def test_a_failure_after_the_cooldown_re_arms_the_breaker(server, clock):
    r = remote(server, clock)
    server.mode = "down"
    with pytest.raises(ServerUnavailable):
        r.resolve(H200, [KEY])
    clock.t += 31
    with pytest.raises(ServerUnavailable) as exc:
        r.resolve(H200, [KEY])
    assert not exc.value.skipped and r.is_off and len(server.requests) == 2


def test_a_request_specific_4xx_does_not_turn_the_remote_off(server, clock):
    r = remote(server, clock)
    with pytest.raises(NotFound) as exc:
        r.http.request("GET", "/nowhere")
    assert exc.value.http_status == 404 and exc.value.code == "not_found"
    assert not r.is_off


def test_register_spec_needs_a_worker_token_and_a_refusal_keeps_the_remote_on(server, clock):
    spec = parse_spec((Path(__file__).parents[2] / "examples" / "sdpa_causal.json").read_text())
    with pytest.raises(Forbidden) as exc:
        remote(server, clock).register_spec(spec)
    assert exc.value.http_status == 403
    r = remote(server, clock, token="worker-token")
    assert r.register_spec(spec) == "e" * 64
    sent = json.loads(server.requests[-1].content)
    assert sent == spec.to_json()
    assert not r.is_off


def test_fetch_blob_returns_the_bytes(server, clock):
    assert remote(server, clock).fetch_blob("0" * 64) == BLOB


def test_fetch_blob_reads_no_more_than_the_records_size(server, clock):
    r = remote(server, clock)
    assert r.fetch_blob("0" * 64, size=len(BLOB)) == BLOB
    with pytest.raises(ServerUnavailable, match=f"{len(BLOB) - 1}-byte limit"):
        r.fetch_blob("0" * 64, size=len(BLOB) - 1)
    assert r.is_off
    small = remote(server, Clock(), max_blob_bytes=10)  # never more than max_blob_bytes, whatever the record says
    with pytest.raises(ServerUnavailable, match="10-byte limit"):
        small.fetch_blob("0" * 64, size=len(BLOB))


def test_resolve_answers_are_capped_by_keys_and_the_setting(server, clock):
    r = remote(server, clock, max_blob_bytes=3000, resolve_max_bytes=1 << 30)
    assert r.resolve_limit(1, True) == 64 * 1024 + 16 * 1024 + 4000
    assert r.resolve_limit(3, False) == 64 * 1024 + 3 * 16 * 1024
    assert remote(server, clock, resolve_max_bytes=100_000).resolve_limit(1000, True) == 100_000
    tight = remote(server, clock, resolve_max_bytes=100)
    with pytest.raises(ServerUnavailable, match="100-byte limit"):
        tight.resolve(H200, [KEY])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_keys_per_request"):
        Remote(HttpClient(URL), max_keys_per_request=0)
    with pytest.raises(ValueError, match="max_blob_bytes"):
        Remote(HttpClient(URL), max_blob_bytes=0)


def test_the_client_imports_neither_the_server_stack_nor_the_gpu_stack():
    code = ("import sys, plancache.client; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'sqlalchemy', 'fastapi', 'uvicorn', 'alembic', "
            "'torch', 'cudnn'}); print(heavy); sys.exit(1 if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stdout + proc.stderr


