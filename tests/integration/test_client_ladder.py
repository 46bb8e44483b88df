"""The client's whole fallback ladder against a real local server (LiveServer, SQLite, loopback), the GPU
replaced by :class:`RecordingBackend`: good plans load from server, memory and disk; every bad blob is
rejected with its reason and never reaches ``deserialize``; a dead or slow server costs one short timeout."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from plancache.blobs import FolderBlobs
from plancache.client import PlanCache
from plancache.client.cache import BLOBS
from plancache.client.remote import MISS_RECHECK_SECONDS, REGISTER_ATTEMPTS
from plancache.client.server_step import ServerStep
from plancache.errors import PlanMiss
from plancache.settings import Settings
from plancache.spec import parse_spec
from tests.client_fakes import CountedStream, DripServer, RecordingBackend
from tests.factories import H200, OTHER_GPU, make_meta, make_record, new_signer, patient, trusted
from tests.live_server import LiveServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SPECS = {name: parse_spec((EXAMPLES / f"{name}.json").read_text())
         for name in ("conv_bias_relu", "conv_bias_relu_n8", "conv_bias_relu_n16", "sdpa_causal",
                      "matmul_scale_bias_gelu_amax")}
CONV, SDPA, MATMUL = SPECS["conv_bias_relu"], SPECS["sdpa_causal"], SPECS["matmul_scale_bias_gelu_amax"]


def blob_of(spec: Any) -> bytes:
    return f"serialized plan of {spec.name}".encode() * 20


class Wire(httpx.HTTPTransport):
    """The real network, with hooks: counts requests by path, may rewrite a resolve request's body
    and a resolve answer (to play a corrupting link or a confused server), and may answer a path's next requests
    itself with the error statuses queued in ``refusals`` (to play a rate limit, an overloaded or a refusing server)."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: Counter[str] = Counter()
        self.edit_request: Callable[[dict], None] | None = None
        self.edit_answer: Callable[[dict], None] | None = None
        self.refusals: dict[str, list[int]] = {}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths[request.url.path] += 1
        if queued := self.refusals.get(request.url.path):
            status = queued.pop(0)
            return httpx.Response(status, json={"error": {"code": f"http_{status}", "message": "refused by the wire"}})
        if request.url.path == "/v1/plans/resolve" and self.edit_request is not None:
            body = json.loads(request.content)
            self.edit_request(body)
            request = httpx.Request(request.method, request.url, headers={
                k: v for k, v in request.headers.items() if k.lower() != "content-length"}, json=body)
        resp = super().handle_request(request)
        if request.url.path != "/v1/plans/resolve" or self.edit_answer is None or resp.status_code != 200:
            return resp
        body = json.loads(resp.read())
        self.edit_answer(body)
        return httpx.Response(200, json=body)


def edit_blob(key: str, change: Callable[[bytes], bytes]) -> Callable[[dict], None]:
    def edit(body: dict) -> None:
        entry = body["plans"][key]
        if entry["blob_b64"] is not None:  # a client that cannot check signatures asks for records only
            entry["blob_b64"] = base64.b64encode(change(base64.b64decode(entry["blob_b64"]))).decode()
    return edit


@pytest.fixture
def srv(tmp_path):
    with LiveServer(tmp_path / "server") as server:
        yield server


@pytest.fixture(scope="module")
def signer():
    return new_signer()


@pytest.fixture
def wire():
    return Wire()


def seed(srv: LiveServer, spec: Any, signer: Any, env=H200, blob: bytes | None = None, **overrides: Any) -> bytes:
    """Publish a plan for ``spec`` straight into the server's store (bypassing upload checks)."""
    blob = blob if blob is not None else blob_of(spec)
    srv.store.put_spec(spec.graph_key, spec.to_json())
    srv.store.publish_plan(make_meta(spec.graph_key, env, blob, signer, **overrides), blob)
    return blob


def client(srv: LiveServer | None, tmp_path: Path, signer: Any, *, role: str = "reader", wire: Wire | None = None,
           backend: RecordingBackend | None = None, **kw: Any) -> PlanCache:
    """A client of ``srv`` through ``wire``, :func:`~tests.factories.patient` (a loaded CI machine once took over the
    default 5 s to answer a resolve, and a plan the test expected from the server was rebuilt)."""
    kw.setdefault("trusted_keys", trusted(signer))
    return PlanCache(srv.url if srv is not None else "", backend=backend or RecordingBackend(),
                     token=srv.token(role) if srv is not None else None, cache_dir=tmp_path / "cache",
                     transport=wire, **patient(kw))


def test_a_fresh_process_loads_from_the_server_then_memory_then_disk_offline(srv, tmp_path, signer, wire):
    blob = seed(srv, CONV, signer)
    with client(srv, tmp_path, signer, wire=wire) as pc:
        plan = pc.plan(CONV)
        assert plan.source == "server" and plan.engine_id == 7 and plan.knobs == {"TILE_M": 2}
        assert pc._backend.deserialized == [blob]
        assert pc.plan(CONV.to_json()) is plan  # any spec form; memory
        s = pc.stats()
        assert s.hits == {"server": 1, "memory": 1} and s.rejects == {} and s.misses == 0
        assert s.load_seconds > 0 and s.deserialize_seconds > 0
    assert wire.paths["/v1/plans/resolve"] == 1
    # A new process with no network at all starts from the disk cache, re-verifying the entry.
    srv.stop()
    offline = client(None, tmp_path, signer)
    plan = offline.plan(CONV)
    assert plan.source == "disk" and offline._backend.deserialized == [blob]
    assert offline.stats().hits == {"disk": 1} and offline.stats().remote_errors == 0


