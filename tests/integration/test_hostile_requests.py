"""Hostile requests (issue: one reader request stalls the server; absurd numbers; unbounded low-privilege writes).

Each test names the figure it guards, measured on the 2-core development machine before the fix and after.

- A live uvicorn server keeps answering ``/healthz`` (p99 < 100 ms) while hostile bodies arrive, and refuses each
  quickly: a 59 MiB schema-1 spec of 10^6 tensors (before: 20 s of work, 1.7 GB peak, healthz p99 5.5 s), a 30 MiB
  tensor name, a body dripped a byte at a time (before: 300 such connections were all still open after 45 s).
- Integers no column or model can hold are 422 on both databases (before: knobs and candidate figures of 4,200
  digits were stored, 201).
- Misses are recorded within a budget per token (before: one reader recorded 3,700–5,600 miss rows a second, for
  made-up environments too); spec registration has a budget per token.
- Smaller: no redirect to a forged Host; ``priority: false`` refused; ``GET /v1/jobs/claim`` is 405; the OpenAPI
  document states the graph-key pattern, the NUL rule and the campaign target rule.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from plancache.errors import SpecError
from plancache.protocol import WORKER_ID_PATTERN
from plancache.server.limits import ByteBudget, RateLimiter
from plancache.spec import parse_spec
from plancache.spec.limits import MAX_RANK, MAX_TENSORS
from tests.live_server import LiveServer
from tests.server_util import api, open_api, put_blob, upload, upload_json  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "conv_bias_relu.json"
#: healthz's p99 while hostile bodies arrive: about 30 ms alone, 106 ms on a loaded 2-core CI machine (a rehearsal
#: failed a 100 ms limit there); what it guards against is the event loop stalled for seconds (p99 5.5 s before).
HEALTHZ_P99_LIMIT = 0.250


# ------------------------------------------------------------------ helpers


class HealthProbe:
    """``GET /healthz`` every 10 ms, each on a new connection, recording each answer's latency (connect included).

    Not one keep-alive connection: the server closes a connection idle for ``header_timeout`` (or
    ``keep_alive_timeout``), and a probe thread descheduled that long on a loaded machine then sends its next request
    into the close and reads a reset, which says nothing about the server."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    status = client.get(f"{self.url}/healthz").status_code
                    if status != 200:
                        self.failures.append(str(status))
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def raw_request(port: int, head: bytes, body: bytes = b"", *, timeout: float = 10.0) -> tuple[int, float, bytes]:
    """Send ``head`` and the start of ``body`` on a raw socket; (status, seconds until the status line, answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        start = time.perf_counter()
        sock.sendall(head)
        if body:
            sock.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        elapsed = time.perf_counter() - start
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, elapsed, answer


def post_head(path: str, token: str | None, length: int | None, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def spec_body(tensors: int, name: str = "T") -> bytes:
    """A spec with ``tensors`` input tensors (one used): the findings' schema-1 document written in schema 2, of the
    same size (10^6 tensors: 59.9 MiB; 15,000: 0.85 MiB)."""
    inputs = [{"uid": i + 1, "name": f"{name}{i}", "dim": [1], "stride": [1]} for i in range(tensors)]
    doc = {"schema": 2, "context": {"io_data_type": "FLOAT"},
           "tensors": [*inputs, {"uid": tensors + 1, "name": "Y", "dim": [1], "stride": [1]}],
           "nodes": [{"type": "POINTWISE", "inputs": {"IN_0": 1}, "outputs": {"OUT_0": tensors + 1},
                      "params": {"mode": "relu"}}]}
    return json.dumps(doc).encode()


# ------------------------------------------------------------------ the live server


def test_hostile_bodies_are_refused_quickly_while_healthz_keeps_answering(tmp_path):
    """Before: the 59 MiB spec took 20 s (healthz p99 5.5 s, 1.7 GB peak); a 95 MiB JSON array stalled the loop 8.7 s
    before its 401. After (measured here): 413 or 401 from the request head in a few ms, 422 for a spec just under
    the body limit in well under a second, healthz p99 about 30 ms throughout (limit 250 ms: a loaded machine)."""
    with LiveServer(tmp_path, body_timeout=1.0, header_timeout=2.0) as srv:
        reader = srv.token("reader")
        huge_spec = spec_body(1_000_000)  # 59 MiB, 10^6 tensors
        assert len(huge_spec) > 50 << 20
        huge_name = json.dumps({"schema": 2, "tensors": [{"uid": 1, "name": "n" * (30 << 20)}], "nodes": []}).encode()
        many_tensors = spec_body(15_000)  # under the 1 MiB body limit, over MAX_TENSORS
        long_name = json.dumps({"schema": 2, "tensors": [{"uid": 1, "name": "n" * 900_000}], "nodes": []}).encode()
        array = b"[" + b"1," * (47 << 20) + b"1]"  # 94 MiB, no token
        assert len(many_tensors) < 1 << 20 and len(long_name) < 1 << 20
        outcomes: dict[str, tuple[int, float]] = {}

        def sent_whole(label: str, path: str, body: bytes, token: str | None) -> None:
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
            start = time.perf_counter()
            r = httpx.post(f"{srv.url}{path}", content=body, headers=headers, timeout=60)
            outcomes[label] = (r.status_code, time.perf_counter() - start)

        with HealthProbe(srv.url) as probe:
            time.sleep(0.3)
            # declared too large: answered from the head, whatever follows
            for label, body, token in (("59 MiB spec", huge_spec, reader), ("30 MiB name", huge_name, reader),
                                       ("94 MiB array, no token", array, None)):
                status, seconds, _ = raw_request(srv.port, post_head("/v1/specs" if token else "/v1/plans/resolve",
                                                                      token, len(body)), body[:1 << 20])
                outcomes[f"{label} (head)"] = (status, seconds)
            # the same bodies sent whole by an HTTP client, and ones just under the body limit
            for label, path, body, token in (("59 MiB spec", "/v1/specs", huge_spec, reader),
                                             ("94 MiB array, no token", "/v1/plans/resolve", array, None),
                                             ("15,000 tensors", "/v1/specs", many_tensors, reader),
                                             ("900 kB name", "/v1/specs", long_name, reader)):
                sent_whole(label, path, body, token)
            # a body dripped a byte a second is cut at body_timeout
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
                start = time.perf_counter()
                sock.sendall(post_head("/v1/specs", reader, 1000))
                answer = b""
                sock.settimeout(0.3)
                while not answer and time.perf_counter() - start < 8:
                    try:
                        sock.sendall(b" ")
                        answer = sock.recv(65536)
                    except TimeoutError:
                        pass
                    except OSError:
                        break
                outcomes["dripped body"] = (int(answer.split(b" ", 2)[1]) if answer else 0, time.perf_counter() - start)
            time.sleep(0.3)

        print(f"healthz n={len(probe.latencies)} p50={sorted(probe.latencies)[len(probe.latencies) // 2] * 1000:.1f} ms "
              f"p99={probe.p99() * 1000:.1f} ms max={max(probe.latencies) * 1000:.1f} ms; "
              + "; ".join(f"{k}: {v[0]} in {v[1] * 1000:.0f} ms" for k, v in outcomes.items()))
        expected = {"59 MiB spec (head)": 413, "30 MiB name (head)": 413, "94 MiB array, no token (head)": 401,
                    "59 MiB spec": 413, "94 MiB array, no token": 401, "15,000 tensors": 422, "900 kB name": 422,
                    "dripped body": 408}
        assert {k: v[0] for k, v in outcomes.items()} == expected, outcomes
        for label, (_, seconds) in outcomes.items():
            limit = 0.5 if label.endswith("(head)") else 3.0  # a whole upload waits until the server drops it (1 s)
            assert seconds < limit, (label, seconds, outcomes)
        assert not probe.failures, probe.failures
        assert len(probe.latencies) > 50
        assert probe.p99() < HEALTHZ_P99_LIMIT, (probe.p99(), sorted(probe.latencies)[-5:])


def test_slow_heads_and_dripped_bodies_do_not_hold_connections(tmp_path):
    """Before: 300 connections that sent their head (or body) a byte a second were all still open after 45 s.
    After: a head not complete in header_timeout, or a body not in body_timeout, loses its connection."""
    with LiveServer(tmp_path, header_timeout=1.0, body_timeout=1.0) as srv:
        reader = srv.token("reader")
        socks = []
        for i in range(20):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            if i % 2:
                sock.sendall(post_head("/v1/specs", reader, 100_000))  # a complete head, then a dripped body
            else:
                sock.sendall(b"POST /v1/specs HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            socks.append(sock)
        start = time.perf_counter()
        open_ = set(range(len(socks)))
        while open_ and time.perf_counter() - start < 10:
            for i in list(open_):
                try:
                    socks[i].sendall(b"X-Drip: 1\r\n" if i % 2 == 0 else b"x")
                except OSError:
                    open_.discard(i)
                    continue
                socks[i].setblocking(False)
                try:
                    if socks[i].recv(65536) == b"":
                        open_.discard(i)
                except BlockingIOError:
                    pass
                except OSError:
                    open_.discard(i)
                socks[i].setblocking(True)
            time.sleep(0.2)
        elapsed = time.perf_counter() - start
        for sock in socks:
            sock.close()
        assert not open_ and elapsed < 5, (sorted(open_), elapsed)
        assert httpx.get(f"{srv.url}/healthz").status_code == 200


def test_an_answer_the_client_does_not_read_is_dropped_and_its_budget_released(tmp_path, make_spec, make_plan,
                                                                                  gpu_env):
    """A reader asking for 40 MiB of inlined blobs and never reading the answer held that much of the in-flight
    budget for as long as it kept the connection; now the connection is dropped after body_timeout."""
    with LiveServer(tmp_path, body_timeout=1.0) as srv:
        keys = []
        for i in range(5):
            key, spec = make_spec(i)
            srv.store.put_spec(key, spec)
            srv.store.publish_plan(*make_plan(key, gpu_env, blob=bytes([i]) * (8 << 20)))
            keys.append(key)
        body = json.dumps({"environment": gpu_env.model_dump(), "graph_keys": keys, "include_blobs": True}).encode()
        budget: ByteBudget = srv.app.state.inflight
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(post_head("/v1/plans/resolve", srv.token("reader"), len(body)) + body)
            deadline = time.monotonic() + 3
            while budget.used < 40 << 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert budget.used >= 40 << 20  # the answer's blobs are held while it is sent
            deadline = time.monotonic() + 6
            while budget.used and time.monotonic() < deadline:
                time.sleep(0.05)
            assert budget.used == 0
            sock.settimeout(5)
            with pytest.raises(OSError):  # the connection was reset: reading on ends before the whole answer
                received = 0
                while received < 50 << 20:
                    chunk = sock.recv(1 << 20)
                    if not chunk:
                        raise ConnectionResetError("closed")
                    received += len(chunk)


# ------------------------------------------------------------------ absurd numbers


def _example() -> dict[str, Any]:
    return json.loads(EXAMPLE.read_text())


@pytest.mark.parametrize("where", ["stride", "padding", "pass_by_value"])
def test_absurd_integers_in_specs_are_422(api, where):
    """Before: a stride or conv padding of 10^4000 went on to the spec checks (and, through schema 1, was stored and
    enqueued). After: any JSON integer longer than 20 characters is refused while parsing, 422."""
    doc = _example()
    if where == "stride":
        doc["tensors"][0]["stride"][0] = 10**4000
    elif where == "padding":
        conv = next(n for n in doc["nodes"] if n["type"] == "CONV_FPROP")
        conv["params"]["padding"] = [10**4000, 1]
    else:
        doc["tensors"][0]["pass_by_value"] = 2**70
    r = api.client.post("/v1/specs", content=json.dumps(doc), headers={**api.reader, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert len(r.text) < 3000
    assert api.store.list_jobs() == [] and api.client.get("/v1/misses", headers=api.admin).json()["misses"] == []


def assert_upload_refused(api, make_spec, make_plan, gpu_env, field, value):
    """A plan upload whose record has ``field`` set to ``value`` is 422 and stores nothing."""
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env)
    put_blob(api.client, blob, api.admin)
    body = json.dumps(upload_json(meta, spec, **{field: value}))
    r = api.client.put("/v1/plans", content=body, headers={**api.admin, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert api.store.get_plan(key, gpu_env) is None


@pytest.mark.parametrize("field, value", [
    ("knobs", {"SPLIT_K": 10**4199}),
    ("knobs", {"SPLIT_K": 2**63}),
    ("knobs", {"k" * 65: 1}),
    ("knobs", {f"K{i}": 1 for i in range(65)}),
    ("candidates", [{"index": 0, "status": "ok", "workspace_bytes": 10**4199}]),
    ("candidates", [{"index": 0, "status": "ok", "knobs": {"SPLIT_K": 10**4199}}]),
    ("candidates", [{"index": 0, "status": "ok", "engine_id": 2**64}]),
    ("workspace_bytes", 2**63),
    ("blob_size", True),
])
def test_absurd_integers_in_plan_uploads_are_422(api, make_spec, make_plan, gpu_env, field, value):
    """Before: knobs and candidate figures of 4,200 digits were stored (201, SQLite and Postgres). After: 422."""
    assert_upload_refused(api, make_spec, make_plan, gpu_env, field, value)


@pytest.mark.parametrize("field, value", [
    ("winner_median_ms", 1e308),
    ("heuristic_median_ms", 1e300),
    ("worst_median_ms", -1.0),
    ("native_median_ms", {"flash": 1e300}),
    ("tuning_seconds", 1e12),
    ("candidates", [{"index": 0, "status": "ok", "median_ms": 1e308}]),
    ("candidates", [{"index": 0, "status": "mismatch", "max_abs_err": 1e300}]),
])
def test_absurd_floats_in_plan_uploads_are_422(api, make_spec, make_plan, gpu_env, field, value):
    """Before: winner_median_ms 1e308 was stored. After: every time of a record is finite and at most a day, every
    error finite and bounded: 422, nothing stored."""
    assert_upload_refused(api, make_spec, make_plan, gpu_env, field, value)


@pytest.mark.parametrize("path, body", [
    ("/v1/admin/tune", {"graph_keys": ["0" * 64], "targets": [{"sm": 90}], "priority": 10**30}),
    ("/v1/admin/tune", {"graph_keys": ["0" * 64], "targets": [{"sm_count": 10**25}]}),
    ("/v1/admin/tune/misses", {"environment": "ENV", "top": 10**4000}),
    ("/v1/admin/campaigns", {"target": {"cudnn_version": 2**31}}),
])
def test_absurd_integers_in_admin_requests_are_422(api, gpu_env, path, body):
    body = {k: (gpu_env.model_dump() if v == "ENV" else v) for k, v in body.items()}
    r = api.client.post(path, content=json.dumps(body), headers={**api.admin, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert api.store.list_jobs() == []


def test_integers_are_refused_while_parsing_before_python_converts_them(api):
    """A 4,299-digit integer (under Python's 4,300-digit limit) costs about a millisecond to convert; 1 MiB of them
    would hold the GIL for seconds. Anything over 20 characters is refused by the parser."""
    body = b'{"environment": {"sm": ' + b"9" * 4299 + b"}, \"worker_id\": \"w\"}"
    r = api.client.post("/v1/jobs/claim", content=body, headers={**api.worker, "Content-Type": "application/json"})
    assert r.status_code == 422 and "too long" in r.json()["error"]["message"]
    body = b'{"environment": {"sm": ' + b"1" * 21 + b"}, \"worker_id\": \"w\"}"
    r = api.client.post("/v1/jobs/claim", content=body, headers={**api.worker, "Content-Type": "application/json"})
    assert r.status_code == 422 and "too long" in r.json()["error"]["message"]


# ------------------------------------------------------------------ spec limits


def test_spec_limits_are_checked_before_validation():
    """Counts and lengths are refused from the document's top level: 10^5 tensors cost milliseconds
    (before: 1 s per 10^5 tensors, 20 s for the 10^6 of the finding)."""
    doc = json.loads(spec_body(100_000))
    start = time.perf_counter()
    with pytest.raises(SpecError, match=f"tensors: 100001 entries; the limit is {MAX_TENSORS}"):
        parse_spec(doc)
    assert time.perf_counter() - start < 0.1
    doc = _example()
    doc["tensors"][0]["name"] = "x" * 300
    with pytest.raises(SpecError, match=r"tensors\[0\].name: 300 characters"):
        parse_spec(doc)
    doc = _example()
    conv = next(n for n in doc["nodes"] if n["type"] == "CONV_FPROP")
    conv["params"]["padding"] = [10**30, 1]
    with pytest.raises(SpecError, match="integer 10+ out of range"):
        parse_spec(doc)
    doc = _example()
    doc["tensors"][0]["dim"] = [1] * (MAX_RANK + 1)
    with pytest.raises(SpecError, match="dim: 9 entries"):
        parse_spec(doc)
    doc = _example()
    doc["nodes"][0]["name"] = "n" * 257
    with pytest.raises(SpecError, match="name: 257 characters"):
        parse_spec(doc)
    doc = _example()
    doc["nodes"][0]["params"].update({f"p{i}": 1 for i in range(65)})
    with pytest.raises(SpecError, match="params: .* entries; the limit is 64"):
        parse_spec(doc)
    parse_spec(_example())  # the real graph passes


def test_json_routes_take_1_mib_plan_uploads_their_record_and_blobs_go_raw(api, make_spec, make_plan, gpu_env):
    """Every JSON body is read up to 1 MiB (PLANCACHE_MAX_JSON_BYTES), a plan upload (the record alone) up to that
    plus what its record and candidates table may take (2.06 MiB); a 2 MiB blob goes raw to PUT /v1/blobs, and a plan
    upload with that blob inline is 413 saying where it goes."""
    filler = {"environment": gpu_env.model_dump(), "graph_keys": ["0" * 64], "pad": "x" * (1 << 20)}
    r = api.client.post("/v1/plans/resolve", json=filler, headers=api.reader)
    assert r.status_code == 413 and "1048576" in r.json()["error"]["message"]
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env, blob=b"b" * (2 << 20))
    inline = upload_json(meta, spec, blob_b64=base64.b64encode(blob).decode())
    r = api.client.put("/v1/plans", json=inline, headers=api.admin)
    assert r.status_code == 413 and "PUT /v1/blobs/{sha256}" in r.json()["error"]["message"], r.text
    r = upload(api.client, meta, blob, spec, headers=api.admin)
    assert r.status_code == 201, r.text


def test_a_full_in_flight_budget_is_503_with_retry_after(store, gpu_env):
    with open_api(store, inflight_wait_seconds=0.05) as a:
        budget: ByteBudget = a.app.state.inflight
        assert budget.try_take(budget.capacity)
        body = {"environment": gpu_env.model_dump(), "graph_keys": ["0" * 64]}
        r = a.client.post("/v1/plans/resolve", json=body, headers=a.reader)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_busy"
        budget.release(budget.capacity)
        assert a.client.post("/v1/plans/resolve", json=body, headers=a.reader).status_code == 200
        assert budget.used == 0  # every request gives its bytes back
        assert a.client.get("/healthz").status_code == 200


def test_a_caller_without_the_role_is_refused_before_its_body_is_read(api, monkeypatch):
    """Before: a 95 MiB body was parsed (8.7 s on the event loop) and then refused 401."""
    from plancache.server import bodies

    parsed: list[bytes] = []
    original = bodies.strict_json_loads
    monkeypatch.setattr(bodies, "strict_json_loads", lambda b: parsed.append(b) or original(b))
    r = api.client.post("/v1/admin/tune", json={"graph_keys": ["0" * 64], "targets": [{}]}, headers=api.reader)
    assert r.status_code == 403
    r = api.client.post("/v1/specs", json={"schema": 2}, headers={})
    assert r.status_code == 401
    assert parsed == []
    assert api.client.post("/v1/specs", json={"schema": 2}, headers=api.reader).status_code == 422
    assert len(parsed) == 1  # with the role, the body is parsed


# ------------------------------------------------------------------ low-privilege writes


def test_misses_are_recorded_within_a_budget_per_token(store, gpu_env):
    """Before: one reader recorded 3,700–5,600 miss rows a second, for made-up environments too. After: each
    token records at most PLANCACHE_MISS_BURST misses at once, then PLANCACHE_MISSES_PER_MINUTE; the answer
    still lists every missing key."""
    made_up = gpu_env.model_copy(update={"frontend_version": "9.9.9-made-up"}).model_dump()
    with open_api(store, miss_burst=100, misses_per_minute=60) as a:
        keys = [f"{i:064x}" for i in range(1000)]
        r = a.client.post("/v1/plans/resolve", json={"environment": made_up, "graph_keys": keys}, headers=a.reader)
        assert r.status_code == 200 and len(r.json()["missing"]) == 1000
        r = a.client.post("/v1/plans/resolve", json={"environment": made_up, "graph_keys": keys[:10]}, headers=a.reader)
        assert r.status_code == 200 and len(r.json()["missing"]) == 10
        assert len(store.list_misses(limit=1000)) == 100
        assert "plancache_misses_not_counted_total 910.0" in a.client.get("/metrics").text
        other, _ = store.create_token("other-reader", "reader")  # another token has its own budget
        r = a.client.post("/v1/plans/resolve", json={"environment": made_up, "graph_keys": keys[500:550]},
                          headers={"Authorization": f"Bearer {other}"})
        assert r.status_code == 200 and len(store.list_misses(limit=1000)) == 150


def test_spec_registration_has_a_budget_per_token(store, make_spec):
    """Before: a reader could register specs as fast as it could send them. After: PLANCACHE_SPEC_WRITE_BURST at
    once, then PLANCACHE_SPEC_WRITES_PER_MINUTE; past it 429 with Retry-After; admins are not limited."""
    with open_api(store, spec_write_burst=3, spec_writes_per_minute=6) as a:
        for i in range(3):
            assert a.client.post("/v1/specs", json=make_spec(i)[1], headers=a.reader).status_code == 201
        r = a.client.post("/v1/specs", json=make_spec(3)[1], headers=a.reader)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
        assert 1 <= int(r.headers["retry-after"]) <= 10
        assert store.get_spec(make_spec(3)[0]) is None
        assert a.client.post("/v1/specs", json=make_spec(3)[1], headers=a.admin).status_code == 201


def test_rate_limiter_and_byte_budget_units():
    limiter = RateLimiter(per_minute=60, burst=5)
    assert limiter.take("a", 3) == 3 and limiter.take("a", 3) == 0 and limiter.take("a", 3, partial=True) == 2
    assert limiter.take("b", 5) == 5 and limiter.retry_after("a") == 1
    assert RateLimiter(per_minute=0, burst=1).take("a", 10**6) == 10**6  # 0: no limit
    budget = ByteBudget(100, wait_seconds=0)
    assert budget.try_take(60) and not budget.try_take(60) and budget.take_up_to(60) == 40
    budget.release(100)
    assert budget.used == 0


# ------------------------------------------------------------------ smaller


def test_a_forged_host_is_not_redirected(api):
    """Before: GET /v1/blobs/<sha>/ with Host: evil.example answered 307 to http://evil.example/…"""
    r = api.client.get("/v1/blobs/" + "a" * 64 + "/", headers={**api.reader, "Host": "evil.example"},
                       follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers


@pytest.mark.parametrize("path, body", [
    ("/v1/admin/campaigns", {"target": {"cudnn_version": 92000}, "priority": False}),
    ("/v1/admin/tune", {"graph_keys": ["0" * 64], "targets": [{"sm": 90}], "priority": False}),
    ("/v1/admin/tune/misses", {"environment": "ENV", "priority": True}),
    ("/v1/admin/tune/misses", {"environment": "ENV", "top": True}),
    ("/v1/admin/tune", {"graph_keys": ["0" * 64], "targets": [{"sm_count": True}]}),
])
def test_booleans_are_not_integers(api, gpu_env, path, body):
    """Before: ``priority: false`` was accepted as priority 0 (200)."""
    body = {k: (gpu_env.model_dump() if v == "ENV" else v) for k, v in body.items()}
    r = api.client.post(path, json=body, headers=api.admin)
    assert r.status_code == 422 and "boolean" in r.json()["error"]["message"], r.text


def test_get_on_the_claim_route_is_405(api):
    """Before: 422 (``claim`` read as a malformed job id)."""
    r = api.client.get("/v1/jobs/claim", headers=api.worker)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert api.client.get("/v1/jobs/not-a-number", headers=api.worker).status_code == 404
    assert api.client.get("/v1/jobs/0", headers=api.worker).status_code == 422


def test_openapi_states_the_rules_the_server_enforces(api):
    """Before: resolve's and tune's graph keys had no pattern, strings no NUL rule, a campaign's target no
    'at least one field' rule; bodies did not document 408/413/503."""
    doc = api.client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for model, most in (("ResolveRequest", 1000), ("TuneRequest", 10_000)):  # resolve: PLANCACHE_MAX_RESOLVE_KEYS
        items = schemas[model]["properties"]["graph_keys"]["items"]
        assert items["pattern"] == "^[0-9a-f]{64}$", items
        assert schemas[model]["properties"]["graph_keys"]["maxItems"] == most
    assert schemas["FailRequest"]["properties"]["error"]["pattern"] == "^[^\\u0000]*$"
    assert schemas["ClaimRequest"]["properties"]["worker_id"]["pattern"] == WORKER_ID_PATTERN  # no NUL in it either
    target = schemas["CampaignRequest"]["properties"]["target"]
    assert {tuple(alt["required"]) for alt in target["anyOf"]} == {
        ("sm",), ("sm_count",), ("cudnn_version",), ("driver_version",), ("frontend_version",)}
    knobs = schemas["Candidate"]["properties"]["knobs"]
    assert knobs["maxProperties"] == 64 and knobs["additionalProperties"] is False
    assert knobs["patternProperties"]["^[A-Za-z0-9_.]{1,64}$"]["maximum"] == 2**63 - 1
    responses = doc["paths"]["/v1/jobs/claim"]["post"]["responses"]
    assert {"408", "413", "503"} <= set(responses)
    assert "429" in doc["paths"]["/v1/specs"]["post"]["responses"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_without_its_content_type_is_415_naming_it(api, content_type):
    """Before: "Input should be a valid dictionary" (422), which names nothing the caller did wrong."""
    headers = {**api.reader, **({"Content-Type": content_type} if content_type else {})}
    r = api.client.post("/v1/specs", content=json.dumps(_example()), headers=headers)
    assert r.status_code == 415, r.text
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message and (content_type or "no Content-Type") in message


def test_a_frontend_version_that_is_not_a_version_is_422(api, make_spec, gpu_env):
    """64 control characters are 384 characters of canonical JSON: a job's ``target_key`` (256 on Postgres) was a 500
    from the admin routes, and a reader's misses on such an environment failed every autotune step, for every
    environment. A version is spelled as packages spell one."""
    _, spec = make_spec(0)
    for bad in ("\u0001" * 64, "1.0 beta", "", "1" * 65):
        r = api.client.post("/v1/admin/tune", json={"specs": [spec], "targets": [{"frontend_version": bad}]},
                            headers=api.admin)
        assert r.status_code == 422, (bad, r.text)
        env = {**gpu_env.model_dump(), "frontend_version": bad}
        r = api.client.post("/v1/plans/resolve", json={"environment": env, "graph_keys": []}, headers=api.reader)
        assert r.status_code == 422, (bad, r.text)
    r = api.client.post("/v1/admin/tune", json={"specs": [spec], "targets": [{"frontend_version": "1.14.0.dev0+g1a2b"}]},
                        headers=api.admin)
    assert r.status_code == 200, r.text


def test_a_client_that_goes_away_mid_body_is_no_server_error(tmp_path, caplog):
    """A worker killed mid-upload (or any client dropping mid-body) was logged with two tracebacks and counted as a
    500, so 5xx alerts fired on ordinary aborts; it is an info line and a 499 in the metrics."""
    import logging

    caplog.set_level(logging.INFO, logger="plancache.server")
    with LiveServer(tmp_path) as srv:
        for method, path, kind in (("PUT", f"/v1/blobs/{'ab' * 32}", "application/octet-stream"),
                                   ("POST", "/v1/specs", "application/json")):
            head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.admin_token}\r\n"
                    f"Content-Type: {kind}\r\nContent-Length: 100000\r\n\r\n").encode()
            with socket.create_connection(("127.0.0.1", srv.port)) as sock:
                sock.sendall(head + b"{" + b" " * 20000)
                time.sleep(0.3)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and caplog.text.count("client went away") < 2:
            time.sleep(0.05)
        metrics = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {srv.admin_token}"}).text
        assert srv.app.state.inflight.used == 0
    assert caplog.text.count("client went away") == 2, caplog.text
    assert "unhandled error" not in caplog.text and "Traceback" not in caplog.text
    assert 'status="500"' not in metrics and 'status="499"' in metrics, metrics[-2000:]


def test_slow_blob_uploads_do_not_stall_the_other_routes(tmp_path, make_spec, gpu_env):
    """40 uploads sent slowly by a worker holding one job took every thread the other routes share: a resolve waited
    14 s, until the body deadline freed them. Uploads have threads of their own (``UPLOAD_THREADS``)."""
    from plancache.protocol import TargetEnvironment

    with LiveServer(tmp_path, body_timeout=10.0) as srv:
        key, spec = make_spec(0)
        srv.store.put_spec(key, spec)
        srv.store.enqueue(key, TargetEnvironment.exactly(gpu_env))
        worker = {"Authorization": f"Bearer {srv.token('worker')}"}
        claim = httpx.post(f"{srv.url}/v1/jobs/claim", json={"environment": gpu_env.model_dump(mode="json"),
                                                              "worker_id": "w"}, headers=worker).json()
        socks = []
        try:
            for i in range(40):
                sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                sock.sendall((f"PUT /v1/blobs/{i:064x} HTTP/1.1\r\nHost: x\r\n"
                              f"Authorization: {worker['Authorization']}\r\nX-Plancache-Job: {claim['job']['id']}\r\n"
                              f"X-Plancache-Worker: w\r\nX-Plancache-Lease: {claim['lease_token']}\r\n"
                              "Content-Length: 100000\r\n\r\n").encode() + b"x" * 10)
                socks.append(sock)
            time.sleep(1.0)
            start = time.perf_counter()
            r = httpx.post(f"{srv.url}/v1/plans/resolve", json={"environment": gpu_env.model_dump(mode="json"),
                                                                 "graph_keys": [key]},
                           headers={"Authorization": f"Bearer {srv.token('reader')}"}, timeout=30)
            seconds = time.perf_counter() - start
        finally:
            for sock in socks:
                sock.close()
    assert r.status_code == 200 and seconds < 2.0, (r.status_code, seconds)


def test_a_large_blob_read_whole_from_the_database_holds_its_share_of_the_in_flight_budget(tmp_path, make_spec,
                                                                                           make_plan, gpu_env):
    """A blob too large for the blob memory is read whole from the database for each GET: 16 slow readers of a 60 MiB
    blob took the server from 275 to 1,387 MiB with a 256 MiB budget. Its bytes are the budget's while it is sent."""
    blob = bytes(range(256)) * 4096  # 1 MiB
    with LiveServer(tmp_path, blob_memory_bytes=64 * 1024, max_inflight_bytes=1536 * 1024,
                    inflight_wait_seconds=0.2) as srv:
        key, spec = make_spec(0)
        srv.store.put_spec(key, spec)
        srv.store.publish_plan(*make_plan(key, gpu_env, blob=blob))
        sha = hashlib.sha256(blob).hexdigest()
        reader = {"Authorization": f"Bearer {srv.token('reader')}"}
        budget = srv.app.state.inflight

        def released() -> bool:  # given back after the answer is sent: a moment after the client has it
            deadline = time.monotonic() + 5
            while budget.used and time.monotonic() < deadline:
                time.sleep(0.01)
            return budget.used == 0

        r = httpx.get(f"{srv.url}/v1/blobs/{sha}", headers=reader)
        assert r.status_code == 200 and r.content == blob and released()
        assert budget.try_take(1024 * 1024)  # another answer holds most of the budget
        r = httpx.get(f"{srv.url}/v1/blobs/{sha}", headers=reader)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy" and "Retry-After" in r.headers
        budget.release(1024 * 1024)
        assert httpx.get(f"{srv.url}/v1/blobs/{sha}", headers=reader).content == blob and released()
