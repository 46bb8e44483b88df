"""Blob uploads over a real socket (uvicorn): a blob over the limit is refused from its declared length before a
byte of it is read; the worker's JSON upload of the same blob had to be read whole first."""

from __future__ import annotations

import socket
import time

from plancache.server.uploads import base64_size
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
    """Measured: 413 within a few ms with 0 body bytes sent. The JSON upload of the same blob (base64 inside
    ``PUT /v1/plans``, 89.5 MB declared, under that route's body limit) gets no answer until its body has come."""
    with LiveServer(tmp_path, blob_store=(tmp_path / "blobs").as_uri()) as srv:
        admin = srv.admin_token
        status, ms = _answer_before_body(srv.port, _head("PUT", f"/v1/blobs/{SHA}", admin, LIMIT + 1,
                                                         "application/octet-stream"), wait=5)
        assert status == 413 and ms < 1000, (status, ms)
        json_length = base64_size(LIMIT + 1) + 4096
        status, _ = _answer_before_body(srv.port, _head("PUT", "/v1/plans", admin, json_length, "application/json"),
                                        wait=1.0)
        assert status == 0  # the inline route waits for the whole ~90 MB body before it can tell the blob's size
