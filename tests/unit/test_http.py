"""The shared HTTP layer (plancache.http) against ``httpx.MockTransport``: error answers, the error tree's codes,
the retry policy, the circuit breaker, and both composed on one client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from plancache import errors
from plancache.errors import (
    BY_CODE,
    Conflict,
    InvalidValue,
    LeaseLost,
    LengthRequired,
    NotFound,
    PayloadTooLarge,
    PlanCacheError,
    RequestRefused,
    RequestTimeout,
    ServerUnavailable,
    SpecError,
    Unauthorized,
    UnsupportedMediaType,
)
from plancache.http import Backoff, CircuitBreaker, HttpClient, Policy, Retry, error_body, error_from_response, json_as
from plancache.server.errors import error_response

URL = "http://plancache.test"
FAST = Backoff(initial=0.01, cap=0.02)
Answer = httpx.Response | Exception


class Script:
    """Answers requests from a list (the last one repeats); records every request."""

    def __init__(self, answers: Iterable[Answer]) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def client(script: Callable[[httpx.Request], httpx.Response], *policies: Policy,
           token: str | None = "tok") -> HttpClient:
    return HttpClient(URL, token, policies=policies, transport=httpx.MockTransport(script))


def refusal(status: int, code: str, message: str = "detail here") -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Ok(BaseModel):
    ok: bool


DOWN = httpx.ConnectError("connection refused")
OK = httpx.Response(200, json={"ok": True})


# ---------------------------------------------------------------- error answers


def _answer(status: int, **kw) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("POST", f"{URL}/v1/jobs/7/complete"), **kw)


def test_error_body_reads_the_servers_error_json():
    sent = error_response(409, "lease_lost", "fenced")
    assert error_body(_answer(409, content=sent.body, headers=dict(sent.headers))) == ("lease_lost", "fenced")


@pytest.mark.parametrize("kw", [{"text": "plain words"}, {"json": ["error"]}, {"json": {"error": "flat"}},
                                {"json": {"error": {"code": "x"}}}])
def test_error_body_falls_back_to_the_status_and_text(kw):
    resp = _answer(400, **kw)
    assert error_body(resp) == ("http_400", resp.text)
    assert error_body(_answer(400)) == ("http_400", "Bad Request")


def test_error_body_messages_are_cut():
    assert len(error_body(_answer(400, text="x" * 5000))[1]) == 500
    assert len(error_body(refusal(400, "c", "y" * 5000))[1]) == 500


@pytest.mark.parametrize("status,code,cls", [
    (409, "lease_lost", LeaseLost), (409, "conflict", Conflict), (401, "unauthorized", Unauthorized),
    (422, "invalid_spec", SpecError), (404, "not_found", NotFound), (422, "invalid_value", InvalidValue),
    (411, "length_required", LengthRequired), (408, "request_timeout", RequestTimeout),
    (415, "unsupported_media_type", UnsupportedMediaType), (413, "payload_too_large", PayloadTooLarge),
])
def test_a_4xx_is_raised_as_the_class_of_its_code(status, code, cls):
    err = error_from_response(_answer(status, json={"error": {"code": code, "message": "detail here"}}))
    assert type(err) is cls and err.http_status == status and err.code == code
    assert err.message == f"POST {URL}/v1/jobs/7/complete: {status} {code}: detail here"


def test_the_servers_own_refusals_are_the_error_tree_never_http_exception():
    """Every refusal plancache's code makes is a :mod:`plancache.errors` class (so clients raise it as what it is);
    ``HTTPException`` is only the framework's, answered under the code of the class of its status."""
    import inspect

    import plancache.server

    package = Path(inspect.getfile(plancache.server)).parent
    raising = [f"{p.relative_to(package)}:{n}" for p in package.rglob("*.py")
               for n, line in enumerate(p.read_text().splitlines(), 1) if "HTTPException(" in line]
    assert raising == []


