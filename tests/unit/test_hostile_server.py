"""A hostile or broken server on a raw socket against the real HttpClient, Remote and PlanCache, and worker children
that misbehave under the supervisor: compression bombs, nested error bodies, presigned URLs that answer without a
blob, a fallback never sent, a child that ignores SIGTERM, one huge output line."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator

import pytest

from plancache.client import PlanCache
from plancache.client.remote import Remote
from plancache.errors import ServerUnavailable
from plancache.http import CircuitBreaker, HttpClient
from plancache.protocol import ResolvedPlan, ResolveResponse
from plancache.worker.supervisor import Child, Supervisor
from tests.client_fakes import RecordingBackend, read_request
from tests.factories import H200, make_record, new_signer, trusted
from tests.integration.test_client_ladder import CONV, blob_of


class RawServer:
    """Answers each request with ``answer(path) -> bytes`` (the whole HTTP answer), recording the request lines."""

    def __init__(self, answer: Callable[[str], bytes | Callable[[socket.socket], None]]) -> None:
        self.answer = answer
        self.lines: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            request = read_request(conn)
            if request is None:
                return
            line = request[0].split(b"\r\n")[0].decode()
            self.lines.append(line)
            out = self.answer(line.split(" ")[1])
            with contextlib.suppress(OSError):
                out(conn) if callable(out) else conn.sendall(out)

    def close(self) -> None:
        self.sock.close()


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in extra) + b"Content-Length: %d\r\n\r\n" % len(body) + body


@pytest.fixture
def servers() -> Iterator[list[RawServer]]:
    made: list[RawServer] = []
    yield made
    for s in made:
        s.close()


def gzip_of_zeros(mibs: int) -> bytes:
    """A gzip member of ``mibs`` MiB of zeros, made without compressing them all: one MiB's deflate block (after a
    full flush, which resets the dictionary, every MiB's block is the same bytes) repeated, then the trailer."""
    mib, deflate = bytes(2**20), zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflate.compress(mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(mibs):
        crc = zlib.crc32(mib, crc)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + block * mibs + deflate.flush()
            + struct.pack("<II", crc, (mibs << 20) & 0xFFFFFFFF))


def test_gzip_of_zeros_is_what_gzip_makes_of_them():
    assert gzip.decompress(gzip_of_zeros(3)) == bytes(3 << 20)


def test_a_nested_compression_bomb_is_refused_before_it_is_inflated(servers):
    """Content-Encoding "gzip, gzip" on 3.4 KB of wire bytes inflated to 2 GiB in one decode (4 GiB peak RSS)
    although the call asked for identity and capped the answer at 100 KB."""
    bomb = gzip.compress(gzip_of_zeros(1024), 9)  # 1 GiB of zeros, gzipped twice
    servers.append(srv := RawServer(lambda path: ok(bomb, b"Content-Encoding: gzip, gzip")))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with HttpClient(srv.url, "t", connect_timeout=2, read_timeout=2) as http:
        with pytest.raises(ServerUnavailable, match="encoded"):
            http.request("GET", "/v1/blobs/x", max_bytes=100_000, deadline=time.monotonic() + 20)
        with pytest.raises(ServerUnavailable, match="encoded"):  # no cap (a worker's calls): the same
            http.request("GET", "/v1/jobs/1")
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < 100 * 1024  # KiB


def test_an_error_answer_nested_past_the_stack_is_an_error_answer_not_a_recursion_error(servers, tmp_path):
    """A 500 (or 403) whose body is 100,000 nested arrays raised RecursionError out of PlanCache.plan(), tripping
    no breaker: the program failed instead of building locally."""
    deep = b"[" * 100_000 + b"]" * 100_000
    servers.append(srv := RawServer(lambda path: b"HTTP/1.1 500 X\r\nContent-Length: %d\r\n\r\n" % len(deep) + deep))
    backend = RecordingBackend()
    with PlanCache(srv.url, backend=backend, token="t", trusted_keys=trusted(new_signer()),
                   cache_dir=tmp_path / "c") as pc:
        plan = pc.plan(CONV)
        assert plan.source == "heuristic" and pc.stats().remote_errors == 1
        pc.plan(CONV)
    assert len(srv.lines) == 1  # the breaker is open


@pytest.mark.parametrize("answer", [b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://elsewhere.test/b\r\n"
                                    b"Content-Length: 0\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n",
                                    b"HTTP/1.1 304 Not Modified\r\n\r\n"])
