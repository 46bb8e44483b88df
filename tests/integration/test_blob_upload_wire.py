"""Blob uploads over a real socket (uvicorn): a blob over the limit is refused from its declared length before a
byte of it is read, and so is a plan upload (JSON, the record alone) that declares the size of one as base64."""

from __future__ import annotations

import hashlib
import socket
import time

from tests.live_server import LiveServer

LIMIT = 64 * 1024 * 1024
SHA = "ab" * 32


def _answer_before_body(port: int, head: bytes, wait: float) -> tuple[int, float]:
    """Send ``head`` only (no body byte); (status, milliseconds until the status line), status 0 when the server
    had not answered within ``wait`` seconds."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        start = time.perf_counter()
        sock.sendall(head)
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            return 0, wait * 1000
        elapsed = (time.perf_counter() - start) * 1000
    return (int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0), elapsed


def _head(method: str, path: str, token: str, length: int, content_type: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {content_type}",
             f"Authorization: Bearer {token}", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_blob_of_64_mib_plus_one_byte_is_refused_before_its_body_is_read(tmp_path):
    """Measured: 413 within a few ms with 0 body bytes sent. A JSON plan upload declaring that blob as base64 (89.5 MB)
    is refused as soon: it is over the JSON body limit (a plan upload carries its record alone)."""
    with LiveServer(tmp_path, blob_store=(tmp_path / "blobs").as_uri()) as srv:
        admin = srv.admin_token
        status, ms = _answer_before_body(srv.port, _head("PUT", f"/v1/blobs/{SHA}", admin, LIMIT + 1,
                                                         "application/octet-stream"), wait=5)
        assert status == 413 and ms < 1000, (status, ms)
        json_length = 4 * ((LIMIT + 1 + 2) // 3) + 4096  # the blob as base64, and a record
        status, ms = _answer_before_body(srv.port, _head("PUT", "/v1/plans", admin, json_length, "application/json"),
                                         wait=5)
        assert status == 413 and ms < 1000, (status, ms)


def _status(sock: socket.socket) -> int:
    """The status of the answer waiting on ``sock`` (0 when the connection closed without one)."""
    answer = sock.recv(65536)
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def test_a_blob_dripped_slowly_is_cut_off_with_408(tmp_path):
    """A blob whose bytes come a few a second (a slow-loris upload) is cut at the body's deadline, body_timeout
    plus its size at body_min_rate (before: the route waited for as long as the client kept sending), and leaves
    nothing in the folder."""
    blobs = tmp_path / "blobs"
    with LiveServer(tmp_path, blob_store=blobs.as_uri(), body_timeout=1.0) as srv:
        start = time.perf_counter()
        status = 0
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(_head("PUT", f"/v1/blobs/{SHA}", srv.admin_token, 100_000, "application/octet-stream"))
            sock.settimeout(0.2)
            while not status and time.perf_counter() - start < 8:
                try:
                    sock.sendall(b"x")
                    status = _status(sock)
                except TimeoutError:
                    pass
                except OSError:
                    break
        elapsed = time.perf_counter() - start
        assert status == 408 and elapsed < 3, (status, elapsed)
        assert srv.store.blob_size(SHA) is None
        assert not [p for p in blobs.rglob("*") if p.is_file()]  # the writer's temporary file went with it
        assert srv.app.state.inflight.used == 0


def test_a_flood_of_big_uploads_waits_for_the_in_flight_budget_then_gets_503(tmp_path):
    """Each upload holds its declared length of the in-flight budget while its body comes (before: none was
    counted, so any number of 64 MiB uploads ran at once). With four 1 MiB uploads under way and a 4 MiB budget, a
    fifth waits inflight_wait_seconds, then gets 503 with Retry-After; one that arrives while waiting gets in."""
    mib = 1 << 20
    blobs = [bytes([i]) * mib for i in range(6)]
    names = [hashlib.sha256(b).hexdigest() for b in blobs]
    with LiveServer(tmp_path, blob_store=(tmp_path / "blobs").as_uri(), max_inflight_bytes=4 * mib,
                    inflight_wait_seconds=1.0, body_timeout=30.0) as srv:
        budget = srv.app.state.inflight

        def begin(i: int) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            sock.sendall(_head("PUT", f"/v1/blobs/{names[i]}", srv.admin_token, mib, "application/octet-stream"))
            return sock

        holders = []
        for i in range(4):  # four uploads under way: each has sent half of its body
            holders.append(begin(i))
            holders[-1].sendall(blobs[i][:mib // 2])
        deadline = time.monotonic() + 5
        while budget.used < 4 * mib and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.used == 4 * mib
        with begin(4) as refused:
            start = time.perf_counter()
            status, waited = _status(refused), time.perf_counter() - start
        assert status == 503 and 0.9 < waited < 3, (status, waited)
        with begin(5) as waiting:
            time.sleep(0.3)
            holders[0].sendall(blobs[0][mib // 2:])  # the first upload completes: its share is given back
            assert _status(holders[0]) == 201
            waiting.sendall(blobs[5])
            assert _status(waiting) == 201
        for i, sock in enumerate(holders[1:], 1):
            sock.sendall(blobs[i][mib // 2:])
            assert _status(sock) == 201
            sock.close()
        holders[0].close()
        assert budget.used == 0
        assert srv.store.blob_size(names[4]) is None and srv.store.blob_size(names[5]) == mib


def test_a_chunked_blob_is_refused_with_411_before_its_body_is_read(tmp_path):
    with LiveServer(tmp_path, blob_store=(tmp_path / "blobs").as_uri()) as srv:
        head = _head("PUT", f"/v1/blobs/{SHA}", srv.admin_token, 0, "application/octet-stream")
        head = head.replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
        status, ms = _answer_before_body(srv.port, head, wait=5)
        assert status == 411 and ms < 1000, (status, ms)