def test_a_4xx_without_a_class_is_request_refused_with_its_code_and_status():
    for code in ("teapot", "validation_error", "verification_failed"):  # the last needs a reason the wire lacks
        err = error_from_response(_answer(418, json={"error": {"code": code, "message": "m"}}))
        assert type(err) is RequestRefused and (err.code, err.http_status) == (code, 418)
    assert error_from_response(_answer(400, text="plain")).code == "http_400"


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504, 501])
def test_429_and_5xx_are_server_unavailable(status):
    err = error_from_response(_answer(status, json={"error": {"code": "database_unavailable", "message": "busy"}}))
    assert type(err) is ServerUnavailable and not err.skipped and "busy" in err.message


def _tree(cls: type[PlanCacheError]) -> list[type[PlanCacheError]]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_tree(sub))]


def test_by_code_covers_every_error_made_from_a_message():
    tree = [c for c in _tree(PlanCacheError) if c.__module__ == errors.__name__]
    codes = [c.code for c in tree if "code" in vars(c)]
    assert len(codes) == len(set(codes)), "error codes repeat"
    from_message = {c for c in tree if c.__init__ is PlanCacheError.__init__}
    assert set(BY_CODE.values()) == from_message and all("code" in vars(c) for c in from_message)
    for cls in BY_CODE.values():
        assert cls().message == " ".join(cls.__doc__.split("\n\n")[0].split()), cls  # docstring: default message
    assert {"invalid_spec", "not_found", "conflict", "integrity_error", "lease_lost", "unauthorized", "forbidden",
            "payload_too_large", "environment_mismatch", "invalid_value"} <= set(BY_CODE)
    assert not {"server_unavailable", "verification_failed", "plancache_error"} & set(BY_CODE)


def test_errors_take_the_message_first_and_their_fields_by_keyword():
    assert ServerUnavailable().message.startswith("The plancache server could not be used")
    assert ServerUnavailable("gone", skipped=True).skipped
    refused = RequestRefused("no", code="teapot", http_status=418)
    assert (refused.message, refused.code, refused.http_status) == ("no", "teapot", 418)


# ---------------------------------------------------------------- the client


def test_the_client_checks_its_url_and_timeouts_and_reads_the_settings(monkeypatch):
    with pytest.raises(ValueError, match="http"):
        HttpClient("plancache.test:8787")
    with pytest.raises(ValueError, match="timeouts"):
        HttpClient(URL, read_timeout=0)
    monkeypatch.setenv("PLANCACHE_CONNECT_TIMEOUT", "0.7")
    monkeypatch.setenv("PLANCACHE_READ_TIMEOUT", "3")
    timeout = HttpClient(URL + "/")._clients[0].timeout
    assert (timeout.connect, timeout.read) == (0.7, 3.0)
    assert HttpClient(URL, read_timeout=9)._clients[0].timeout.read == 9.0


def test_the_token_is_sent_as_a_bearer_header_and_a_malformed_answer_is_server_unavailable():
    script = Script([OK])
    assert client(script).read("GET", "/x", json_as(Ok)) == Ok(ok=True)
    assert script.requests[0].headers["authorization"] == "Bearer tok"
    assert "authorization" not in client(script, token=None).request("GET", "/x").request.headers
    with pytest.raises(ServerUnavailable, match="malformed answer"):
        client(Script([httpx.Response(200, text="<html>proxy</html>")])).read("GET", "/x", json_as(Ok))


# ---------------------------------------------------------------- retry


def test_backoff_grows_exponentially_with_jitter_and_is_capped():
    b = Backoff(initial=0.1, factor=2.0, cap=1.0)
    for attempt, ceiling in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (50, 1.0), (10_000, 1.0)]:
        delays = [b.delay(attempt) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, min(delays), max(delays))
        assert len(set(delays)) > 1, "no jitter"


def test_retry_sends_again_after_transient_failures_until_success():
    script = Script([DOWN, httpx.Response(503), httpx.ReadTimeout("slow"), httpx.Response(200, text="<html>"), OK])
    assert client(script, Retry(FAST, within=10)).read("GET", "/x", json_as(Ok)) == Ok(ok=True)
    assert len(script.requests) == 5