def test_a_presigned_url_answering_no_blob_falls_back_to_the_servers_route(servers, tmp_path, answer):
    """A redirect (not followed), 204 or 304 from the object store was taken as an empty blob, rejected as
    corrupt, and the plan rebuilt locally, with no GET from the server as any other failed URL gets."""
    signer, blob = new_signer(), blob_of(CONV)
    record = make_record(CONV.graph_key, H200, blob, signer)
    servers.append(store := RawServer(lambda path: answer))

    def api(path: str) -> bytes:
        if path == "/v1/plans/resolve":
            plan = ResolvedPlan(record=record, blob_url=f"{store.url}/bucket/{record.blob_sha256}?X-Amz-Signature=1")
            return ok(ResolveResponse(plans={CONV.graph_key: plan}, missing=[]).model_dump_json().encode())
        return ok(blob) if path.startswith("/v1/blobs/") else b"HTTP/1.1 404 X\r\nContent-Length: 0\r\n\r\n"

    servers.append(srv := RawServer(api))
    backend = RecordingBackend()
    with PlanCache(srv.url, backend=backend, token="t", trusted_keys=trusted(signer), cache_dir=tmp_path / "c") as pc:
        plan = pc.plan(CONV)
        assert plan.source == "server" and backend.deserialized == [blob]
        assert pc.stats().presigned_fallbacks == 1 and pc.stats().blob_sources == {"server": 1}
    assert srv.lines[-1] == f"GET /v1/blobs/{record.blob_sha256} HTTP/1.1"


def test_a_call_not_sent_because_its_deadline_passed_does_not_turn_the_server_off(servers):
    """A slow object store used up a load's deadline; the fallback GET, never sent, opened the API server's breaker
    for 30 s all the same, so the next loads skipped a healthy server."""
    servers.append(srv := RawServer(lambda path: ok(b"{}")))
    remote = Remote(HttpClient(srv.url, "t", policies=[CircuitBreaker(30)], connect_timeout=2, read_timeout=2))
    with pytest.raises(ServerUnavailable, match="not sent"):
        remote.fetch_blob("a" * 64, size=2, deadline=time.monotonic() - 1)
    assert not remote.is_off and srv.lines == []
    remote.close()


PY = sys.executable
IGNORES_STOP = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "signal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('up', flush=True)\nwhile True: time.sleep(1)")


def test_a_child_ignoring_sigterm_is_killed_so_the_first_failure_reaches_the_service_manager():
    """gpu1 exits 3 while gpu0 ignores SIGTERM: run() never returned (measured: still running after 15 s)."""
    out = io.StringIO()
    sup = Supervisor([Child("gpu0", [PY, "-c", IGNORES_STOP], dict(os.environ)),
                      Child("gpu1", [PY, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"], dict(os.environ))],
                     out=out, poll=0.02, kill_after=1.0)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    thread.start()
    thread.join(15)
    assert result == [3]


def test_a_child_writing_one_huge_line_is_copied_in_pieces_with_bounded_memory():
    """200 MB with no newline: the supervisor held it whole (a 400 MB line: 941 MiB peak RSS)."""
    code = ("import sys\nfor _ in range(200): sys.stdout.write('x' * 2**20)\nsys.stdout.flush()")
    script = f"""
import io, os, sys
sys.path.insert(0, {os.getcwd()!r})
from plancache.worker.supervisor import Child, Supervisor
class Count(io.TextIOBase):
    n = longest = 0
    def write(self, s): self.n += 1; self.longest = max(self.longest, len(s)); return len(s)
out = Count()
Supervisor([Child("gpu0", [sys.executable, "-c", {code!r}], dict(os.environ))], out=out, poll=0.02).run()
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))  # a new mm's, unlike ru_maxrss
print(out.n, out.longest, peak // 1024)
"""
    done = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    pieces, longest, rss_mib = map(int, done.stdout.split())
    assert pieces > 1000 and longest < 100_000 and rss_mib < 150, done.stdout


def test_a_heartbeat_answer_trickled_byte_by_byte_ends_at_its_deadline(servers):
    """Before: a heartbeat had per-read timeouts only, so an answer sent a byte every 0.1 s held the beat thread (and
    the worker's halt(), which joins it) for as long as the server kept trickling. Now its whole answer is due within
    twice its timeout."""
    from plancache.protocol import LeaseRequest
    from plancache.worker.jobs_api import JobsApi

    def trickle(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):
            conn.sendall(b" ")
            time.sleep(0.1)

    servers.append(srv := RawServer(lambda path: trickle))
    jobs = JobsApi(HttpClient(srv.url, "t", connect_timeout=2, read_timeout=2))
    start = time.monotonic()
    with pytest.raises(ServerUnavailable):
        jobs.heartbeat(1, LeaseRequest(worker_id="w1", lease_token="tok"), timeout=0.5)
    assert time.monotonic() - start < 2.0
    jobs.close()
