"""Keep-alive connections after refusals, under uvicorn (:class:`~tests.live_server.LiveServer`), and the
client's one resend of a request that a kept-alive connection lost.

Before: an answer sent before the request's body was read (401, 403, 413) said nothing about the connection;
the server stopped reading it and reset it a second later, so the next request on the same keep-alive
connection failed with a reset: 40 of 40 after a refused 200 KB body, 1-2 of 40 after a small one (measured
with this module's loop). plancache's own client (no token, server with open reads: its spec registration is
refused with 401) then failed its next prefetch and opened its circuit breaker. After: such an answer says
``Connection: close``, the server half-closes and drains the rest of the body within a bound, and the client
sends a request that a reused connection lost once more on a new one: 0 resets.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from plancache.client import PlanCache
from plancache.errors import ServerUnavailable
from plancache.http import CircuitBreaker, HttpClient
from plancache.protocol import MAX_CANDIDATES_BYTES, MAX_RECORD_BYTES
from plancache.server.bodies import record_body_limit
from plancache.spec import parse_spec
from tests.client_fakes import RecordingBackend
from tests.factories import H200, PATIENT, make_meta, new_signer, trusted
from tests.live_server import LiveServer
from tests.server_util import bearer, put_blob, upload_json

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROUNDS = 20
BIG = json.dumps({"name": "x" * 200_000}).encode()  # 200 KB: more than one socket buffer's worth in flight
SMALL = b'{"graph_keys": []}'


def _post(http: httpx.Client, path: str, body: bytes, token: str | None) -> httpx.Response:
    headers = {"Content-Type": "application/json", **(bearer(token) if token else {})}
    return http.post(path, content=body, headers=headers)


@pytest.mark.parametrize("size", ["200 KB", "small"])
def test_a_refusal_does_not_poison_its_keep_alive_connection(tmp_path: Path, size: str) -> None:
    """Refused requests (401 no token, 403 reader on an admin route, 413 over the JSON limit), each followed by
    a request on the same httpx.Client: before 40/40 (200 KB) and 1-2/40 (small) of those failed with a
    reset; now none does, and an answer that left its body unread says ``Connection: close``."""
    body = BIG if size == "200 KB" else SMALL
    with LiveServer(tmp_path, max_json_bytes=100_000 if size == "200 KB" else 1 << 20) as srv:
        reader = srv.token("reader")
        refusals = [("/v1/specs", None, 401), ("/v1/admin/tune", reader, 403)]
        if size == "200 KB":
            refusals.append(("/v1/specs", reader, 413))
        failures: list[str] = []
        closing = 0
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            for i in range(ROUNDS):
                for path, token, status in refusals:
                    r = _post(http, path, body, token)
                    assert r.status_code == status, r.text
                    closing += r.headers.get("connection") == "close"
                    time.sleep(0.01 * (i % 4))  # let the server's reset (before) arrive or not
                    try:
                        assert http.get("/healthz").status_code == 200
                    except httpx.TransportError as exc:
                        failures.append(f"{path} {status}: {type(exc).__name__}")
            r = http.post("/v1/plans/resolve", json={"environment": H200.model_dump(mode="json"), "graph_keys": ["a" * 64]},
                          headers=bearer(reader))
            assert r.status_code == 200 and "connection" not in r.headers  # a body read whole: the connection stays
        assert failures == [], f"{len(failures)} of {ROUNDS * len(refusals)} next requests failed"
        if size == "200 KB":  # the server answers these from the head: the body is still on its way
            assert closing > 0


def test_a_500_says_connection_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn drops the connection after an unhandled error; the answer now says so (it did not), and the
    same client's next request goes out on a new connection."""
    with LiveServer(tmp_path) as srv:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected")

        monkeypatch.setattr(srv.store, "get_spec", broken)
        with httpx.Client(base_url=srv.url, timeout=10, headers=bearer(srv.token("reader"))) as http:
            for _ in range(5):
                r = http.get(f"/v1/specs/{'a' * 64}")
                assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
                assert r.headers["connection"] == "close"
                assert http.get("/healthz").status_code == 200


def test_the_client_after_a_refused_spec_registration_still_prefetches(tmp_path: Path) -> None:
    """A tokenless client of a server with open reads: its miss's spec registration is refused (401); its next
    prefetch, on the same pool, is answered from the server and no remote error is counted (before: it failed
    in 3 of 8 trials and opened the circuit breaker for 30 s)."""
    specs = [parse_spec((EXAMPLES / f"{name}.json").read_text()) for name in ("conv_bias_relu", "sdpa_causal")]
    missing, stored = specs
    signer = new_signer()
    blob = b"serialized plan" * 100
    with LiveServer(tmp_path / "server", open_reads=True) as srv:
        srv.store.put_spec(stored.graph_key, stored.to_json())
        srv.store.publish_plan(make_meta(stored.graph_key, H200, blob, signer), blob)
        failed = []
        for trial in range(8):
            with PlanCache(srv.url, backend=RecordingBackend(), token=None, cache_dir=tmp_path / f"cache{trial}",
                           trusted_keys=trusted(signer), **PATIENT) as pc:
                assert pc.plan(missing).source != "server"  # a miss: resolve, then the spec sent and refused
                plans = pc.prefetch([stored])
                if plans[stored.graph_key].source != "server" or pc.stats().remote_errors:
                    failed.append((trial, plans[stored.graph_key].source, pc.stats().remote_errors))
        assert failed == [], f"{len(failed)} of 8 trials: {failed}"