def test_retry_never_repeats_a_refusal_or_a_call_that_asks_for_one_attempt():
    script = Script([refusal(409, "lease_lost")])
    with pytest.raises(LeaseLost, match="detail here"):
        client(script, Retry(FAST, within=10)).request("POST", "/x", body={})
    script = Script([DOWN])
    with pytest.raises(ServerUnavailable, match="connection refused"):
        client(script, Retry(FAST, within=10)).request("POST", "/x", retry=False)
    assert len(script.requests) == 1


def test_retry_stops_at_its_deadline_and_on_stop():
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"connection refused \(after \d+ attempt\(s\)\)"):
        client(Script([DOWN]), Retry(FAST, within=0.3)).request("GET", "/x")
    assert 0.25 <= time.monotonic() - t0 < 2
    forever = client(Script([DOWN]), Retry(FAST))  # within=None: until stop
    forever.stop.set()
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable):
        forever.request("GET", "/x")
    assert time.monotonic() - t0 < 0.5


# ---------------------------------------------------------------- breaker, and both on one client


def test_the_breaker_trips_on_refused_credentials_unless_the_call_says_otherwise():
    clock = Clock()
    breaker = CircuitBreaker(30.0, clock=clock)
    script = Script([refusal(401, "unauthorized")])
    http = client(script, breaker)
    with pytest.raises(Unauthorized):
        http.request("POST", "/v1/specs", trips_on_refusal=False)
    assert not breaker.is_off
    with pytest.raises(ServerUnavailable, match="401 unauthorized") as exc:
        http.request("GET", "/x")
    assert not exc.value.skipped and breaker.is_off
    with pytest.raises(ServerUnavailable, match="not sent") as exc:
        http.request("GET", "/x")
    assert exc.value.skipped and len(script.requests) == 2


def test_a_429_trips_the_breaker_only_for_a_call_that_trips_on_refusal():
    """A 429 to a spec registration (the token's spec-write budget, which says nothing about resolving plans) turned
    the server off for the process for the cool-down, so its tuned plans missed as 'unavailable'. A 503 still trips
    the breaker whatever the call; a 429 to a call that trips on refusal too."""
    breaker = CircuitBreaker(30.0, clock=Clock())
    script = Script([refusal(429, "rate_limited"), refusal(503, "unavailable")])
    http = client(script, breaker)
    with pytest.raises(ServerUnavailable, match="429 rate_limited") as exc:
        http.request("POST", "/v1/specs", trips_on_refusal=False)
    assert exc.value.throttled and not exc.value.skipped and not breaker.is_off
    with pytest.raises(ServerUnavailable, match="503 unavailable") as exc:
        http.request("POST", "/v1/specs", trips_on_refusal=False)
    assert not exc.value.throttled and breaker.is_off
    breaker = CircuitBreaker(30.0, clock=Clock())
    script = Script([refusal(429, "rate_limited")])
    with pytest.raises(ServerUnavailable, match="429"):
        client(script, breaker).request("POST", "/v1/plans/resolve")
    assert breaker.is_off


def test_a_breaker_around_retries_trips_once_when_the_retries_give_up():
    clock = Clock()
    breaker = CircuitBreaker(30.0, clock=clock)
    script = Script([DOWN, httpx.Response(502), OK])
    http = client(script, breaker, Retry(FAST, within=10))
    assert http.request("GET", "/x").status_code == 200  # retried inside one call: the breaker saw a success
    assert not breaker.is_off and len(script.requests) == 3
    script.answers = [DOWN]
    with pytest.raises(ServerUnavailable, match=r"\(after \d+ attempt\(s\)\)"):
        client(script, breaker, Retry(FAST, within=0.1)).request("GET", "/x")
    sent = len(script.requests)
    assert sent > 4 and breaker.is_off
    with pytest.raises(ServerUnavailable) as exc:  # off: no request, no retrying
        http.request("GET", "/x")
    assert exc.value.skipped and len(script.requests) == sent
    clock.t += 31
    script.answers = [OK]
    assert http.request("GET", "/x").status_code == 200 and not breaker.is_off