BAD_BLOBS = [
    # case, reject reason, the rung that serves instead (an authentic record is rebuilt from its engine config)
    ("corrupted_byte", "sha256", "rebuild"),
    ("truncated", "size", "rebuild"),
    ("wrong_signature", "bad_signature", "heuristic"),
    ("unknown_signer", "unknown_signer", "heuristic"),
    ("unsigned", "unsigned", "heuristic"),
    ("other_environment", "environment", "heuristic"),
    ("bad_base64", "malformed", "rebuild"),
]


@pytest.mark.parametrize("case, reason, served_by", BAD_BLOBS)
def test_a_bad_blob_is_rejected_with_its_reason_and_never_deserialized(srv, tmp_path, signer, wire, case, reason, served_by):
    key = CONV.graph_key
    if case == "corrupted_byte":
        seed(srv, CONV, signer)
        wire.edit_answer = edit_blob(key, lambda b: b[:100] + bytes([b[100] ^ 0x01]) + b[101:])
    elif case == "truncated":
        seed(srv, CONV, signer)
        wire.edit_answer = edit_blob(key, lambda b: b[: len(b) // 2])
    elif case == "wrong_signature":
        good = make_meta(key, H200, blob_of(CONV), signer)
        sig = good.envelope.signatures[0]
        flipped = sig.model_copy(update={"sig": sig.sig[:-4] + ("AAA=" if not sig.sig.endswith("AAA=") else "BBB=")})
        seed(srv, CONV, signer=None, revision=good.revision,
             envelope=good.envelope.model_copy(update={"signatures": [flipped]}))
    elif case == "unknown_signer":
        seed(srv, CONV, new_signer())
    elif case == "unsigned":
        seed(srv, CONV, signer=None)
    elif case == "other_environment":
        # A correctly signed plan for another GPU, served by a confused server for this one.
        seed(srv, CONV, signer, env=OTHER_GPU)
        wire.edit_request = lambda body: body.update(environment=OTHER_GPU.model_dump())
    elif case == "bad_base64":
        seed(srv, CONV, signer)
        wire.edit_answer = lambda body: body["plans"][key].update(blob_b64="not*base64!")
    pc = client(srv, tmp_path, signer, wire=wire)
    plan = pc.plan(CONV)
    assert plan.source == served_by
    s = pc.stats()
    assert s.rejects == {reason: 1}
    assert pc._backend.deserialized == [], "a rejected blob reached deserialize"
    assert s.hits == {served_by: 1} and s.misses == 1 and s.fallbacks["server"] == 1
    folder = tmp_path / "cache" / H200.env_id  # no entry written (a dot file is bookkeeping: a fetch lock)
    assert not folder.exists() or not [p for p in folder.iterdir() if not p.name.startswith(".")]


def test_a_blob_left_out_of_the_answer_is_fetched_by_its_digest(srv, tmp_path, signer, wire):
    blob = seed(srv, CONV, signer)
    wire.edit_answer = lambda body: body["plans"][CONV.graph_key].update(blob_b64=None)
    pc = client(srv, tmp_path, signer, wire=wire)
    assert pc.plan(CONV).source == "server" and pc._backend.deserialized == [blob]
    assert wire.paths[f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}"] == 1


def test_a_server_that_is_down_costs_one_failed_connect_then_is_skipped(srv, tmp_path, signer, wire):
    seed(srv, SDPA, signer)
    srv.stop()
    pc = client(srv, tmp_path, signer, wire=wire, cooldown=0.5)
    t0 = time.monotonic()
    assert pc.plan(CONV).source == "heuristic"
    assert pc.plan(MATMUL).source == "heuristic"
    assert time.monotonic() - t0 < 2
    s = pc.stats()
    assert s.remote_errors == 1 and s.remote_skipped == 1 and s.fallbacks["server"] == 2 and s.misses == 2
    assert wire.paths["/v1/plans/resolve"] == 1
    # Back up, and the cool-down over: the server is asked again.
    srv.start()
    time.sleep(0.6)
    assert pc.plan(SDPA).source == "server"
    assert wire.paths["/v1/plans/resolve"] == 2


def test_a_slow_server_times_out_quickly_and_is_then_skipped(srv, tmp_path, signer, wire):
    seed(srv, CONV, signer)
    srv.delay = 3.0
    pc = client(srv, tmp_path, signer, wire=wire, read_timeout=0.3, connect_timeout=0.3)
    t0 = time.monotonic()
    assert pc.plan(CONV).source == "heuristic"
    assert pc.plan(SDPA).source == "heuristic"
    elapsed = time.monotonic() - t0
    assert elapsed < 1.5, f"two plan() calls against a slow server took {elapsed:.2f} s"
    s = pc.stats()
    assert s.remote_errors == 1 and s.remote_skipped == 1
    assert wire.paths["/v1/plans/resolve"] == 1


@pytest.mark.parametrize("phase", ["body", "headers"])
def test_a_dripping_server_costs_at_most_the_request_deadline(tmp_path, signer, phase):
    """Before: an answer dripped one byte every 50 ms held prefetch until its last byte (20 s for this 400-byte
    answer; the read timeout is per chunk, and every chunk came in time). Now the whole exchange is cut at the
    deadline, connect and headers included, and the breaker keeps the next load off the network."""
    answer = b'{"plans": {}, "missing": []}'.ljust(400)
    with DripServer(answer, interval=0.05, drip_headers=phase == "headers") as drip:
        pc = PlanCache(drip.url, backend=RecordingBackend(), trusted_keys=trusted(signer), cache_dir=tmp_path / "cache",
                       request_deadline=1.0, read_timeout=5.0)
        t0 = time.monotonic()
        plans = pc.prefetch([CONV, SDPA])
        elapsed = time.monotonic() - t0
        assert elapsed < 1.5, f"prefetch took {elapsed:.1f} s against a dripping server (deadline 1 s)"
        assert [p.source for p in plans.values()] == ["heuristic", "heuristic"]
        assert drip.requests == 1 and drip.sent < len(answer)
        s = pc.stats()
        assert s.remote_errors == 1 and s.fallbacks["server"] == 2 and pc._remote.is_off
        t0 = time.monotonic()
        assert pc.plan(MATMUL).source == "heuristic"
        assert time.monotonic() - t0 < 0.5 and pc.stats().remote_skipped == 1 and drip.requests == 1


class OversizeBlobs(Wire):
    """The real server, except that every blob download is answered with ``body`` (no Content-Length)."""

    def __init__(self, body: CountedStream) -> None:
        super().__init__()
        self.body = body

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/blobs/"):
            self.paths[request.url.path] += 1
            return httpx.Response(200, stream=self.body)
        return super().handle_request(request)


def test_an_oversize_blob_download_is_cut_off_at_its_record_size(srv, tmp_path, signer):
    """Before: a 512 MiB body served for a blob whose record says 740 bytes was read whole, then refused by size.
    Now the download stops as soon as it passes the record's size: a server failure (breaker open), nothing
    deserialized, and the authentic record's engine config is rebuilt."""
    blob = seed(srv, CONV, signer)
    huge = CountedStream(512 * 1024 * 1024, chunk=1024)
    wire = OversizeBlobs(huge)
    wire.edit_answer = lambda body: body["plans"][CONV.graph_key].update(blob_b64=None)
    # a deadline that a loaded CI machine's resolve cannot miss: the cut-off, not the deadline, must end the download
    pc = client(srv, tmp_path, signer, wire=wire, request_deadline=60.0)
    assert pc.plan(CONV).source == "rebuild" and pc._backend.deserialized == []
    assert huge.read <= len(blob) + 1 + huge.chunk, f"{huge.read} bytes read for a {len(blob)}-byte blob"
    s = pc.stats()
    assert s.remote_errors == 1 and s.rejects == {} and pc._remote.is_off and cached_files(tmp_path) == []


def test_an_oversize_resolve_answer_is_cut_off(srv, tmp_path, signer):
    """A resolve answer is read up to min(PLANCACHE_RESOLVE_MAX_BYTES, keys x (record + base64 of the largest
    blob)); a longer one fails the round trip."""
    seed(srv, CONV, signer)
    pc = client(srv, tmp_path, signer, settings=Settings(resolve_max_bytes=512))
    assert pc._remote.resolve_limit(1, True) == 512
    assert pc.plan(CONV).source == "heuristic" and pc._backend.deserialized == []
    assert pc.stats().remote_errors == 1 and pc._remote.is_off
    roomy = client(srv, tmp_path / "r", signer, settings=Settings(max_blob_bytes=4096))
    assert roomy._remote.resolve_limit(2, True) == 64 * 1024 + 2 * (16 * 1024 + 5464)  # 5464: base64 of 4096 bytes
    assert roomy.plan(CONV).source == "server"


def test_misses_are_recorded_and_specs_registered_with_a_reader_token(srv, tmp_path, signer, wire):
    reader = client(srv, tmp_path / "r", signer, wire=wire)
    assert reader.plan(CONV).source == "heuristic"
    assert [m.graph_key for m in srv.store.list_misses()] == [CONV.graph_key]
    assert srv.store.get_spec(CONV.graph_key) is not None  # an admin can now tune the miss
    reader.plan(SDPA)
    assert srv.store.get_spec(SDPA.graph_key) is not None
    assert wire.paths["/v1/specs"] == 2  # one registration per missed graph
    assert not reader._remote.is_off
    worker = client(srv, tmp_path / "w", signer, role="worker")
    worker.plan(MATMUL)
    assert srv.store.get_spec(MATMUL.graph_key) is not None
    assert {m.graph_key: m.count for m in srv.store.list_misses()}[MATMUL.graph_key] == 1


def test_prefetch_resolves_everything_in_one_round_trip(srv, tmp_path, signer, wire):
    for name in ("conv_bias_relu", "conv_bias_relu_n8", "sdpa_causal"):
        seed(srv, SPECS[name], signer)
    specs = list(SPECS.values())
    pc = client(srv, tmp_path, signer, wire=wire, role="worker")
    plans = pc.prefetch(specs + [CONV])
    assert set(plans) == {s.graph_key for s in specs}
    assert Counter(p.source for p in plans.values()) == {"server": 3, "heuristic": 2}
    assert wire.paths["/v1/plans/resolve"] == 1 and wire.paths["/v1/specs"] == 2
    before = sum(wire.paths.values())
    assert all(pc.plan(s) is plans[s.graph_key] for s in specs)
    assert sum(wire.paths.values()) == before and pc.stats().hits["memory"] == len(specs)
    pc.close()  # the process exits: its background disk writes are finished (the interpreter waits for them too)
    # A second process finds the three tuned plans on disk and asks the server only for the others.
    wire2 = Wire()
    again = client(srv, tmp_path, signer, wire=wire2).prefetch(specs)
    assert Counter(p.source for p in again.values()) == {"disk": 3, "heuristic": 2}
    assert wire2.paths["/v1/plans/resolve"] == 1


def test_a_load_works_each_specs_key_out_once(srv, tmp_path, signer, wire, monkeypatch):
    """The graph key (the spec's canonical form, hashed) is the client's one costly step per served graph before
    its plan is ready: worked out once per spec, whatever takes the load through the ladder (it was twice, 0.14 ms
    a graph on the 2-core development machine). A missed graph's local build also works out its shape family."""
    from plancache.spec import GraphSpec, keys

    specs = [parse_spec(s.to_json()) for s in SPECS.values()]  # fresh documents: no key worked out yet
    for spec in specs[:3]:
        seed(srv, parse_spec(spec.to_json()), signer)
    canonical_form = keys.canonical_form
    made: Counter[str] = Counter()

    def counted(spec: GraphSpec) -> dict[str, Any]:
        if threading.current_thread() is threading.main_thread():  # the client's, not the in-process server's
            made[spec.name] += 1
        return canonical_form(spec)

    monkeypatch.setattr(keys, "canonical_form", counted)
    pc = client(srv, tmp_path, signer, wire=wire, role="worker")
    plans = pc.prefetch(specs)
    assert [plans[s.graph_key].source for s in specs] == ["server"] * 3 + ["heuristic"] * 2
    assert all(pc.plan(s) is plans[s.graph_key] for s in specs)
    assert made == {s.name: 1 if i < 3 else 2 for i, s in enumerate(specs)}, made


def test_a_cache_closed_during_a_load_falls_back_instead_of_raising(srv, tmp_path, signer):
    """``close()`` on one thread (a shutdown handler) while another's load is at the server: httpx's "the client has
    been closed" ``RuntimeError`` escaped ``plan()``; it is the server being unavailable, and the load goes on."""
    seed(srv, CONV, signer)
    pc = client(srv, tmp_path, signer)
    assert pc._remote is not None
    pc._remote.http.close()  # what close() does to a load already past the remote's checks
    assert pc.plan(CONV).source == "heuristic" and pc.stats().remote_errors == 1
    pc.close()


def test_a_forked_child_is_told_to_make_its_own_cache(srv, tmp_path, signer):
    """A child forked from a process with a PlanCache (a data loader's workers) shares its locks, threads and server
    connection: a load there hung on the parent's pending disk writes or read the parent's answers off the shared
    socket. The child gets :class:`ForkedProcess` naming what to do; its ``close()`` leaves the parent's alone."""
    import os

    from plancache.errors import ForkedProcess

    seed(srv, CONV, signer)
    seed(srv, SDPA, signer)
    pc = client(srv, tmp_path, signer)
    assert pc.plan(CONV).source == "server" and not pc.forked
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        outcome = "no error"
        try:
            pc.plan(SDPA)
        except ForkedProcess as exc:
            outcome = str(exc)
        pc.close()
        os.write(write, f"{pc.forked} {outcome}".encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    said = os.read(read, 4096).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert said.startswith("True this PlanCache was made in process") and "make a PlanCache in the child" in said
    assert pc.plan(SDPA).source == "server"  # the parent's cache is untouched
    pc.close()


def a_minute_on(pc: PlanCache) -> None:
    """As it is a minute on for ``pc``: its miss memory and its circuit breaker's cool-down are past."""
    from plancache.http import CircuitBreaker

    (step,) = [s for s in pc.steps if isinstance(s, ServerStep)]
    step.missed.expire(time.monotonic() + MISS_RECHECK_SECONDS)
    (breaker,) = [p for p in pc._remote.http.policies if isinstance(p, CircuitBreaker)]
    breaker._off_until = None


def test_a_registration_over_the_spec_write_budget_leaves_the_server_on(srv, tmp_path, signer, wire):
    """A 429 to POST /v1/specs (the token's spec-write budget: a fleet sharing one reader token, a warm start missing
    many graphs) turned the server off for this process for the breaker's cool-down: a graph tuned on the server then
    missed as 'server: unavailable' in strict mode, and each later retry of the registration did it again."""
    seed(srv, SDPA, signer)
    pc = client(srv, tmp_path, signer, wire=wire, mode="strict")
    wire.refusals["/v1/specs"] = [429] * 3
    with pytest.raises(PlanMiss, match="the server had never seen this graph's spec: the client that missed it "
                                       "registers it; .*; its spec was not registered: "):
        pc.plan(CONV)
    assert pc.plan(SDPA).source == "server" and pc.stats().remote_skipped == 0
    a_minute_on(pc)
    with pytest.raises(PlanMiss):
        pc.plan(CONV)  # the registration is sent again, refused again
    assert wire.paths["/v1/specs"] == 2 and not pc._remote.is_off


def test_registrations_held_back_by_the_breaker_are_sent_later_and_a_failing_one_at_most_a_few_times(
        srv, tmp_path, signer, wire):
    """A 503 to the first registration of a load turns the remote off: the others are not sent at all, so they
    are not attempts; each is sent at a later miss. A spec the server keeps refusing is sent
    ``REGISTER_ATTEMPTS`` times in all, then no more by this process."""

    pc = client(srv, tmp_path, signer, wire=wire, mode="strict")
    wire.refusals["/v1/specs"] = [503] * (2 * REGISTER_ATTEMPTS + 1)
    with pytest.raises(PlanMiss):
        pc.prefetch([CONV, SDPA])
    assert wire.paths["/v1/specs"] == 1 and pc.stats().remote_skipped == 1
    for _ in range(2 * REGISTER_ATTEMPTS + 1):  # CONV's attempts (SDPA's held back by each 503), then SDPA's
        a_minute_on(pc)
        with pytest.raises(PlanMiss):
            pc.prefetch([CONV, SDPA])
    assert wire.paths["/v1/specs"] == 2 * REGISTER_ATTEMPTS
    assert srv.store.get_spec(CONV.graph_key) is None and srv.store.get_spec(SDPA.graph_key) is None


def test_a_first_miss_takes_two_round_trips_and_says_why_in_the_server_s_words(srv, tmp_path, signer, wire):
    """The resolve answer says why each key is missing, read once the miss is recorded: a first miss is the resolve
    and the spec's registration (it was three: resolve, explain, register, and the client rewrote the explanation,
    which the registration had made stale). The reason says what follows the registration, as the server words it."""
    pc = client(srv, tmp_path, signer, wire=wire, mode="strict")
    with pytest.raises(PlanMiss) as exc:
        pc.plan(CONV)
    assert sum(wire.paths.values()) == 2 and wire.paths == {"/v1/plans/resolve": 1, "/v1/specs": 1}
    assert re.search(r"server: no plan: the server had never seen this graph's spec: the client that missed it "
                     r"registers it; autotune queues it once it missed PLANCACHE_AUTOTUNE_MIN_MISSES times here .*or an "
                     r"admin enqueues it \(POST /v1/admin/tune/misses", str(exc.value))
    assert srv.store.get_spec(CONV.graph_key) is not None and pc.stats().miss_reasons == {"not_registered": 1}
    again = client(srv, tmp_path / "again", signer, wire=wire, mode="strict")  # registered now: the resolve alone
    with pytest.raises(PlanMiss, match=r"server: no plan: the spec is registered, missed 1 time on"):
        again.plan(CONV)
    assert wire.paths == {"/v1/plans/resolve": 2, "/v1/specs": 1}


@pytest.mark.parametrize("explains", [True, False])
def test_an_older_server_s_misses_are_explained_by_its_explain_route_if_it_has_one(srv, tmp_path, signer, wire,
                                                                                   explains):
    """A server of API 1.1 gives no reasons in its resolve answer: the client asks its explain route (three round
    trips for a first miss, as that server's clients did); a server without the route leaves the miss
    unexplained, and the server on."""
    wire.edit_answer = lambda body: body.pop("reasons")
    if not explains:
        wire.refusals["/v1/plans/explain"] = [404]
    pc = client(srv, tmp_path, signer, wire=wire, mode="strict")
    with pytest.raises(PlanMiss, match="server: no plan: the server has never seen" if explains else
                       "server: no plan for this environment"):
        pc.plan(CONV)
    assert wire.paths == {"/v1/plans/resolve": 1, "/v1/plans/explain": 1, "/v1/specs": 1}
    assert pc.stats().miss_reasons == {"not_registered" if explains else "unexplained": 1} and not pc._remote.is_off


def test_credentials_the_server_refuses_turn_the_remote_off(srv, tmp_path, signer, wire):
    seed(srv, CONV, signer)
    pc = PlanCache(srv.url, backend=RecordingBackend(), token="pct_not-a-real-token", trusted_keys=trusted(signer),
                   cache_dir=tmp_path / "cache", transport=wire)
    assert pc.plan(CONV).source == "heuristic" and pc.plan(SDPA).source == "heuristic"
    assert pc.stats().remote_errors == 1 and pc.stats().remote_skipped == 1


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


EVIL = b"the attacker's own plan" * 40  # what a hostile proxy substitutes


def forge(key: str, how: str) -> Callable[[dict], None]:
    """A hostile link's edit of the resolve answer for ``key``: every forgery keeps size and digest consistent."""
    def edit(body: dict) -> None:
        entry = body["plans"][key]
        rec = entry["record"]
        if how == "replaced_blob":  # another blob, its digest and size recomputed
            entry["blob_b64"] = b64(EVIL)
            rec.update(blob_sha256=hashlib.sha256(EVIL).hexdigest(), blob_size=len(EVIL))
        elif how == "relabelled_gpu":  # another GPU's plan, relabelled for this one
            rec.update(environment=H200.model_dump(mode="json"), env_id=H200.env_id)
        elif how == "rewritten_config":  # the engine config rewritten, the blob spoiled so that it is rebuilt
            rec.update(engine_id=666, knobs={"TILE_M": 64})
            entry["blob_b64"] = b64(b"spoiled")
    return edit


FORGERIES = ["replaced_blob", "relabelled_gpu", "rewritten_config"]


def forged_server(srv: LiveServer, signer: Any, how: str) -> Wire:
    """The plan of CONV as a hostile link delivers it: a :class:`Wire` playing the proxy."""
    wire = Wire()
    if how == "relabelled_gpu":
        seed(srv, CONV, signer, env=OTHER_GPU)
        wire.edit_request = lambda body: body.update(environment=OTHER_GPU.model_dump(mode="json"))
    else:
        seed(srv, CONV, signer)
    wire.edit_answer = forge(CONV.graph_key, how)
    return wire


def blob_path(folder: Path, sha256: str) -> Path:
    """Where the disk cache's folder of an environment keeps blob ``sha256`` (its shard folders made)."""
    path = FolderBlobs(folder / BLOBS, create=False).path(sha256)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def blob_files(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.glob(f"*/{BLOBS}/*/*/*") if p.is_file()]


def cached_files(tmp_path: Path) -> list[str]:
    """The record and blob files of the disk cache under ``tmp_path``."""
    cache_dir = tmp_path / "cache"
    return sorted([p.name for p in cache_dir.glob("*/*.json")] + [p.name for p in blob_files(cache_dir)])


@pytest.mark.parametrize("how", FORGERIES)
def test_without_trusted_keys_a_forged_plan_is_refused_never_cached_and_built_locally(srv, tmp_path, signer, how, caplog):
    """Before: with no trusted keys each forgery was deserialized (or its rewritten engine config rebuilt) and
    written to the disk cache, from which the next process loaded it offline."""
    wire = forged_server(srv, signer, how)
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        pc = client(srv, tmp_path, signer, wire=wire, trusted_keys=None, settings=Settings(trusted_keys=None))
    assert "no trusted keys configured" in caplog.text and "refused (no_trusted_keys)" in caplog.text
    plan = pc.plan(CONV)
    assert (plan.source, pc._backend.deserialized) == ("heuristic", []), "a forged plan was loaded"
    assert not [c for c in pc._backend.calls if c[0] == "engine_config"], "a forged engine config was rebuilt"
    reason = "size" if how == "rewritten_config" else "no_trusted_keys"  # the spoiled blob fails a step earlier
    assert pc.stats().rejects == {reason: 1}
    assert cached_files(tmp_path) == [], "a forged plan was written to the disk cache"
    # Strict mode names the reason and what to do.
    strict = client(srv, tmp_path / "s", signer, wire=wire, trusted_keys=None, settings=Settings(trusted_keys=None),
                    mode="strict")
    with pytest.raises(PlanMiss, match=rf"server: rejected \({reason}\).*no trusted keys are configured"):
        strict.plan(CONV)
    assert strict._backend.calls == [] and cached_files(tmp_path / "s") == []


def test_without_trusted_keys_a_cached_entry_is_refused_but_kept(srv, tmp_path, signer):
    """A disk entry is not judged without keys: refused (no_trusted_keys), and left for a process that has them."""
    seed(srv, CONV, signer)
    with client(srv, tmp_path, signer) as first:
        first.plan(CONV)
    files = cached_files(tmp_path)
    assert len(files) == 2
    offline = client(None, tmp_path, signer, trusted_keys=None, settings=Settings(trusted_keys=None))
    assert offline.plan(CONV).source == "heuristic" and offline._backend.deserialized == []
    assert offline.stats().rejects == {"no_trusted_keys": 1} and cached_files(tmp_path) == files
    assert client(None, tmp_path, signer).plan(CONV).source == "disk"


@pytest.mark.parametrize("how", ["setting", "config"])
def test_the_insecure_opt_out_admits_unsigned_plans_but_never_writes_them_to_disk(srv, tmp_path, signer, how, caplog,
                                                                                 monkeypatch):
    seed(srv, CONV, signer=None)
    seed(srv, SDPA, signer=None)
    wire = Wire()
    wire.edit_answer = lambda body: body["plans"].get(SDPA.graph_key, {}).update(blob_b64=b64(b"x"))
    if how == "setting":
        monkeypatch.setenv("PLANCACHE_INSECURE_ALLOW_UNSIGNED", "1")
        opt_out: dict[str, Any] = {}
    else:
        opt_out = {"insecure_allow_unsigned": True}
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        pc = client(srv, tmp_path, signer, wire=wire, trusted_keys=None, **opt_out)
    assert pc.insecure_allow_unsigned and "INSECURE" in caplog.text
    assert pc.plan(CONV).source == "server" and pc._backend.deserialized == [blob_of(CONV)]
    # Digests are still checked; an unsigned record is never authentic, so its engine config is not rebuilt.
    assert pc.plan(SDPA).source == "heuristic" and pc.stats().rejects == {"size": 1}
    assert cached_files(tmp_path) == [], "an unsigned plan was written to the disk cache"
    offline = client(None, tmp_path, signer, trusted_keys=None, **opt_out)
    assert offline.plan(CONV).source == "heuristic"
    # With trusted keys the opt-out changes nothing: every plan must be signed by one of them.
    keyed = client(srv, tmp_path / "k", signer, **opt_out)
    assert not keyed.insecure_allow_unsigned
    assert keyed.plan(CONV).source == "heuristic" and keyed.stats().rejects == {"unsigned": 1}


@pytest.mark.parametrize("mode", ["strict", "replay_only"])
def test_strict_and_replay_only_refuse_unsigned_plans_even_with_the_opt_out(srv, tmp_path, signer, mode, caplog):
    seed(srv, CONV, signer=None)
    with caplog.at_level(logging.ERROR, logger="plancache.client"):
        pc = client(srv, tmp_path, signer, trusted_keys=None, settings=Settings(trusted_keys=None),
                    insecure_allow_unsigned=True, mode=mode)
    assert not pc.insecure_allow_unsigned
    assert f"{mode} mode admits signed plans only" in caplog.text and "ignored" in caplog.text
    with pytest.raises(PlanMiss, match=rf"rejected \(no_trusted_keys\).*{mode} mode admits signed plans only"):
        pc.plan(CONV)
    assert pc._backend.calls == [] and cached_files(tmp_path) == []


@pytest.mark.parametrize("case", ["unsigned_damaged_blob", "unsigned_refused_by_cudnn", "strict_without_keys"])
def test_only_an_authentic_record_is_rebuilt(srv, tmp_path, signer, case):
    """Before: an unsigned record whose blob was damaged (or refused by cuDNN) had its (engine_id, knobs) built."""
    seed(srv, CONV, signer=None if case != "strict_without_keys" else signer)
    wire = Wire()
    backend = RecordingBackend(fail=("deserialize",) if case == "unsigned_refused_by_cudnn" else ())
    if case != "unsigned_refused_by_cudnn":
        wire.edit_answer = edit_blob(CONV.graph_key, lambda b: b[:-1] + b"!")
    if case == "strict_without_keys":
        pc = client(srv, tmp_path, signer, wire=wire, backend=backend, trusted_keys=None,
                    settings=Settings(trusted_keys=None), mode="strict")
        with pytest.raises(PlanMiss, match="no authentic tuned record"):
            pc.plan(CONV)
    else:
        pc = client(srv, tmp_path, signer, wire=wire, backend=backend, trusted_keys=None, insecure_allow_unsigned=True)
        assert pc.plan(CONV).source == "heuristic"
    assert not [c for c in backend.calls if c[0] == "engine_config"], "an unauthenticated engine config was built"
    # The same damage on a signed record, with its key trusted, is rebuilt.
    seed(srv, SDPA, signer)
    wire.edit_answer = edit_blob(SDPA.graph_key, lambda b: b[:-1] + b"!")
    assert client(srv, tmp_path / "k", signer, wire=wire).plan(SDPA).source == "rebuild"


def test_trusted_keys_come_from_the_setting(srv, tmp_path, signer, monkeypatch):
    from cryptography.hazmat.primitives import serialization

    pub = tmp_path / "keys" / "plancache.pub"
    pub.parent.mkdir()
    pub.write_bytes(signer.private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    seed(srv, CONV, signer)
    seed(srv, SDPA, new_signer())
    monkeypatch.setenv("PLANCACHE_TRUSTED_KEYS", str(pub.parent))
    monkeypatch.setenv("PLANCACHE_SERVER_URL", srv.url)
    monkeypatch.setenv("PLANCACHE_TOKEN", srv.token("reader"))
    monkeypatch.setenv("PLANCACHE_CACHE_DIR", str(tmp_path / "cache"))
    pc = PlanCache(backend=RecordingBackend())
    assert pc.plan(CONV).source == "server"
    assert pc.plan(SDPA).source == "heuristic" and pc.stats().rejects == {"unknown_signer": 1}


def test_trusted_keys_given_as_paths(srv, tmp_path, signer):
    """``trusted_keys=`` takes what the setting names, as a path too: a key file or a folder of ``*.pub``, alone or
    in a list (a single ``Path`` was iterated, and failed with "'PosixPath' object is not iterable")."""
    from cryptography.hazmat.primitives import serialization

    folder = tmp_path / "keys"
    folder.mkdir()
    pub = folder / "fleet.pub"
    pub.write_bytes(signer.private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    (folder / "README").write_text("not a key: only *.pub files are read from a folder")
    seed(srv, CONV, signer)
    for i, keys in enumerate((pub, folder, [folder], [str(pub)], str(folder))):
        pc = PlanCache(srv.url, token=srv.token("reader"), trusted_keys=keys, cache_dir=tmp_path / f"cache{i}",
                       backend=RecordingBackend(), mode="strict")
        assert pc.trusted_keys.key_ids == [signer.key_id], keys
        assert pc.plan(CONV).source == "server"
        pc.close()
    with pytest.raises(FileNotFoundError, match="missing.pub"):
        PlanCache(srv.url, trusted_keys=folder / "missing.pub", cache_dir=tmp_path / "c", backend=RecordingBackend())


# ------------------------------------------------------------------ revisions and key rotation


def test_an_older_signed_record_is_refused_once_a_newer_one_was_accepted(srv, tmp_path, signer):
    """A replay: a validly signed but older record of a key and environment, served by a hostile link or left
    in the disk cache, is refused (``revision``) once this cache folder accepted a newer one."""
    key, old_blob = CONV.graph_key, b"the plan before the re-tune" * 30
    old = make_record(key, H200, old_blob, signer)
    new_blob = seed(srv, CONV, signer)  # signed after ``old``: a higher revision
    new = srv.store.get_plan(key, H200)
    assert new.revision > old.revision
    first = client(srv, tmp_path, signer)
    assert first.plan(CONV).source == "server" and first.disk.revision(key) == new.revision
    first.disk.flush()  # the revision file is written in the background
    folder = tmp_path / "cache" / H200.env_id
    assert (folder / f"{key}.revision").read_text() == str(new.revision)

    (folder / f"{key}.json").unlink()  # evicted: the next process asks the server, which a hostile link answers
    wire = Wire()
    wire.edit_answer = lambda body: body["plans"][key].update(record=json.loads(old.model_dump_json()),
                                                              blob_b64=b64(old_blob))
    replayed = client(srv, tmp_path, signer, wire=wire)
    assert replayed.plan(CONV).source == "heuristic" and replayed._backend.deserialized == []
    assert replayed.stats().rejects == {"revision": 1}

    (folder / f"{key}.json").write_text(old.model_dump_json())  # the older plan put back in the disk cache
    blob_path(folder, old.blob_sha256).write_bytes(old_blob)
    offline = client(None, tmp_path, signer)
    assert offline.plan(CONV).source == "heuristic" and offline._backend.deserialized == []
    assert offline.stats().rejects == {"revision": 1}
    assert not (folder / f"{key}.json").exists(), "the stale entry was not dropped"
    assert client(srv, tmp_path, signer).plan(CONV).source == "server"  # the newer plan still loads
    assert srv.store.get_plan(key, H200).blob_sha256 == hashlib.sha256(new_blob).hexdigest()


def test_key_rotation_two_trusted_keys_then_one_retired(srv, tmp_path):
    """Rotation as docs/DESIGN.md describes it: clients trust the old and the new key, workers sign with the new
    one, ``plancache plans resign`` signs the stored records again with it (a higher revision replaces each),
    then the old key is retired: a record only it signed is refused, the others still load."""
    from typer.testing import CliRunner

    from plancache.cli import make_app
    from plancache.errors import StaleRevision
    from plancache.protocol import PlanMeta
    from plancache.signing import Signer, TrustedKeys, keygen

    old_key, old_pub, _ = keygen(tmp_path / "keys", "old")
    new_key, new_pub, _ = keygen(tmp_path / "keys", "new")
    old, new = Signer.from_file(old_key), Signer.from_file(new_key)
    seed(srv, CONV, old)
    seed(srv, SDPA, new)
    both = TrustedKeys.from_files([old_pub, new_pub])
    during = client(srv, tmp_path / "during", new, trusted_keys=both).prefetch([CONV, SDPA])
    assert {p.source for p in during.values()} == {"server"}

    after = client(srv, tmp_path / "after", new, trusted_keys=[new_pub])  # the old key retired
    plans = after.prefetch([CONV, SDPA])
    assert {k: p.source for k, p in plans.items()} == {CONV.graph_key: "heuristic", SDPA.graph_key: "server"}
    assert after.stats().rejects == {"unknown_signer": 1}

    before = srv.store.get_plan(CONV.graph_key, H200)
    result = CliRunner().invoke(make_app(), ["plans", "resign", "--signing-key", str(new_key), "--trusted-keys",
                                             f"{old_pub},{new_pub}", "--database-url", srv.settings.database_url])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert (f"signed 1 plan records again with key {new.key_id}; 1 were signed by it already, 0 replaced by a newer "
            "record meanwhile, 0 refused") in result.stdout
    resigned = srv.store.get_plan(CONV.graph_key, H200)
    assert resigned.signer_key_id == new.key_id and resigned.revision > before.revision
    assert resigned.blob_sha256 == before.blob_sha256 and resigned.engine_id == before.engine_id
    with pytest.raises(StaleRevision):  # the old record cannot come back
        srv.store.publish_plan(PlanMeta.model_validate(before.model_dump(include=set(PlanMeta.model_fields))),
                               blob_of(CONV), replace=True)
    retired = client(srv, tmp_path / "retired", new, trusted_keys=[new_pub])
    assert {p.source for p in retired.prefetch([CONV, SDPA]).values()} == {"server"}
    # The cache folder that accepted the old key's record takes the re-signed one, and remembers its revision.
    again = client(srv, tmp_path / "during", new, trusted_keys=[new_pub])
    assert again.plan(CONV).source == "server" and again.stats().rejects == {"unknown_signer": 1}  # its disk entry
    assert again.disk.revision(CONV.graph_key) == resigned.revision