def _answer_after_head(port: int, head: bytes, wait: float) -> tuple[bytes, float]:
    """What the server answers to ``head`` alone (no body sent) within ``wait`` seconds, and when."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        start = time.perf_counter()
        sock.sendall(head)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            pass
        return answer, time.perf_counter() - start


def test_a_plan_upload_over_the_json_limit_is_refused_from_its_declared_length(
        tmp_path: Path, make_spec: Any) -> None:
    """A plan upload (the record alone) declaring more than its limit (``max_json_bytes`` plus the bounds of a record
    and a candidates table) is answered 413 with ``Connection: close`` before any of its body is sent, saying that
    the blob goes raw to ``PUT /v1/blobs``. A blob at the limit goes that way, then its record with a spec."""
    with LiveServer(tmp_path, max_blob_bytes=1 << 20, body_timeout=3.0) as srv:
        limit = record_body_limit(srv.settings)
        assert limit == srv.settings.max_json_bytes + MAX_RECORD_BYTES + MAX_CANDIDATES_BYTES < 3 << 20
        worker = srv.token("worker")
        for path in ("/v1/plans", "/v1/jobs/1/complete"):
            method, token = ("PUT", srv.admin_token) if path == "/v1/plans" else ("POST", worker)
            head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n").encode()
            answer, seconds = _answer_after_head(srv.port, head, wait=2.0)
            status_line, _, rest = answer.partition(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 413"), (path, answer[:200], seconds)
            assert b"connection: close" in rest.lower() and seconds < 1.0
            message = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["message"]
            assert f"exceeds the limit of {limit} bytes" in message and "PUT /v1/blobs/{sha256}" in message
        key, spec = make_spec(0)
        meta_blob = b"\x01" * (1 << 20)
        put_blob(httpx, meta_blob, bearer(srv.admin_token), url=srv.url)
        body = upload_json(make_meta(key, H200, meta_blob), spec)
        r = httpx.put(f"{srv.url}/v1/plans", json=body, headers=bearer(srv.admin_token), timeout=30)
        assert r.status_code == 201, r.text


class DroppingServer:
    """A loopback HTTP/1.1 server that answers ``200 {"ok": true}`` with keep-alive, but drops (resets) the
    connection instead of answering each request whose number (from 1, over all connections) is in ``drop``."""

    def __init__(self, drop: set[int]) -> None:
        self.drop = drop
        self.requests = self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                while (head := _read_head(conn)) is not None:
                    self.requests += 1
                    conn.recv(int(re.search(rb"content-length: (\d+)", head.lower() + b"content-length: 0")[1]))
                    if self.requests in self.drop:
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        break
                    conn.sendall(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n'
                                 b'{"ok": true}')

    def close(self) -> None:
        self._sock.close()


def _read_head(conn: socket.socket) -> bytes | None:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = conn.recv(1)
        if not chunk:
            return None
        head += chunk
    return head


def test_the_client_resends_once_what_a_kept_alive_connection_lost() -> None:
    """A request lost with its kept-alive connection (reset, no answer) goes out once more on a new connection
    and the breaker stays closed (before: ServerUnavailable, and the breaker open for its cool-down). One lost
    on a new connection, or lost again, is the server's failure as before."""
    server = DroppingServer(drop={2})
    try:
        breaker = CircuitBreaker(cooldown=30)
        with HttpClient(server.url, policies=[breaker], connect_timeout=5, read_timeout=5) as http:
            assert http.request("GET", "/a").json() == {"ok": True}
            assert http.request("POST", "/b", body={"x": 1}).json() == {"ok": True}  # lost, sent again
            assert not breaker.is_off and server.requests == 3 and server.connections == 2
    finally:
        server.close()
    server = DroppingServer(drop={1, 2, 3})
    try:
        with HttpClient(server.url, connect_timeout=5, read_timeout=5) as http, \
                pytest.raises(ServerUnavailable):
            http.request("GET", "/a")  # a new connection: not sent again
        assert server.requests == 1
    finally:
        server.close()
    server = DroppingServer(drop={2, 3})
    try:
        with HttpClient(server.url, connect_timeout=5, read_timeout=5) as http:
            http.request("GET", "/a")
            with pytest.raises(ServerUnavailable):
                http.request("GET", "/b")  # lost on the kept-alive connection, then on the new one
        assert server.requests == 3
    finally:
        server.close()


def test_an_idle_worker_poll_finds_its_connection_open() -> None:
    """The server closed an idle connection after 5 s, a worker's poll interval: about half of idle polls opened a
    new connection (main 4d1a308). The keep-alive timeout is above the default poll interval, and within the
    header timeout, which also ends an idle connection."""
    import inspect

    from plancache.settings import ServerSettings
    from plancache.worker.loop import Worker

    settings = ServerSettings()
    poll_interval = inspect.signature(Worker.__init__).parameters["poll_interval"].default
    assert poll_interval + 1 < settings.keep_alive_timeout <= settings.header_timeout