def test_retries_around_a_breaker_give_up_as_soon_as_it_is_off():
    breaker = CircuitBreaker(30.0, clock=Clock())
    script = Script([DOWN])
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable) as exc:
        client(script, Retry(Backoff(initial=0.05), within=10), breaker).request("GET", "/x")
    assert exc.value.skipped and len(script.requests) == 1 and time.monotonic() - t0 < 1


# ---------------------------------------------------------------- bounded answers: size and deadline


class Lazy(httpx.SyncByteStream):
    """``size`` bytes in ``chunk``-byte pieces, ``pause`` seconds apart; ``read`` counts what the client pulled."""

    def __init__(self, size: int, chunk: int = 1024, pause: float = 0.0) -> None:
        self.size, self.chunk, self.pause = size, chunk, pause
        self.read = 0

    def __iter__(self):
        while self.read < self.size:
            if self.pause:
                time.sleep(self.pause)
            n = min(self.chunk, self.size - self.read)
            self.read += n
            yield b"x" * n


def test_a_body_over_max_bytes_is_cut_off_while_it_streams_and_trips_the_breaker():
    """Before: the whole body was read (here 512 MiB) before anyone looked at its size."""
    body = Lazy(512 * 1024 * 1024)
    breaker = CircuitBreaker(30.0, clock=Clock())
    http = client(Script([httpx.Response(200, stream=body)]), breaker)
    with pytest.raises(ServerUnavailable, match="exceeds the 5000-byte limit"):
        http.request("GET", "/v1/blobs/x", max_bytes=5000)
    assert body.read <= 5000 + 1 + body.chunk and breaker.is_off
    # A body declaring its length is refused before any of it is read.
    declared = Lazy(10_000)
    script = Script([httpx.Response(200, headers={"Content-Length": "10000"}, stream=declared)])
    with pytest.raises(ServerUnavailable, match="declares 10000 bytes"):
        client(script).request("GET", "/x", max_bytes=5000)
    assert declared.read == 0
    # Up to the limit is fine, and the reader gets the decoded, whole body.
    assert client(Script([httpx.Response(200, stream=Lazy(5000))])).request("GET", "/x", max_bytes=5000).content \
        == b"x" * 5000
    assert script.requests[0].headers["accept-encoding"] == "identity"


def test_a_capped_error_answer_is_still_read_as_its_error():
    with pytest.raises(LeaseLost, match="fenced"):
        client(Script([refusal(409, "lease_lost", "fenced")])).request("POST", "/x", max_bytes=4096)


def test_a_deadline_bounds_the_whole_answer_however_slowly_it_drips():
    """Before: each chunk arrived within the read timeout, so 40 chunks 0.1 s apart took 4 s."""
    slow = Lazy(40, chunk=1, pause=0.1)
    breaker = CircuitBreaker(30.0, clock=Clock())
    http = client(Script([httpx.Response(200, stream=slow)]), breaker)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="no whole answer by its deadline"):
        http.request("GET", "/x", deadline=time.monotonic() + 0.5)
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 2.0, elapsed  # the deadline's 0.5 s, not the 4 s of the drip (slack for a loaded CI)
    assert breaker.is_off
    time.sleep(0.25)
    assert slow.read < 10, "the abandoned read went on"
    # In time: the answer as usual. Already past: not sent at all.
    assert client(Script([OK])).read("GET", "/x", json_as(Ok), deadline=time.monotonic() + 5) == Ok(ok=True)
    script = Script([OK])
    with pytest.raises(ServerUnavailable, match="not sent, its deadline has passed"):
        client(script).request("GET", "/x", deadline=time.monotonic() - 1)
    assert script.requests == []


def test_a_deadline_shortens_the_timeouts_of_the_call():
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return OK

    http = HttpClient(URL, connect_timeout=1.0, read_timeout=5.0, transport=httpx.MockTransport(answer))
    http.request("GET", "/x", deadline=time.monotonic() + 2.0)
    http.request("GET", "/x")
    assert seen[0]["read"] <= 2.0 and seen[0]["connect"] == 1.0
    assert (seen[1]["read"], seen[1]["connect"]) == (5.0, 1.0)


def test_plain_http_loads_no_ca_bundle_and_could_not_speak_tls_while_https_verifies():
    import ssl

    from plancache.http import HttpClient, tls_verification

    assert tls_verification("https://plans.example") is True  # httpx's default: the CA bundle, hostname checked
    ctx = tls_verification("http://127.0.0.1:8787")
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] == 0  # trusts no certificate: fails closed
    client = HttpClient("https://plans.example", connect_timeout=1, read_timeout=1)
    try:
        pool = client._clients[0]._transport._pool  # type: ignore[attr-defined]
        assert pool._ssl_context.verify_mode == ssl.CERT_REQUIRED
        assert pool._ssl_context.cert_store_stats()["x509_ca"] > 0
    finally:
        client.close()


def test_several_servers_are_tried_in_turn_and_the_one_that_answered_is_asked_first():
    """Before: a client took one server URL; its outage sent every process to local builds."""
    asked: list[str] = []
    state = {"a": 503, "b": 200}

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        asked.append(host)
        if state[host] == 0:
            raise httpx.ConnectError("refused", request=request)
        if state[host] != 200:
            return httpx.Response(state[host], json={"error": {"code": "x", "message": "no"}})
        return httpx.Response(200, json={"server": host})

    with HttpClient("http://a.test, http://b.test/", transport=httpx.MockTransport(answer),
                    policies=[CircuitBreaker(30)]) as http:
        assert http.server_urls == ("http://a.test", "http://b.test") and http.server_url == "http://a.test"
        assert http.request("GET", "/v1/x").json() == {"server": "b"} and asked == ["a", "b"]
        asked.clear()
        assert http.request("GET", "/v1/x").json() == {"server": "b"} and asked == ["b"]  # the one that answered
        state.update(a=200, b=0)  # b refuses connections: back to a
        asked.clear()
        assert http.request("GET", "/v1/x").json() == {"server": "a"} and asked == ["b", "a"]
        state.update(a=404)  # an answer other than 429/5xx is final: not asked elsewhere
        asked.clear()
        with pytest.raises(errors.RequestRefused):
            http.request("GET", "/v1/x")
        assert asked == ["a"]
        state.update(a=500, b=429)  # every server failed: the attempt fails (and the breaker opens), naming the last
        with pytest.raises(ServerUnavailable, match="b.test"):
            http.request("GET", "/v1/x")
        with pytest.raises(ServerUnavailable, match="not sent"):
            http.request("GET", "/v1/x")
    with pytest.raises(ValueError, match="must start with http"):
        HttpClient("http://a.test,,http://b.test")


def test_an_https_url_to_a_plain_http_server_fails_at_once_saying_so():
    """A plain-HTTP server answers a TLS handshake with ``HTTP/1.1 400``: that was retried as an outage (7 attempts,
    6 s, in the CLI). It is ServerSpeaksHttp, never sent again, naming the http:// URL to use."""
    import http.server
    import threading

    from plancache.errors import ServerSpeaksHttp

    connections = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def setup(self) -> None:
            connections.append(1)
            super().setup()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with HttpClient(f"https://127.0.0.1:{port}", policies=[Retry(FAST, within=10)]) as http:
            start = time.monotonic()
            with pytest.raises(ServerSpeaksHttp, match=rf"speaks plain HTTP, not HTTPS.*use http://127\.0\.0\.1:{port}"):
                http.request("GET", "/healthz")
            assert time.monotonic() - start < 2
    finally:
        server.shutdown()
        server.server_close()
    assert len(connections) == 1
    assert ServerSpeaksHttp.code not in BY_CODE  # a transport error: never a server's answer
