"""The client's whole fallback ladder against a real local server (LiveServer, SQLite, loopback), the GPU
replaced by :class:`RecordingBackend`: good plans load from server, memory and disk; every bad blob is
rejected with its reason and never reaches ``deserialize``; a dead or slow server costs one short timeout."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from plancache.client import LADDER, MODES, Builds, ClientConfig, Pending, Plan, PlanCache, Step, family_key
from plancache.errors import PlanMiss
from plancache.settings import Settings
from plancache.spec import contiguous_strides, parse_spec
from tests.client_fakes import H200, OTHER_GPU, RecordingBackend, make_meta, make_record, new_signer, trusted
from tests.live_server import LiveServer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SPECS = {name: parse_spec((EXAMPLES / f"{name}.json").read_text())
         for name in ("conv_bias_relu", "conv_bias_relu_n8", "conv_bias_relu_n16", "sdpa_causal",
                      "matmul_scale_bias_gelu_amax")}
CONV, SDPA, MATMUL = SPECS["conv_bias_relu"], SPECS["sdpa_causal"], SPECS["matmul_scale_bias_gelu_amax"]


def blob_of(spec: Any) -> bytes:
    return f"serialized plan of {spec.name}".encode() * 20


class Wire(httpx.HTTPTransport):
    """The real network, with hooks: counts requests by path, may rewrite a resolve request's body
    and a resolve answer (to play a corrupting link or a confused server)."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: Counter[str] = Counter()
        self.edit_request: Callable[[dict], None] | None = None
        self.edit_answer: Callable[[dict], None] | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths[request.url.path] += 1
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
    kw.setdefault("trusted_keys", trusted(signer))
    return PlanCache(srv.url if srv is not None else "", backend=backend or RecordingBackend(),
                     token=srv.token(role) if srv is not None else None, cache_dir=tmp_path / "cache",
                     transport=wire, **kw)


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
        seed(srv, CONV, signer=None, signature=good.signature[:-4] + ("AAA=" if not good.signature.endswith("AAA=") else "BBB="),
             signer_key_id=good.signer_key_id)
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
    assert not (tmp_path / "cache" / H200.env_id).exists() or not list((tmp_path / "cache" / H200.env_id).iterdir())


def test_a_blob_left_out_of_the_answer_is_fetched_by_its_digest(srv, tmp_path, signer, wire):
    blob = seed(srv, CONV, signer)
    wire.edit_answer = lambda body: body["plans"][CONV.graph_key].update(blob_b64=None)
    pc = client(srv, tmp_path, signer, wire=wire)
    assert pc.plan(CONV).source == "server" and pc._backend.deserialized == [blob]
    assert wire.paths[f"/v1/blobs/{hashlib.sha256(blob).hexdigest()}"] == 1


def test_concurrent_callers_of_one_spec_share_one_load(tmp_path, signer):
    backend = RecordingBackend()
    pc = client(None, tmp_path, signer, backend=backend)
    with ThreadPoolExecutor(8) as pool:
        plans = list(pool.map(lambda _: pc.plan(CONV), range(16)))
    assert all(p is plans[0] for p in plans)
    assert len(backend.calls) == 1 and pc.stats().hits == {"heuristic": 1, "memory": 15}


def test_a_loaded_plan_is_served_while_another_thread_builds(tmp_path, signer):
    release = threading.Event()

    class SlowBuilds(RecordingBackend):
        def build_heuristic(self, spec, kernel_cache, *, graph=None):
            if spec.graph_key == SDPA.graph_key:
                assert release.wait(10)
            return super().build_heuristic(spec, kernel_cache, graph=graph)

    pc = client(None, tmp_path, signer, backend=SlowBuilds())
    conv = pc.plan(CONV)
    with ThreadPoolExecutor(1) as pool:
        building = pool.submit(pc.plan, SDPA)
        time.sleep(0.05)
        t0 = time.monotonic()
        assert pc.plan(CONV) is conv
        assert time.monotonic() - t0 < 0.5 and not building.done()
        release.set()
        assert building.result(timeout=10).source == "heuristic"
    assert pc.stats().hits == {"heuristic": 2, "memory": 1}


def test_a_damaged_disk_entry_is_rejected_dropped_and_replaced_from_the_server(srv, tmp_path, signer):
    blob = seed(srv, CONV, signer)
    client(srv, tmp_path, signer).plan(CONV)
    folder = tmp_path / "cache" / H200.env_id
    blob_file = next(folder.glob("*.blob"))
    data = bytearray(blob_file.read_bytes())
    data[3] ^= 0xFF
    blob_file.write_bytes(bytes(data))
    pc = client(srv, tmp_path, signer)
    assert pc.plan(CONV).source == "server"
    assert pc.stats().rejects == {"sha256": 1} and pc._backend.deserialized == [blob]
    assert blob_file.read_bytes() == blob  # rewritten whole
    # A record file swapped in from another graph is refused by graph key.
    seed(srv, SDPA, signer)
    client(srv, tmp_path, signer).plan(SDPA)
    (folder / f"{CONV.graph_key}.json").write_bytes((folder / f"{SDPA.graph_key}.json").read_bytes())
    offline = client(None, tmp_path, signer)
    assert offline.plan(CONV).source == "heuristic"
    assert offline.stats().rejects == {"graph_key": 1} and offline._backend.deserialized == []


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
    # A second process finds the three tuned plans on disk and asks the server only for the others.
    wire2 = Wire()
    again = client(srv, tmp_path, signer, wire=wire2).prefetch(specs)
    assert Counter(p.source for p in again.values()) == {"disk": 3, "heuristic": 2}
    assert wire2.paths["/v1/plans/resolve"] == 1


def test_strict_mode_serves_tuned_plans_only(srv, tmp_path, signer, wire):
    seed(srv, CONV, signer)
    seed(srv, SDPA, new_signer())  # unknown signer
    seed(srv, MATMUL, signer)
    wire.edit_answer = lambda body: body["plans"][MATMUL.graph_key].update(blob_b64=base64.b64encode(b"junk").decode()) \
        if MATMUL.graph_key in body["plans"] else None
    pc = client(srv, tmp_path, signer, wire=wire, mode="strict")
    assert pc.plan(CONV).source == "server"
    with pytest.raises(PlanMiss, match=r"sdpa_causal.*strict mode.*server: rejected \(unknown_signer\)"):
        pc.plan(SDPA)
    # An authentic tuned record whose blob was damaged: its exact engine config is rebuilt.
    assert pc.plan(MATMUL).source == "rebuild"
    with pytest.raises(PlanMiss, match="conv_bias_relu_n8"):
        pc.plan(SPECS["conv_bias_relu_n8"])
    assert pc._backend.deserialized == [blob_of(CONV)]
    assert not [c for c in pc._backend.calls if c[0].startswith("heuristic")]
    # prefetch loads what it can, then names every graph without a plan.
    with pytest.raises(PlanMiss, match=r"2 of 3 graphs .*sdpa_causal.*conv_bias_relu_n16"):
        client(srv, tmp_path / "p", signer, mode="strict").prefetch([CONV, SDPA, SPECS["conv_bias_relu_n16"]])


def test_replay_only_mode_never_builds(srv, tmp_path, signer, wire):
    seed(srv, CONV, signer)
    seed(srv, MATMUL, signer)
    wire.edit_answer = lambda body: body["plans"].get(MATMUL.graph_key, {}).update(blob_b64=base64.b64encode(b"junk").decode())
    pc = client(srv, tmp_path, signer, wire=wire, mode="replay_only")
    assert pc.plan(CONV).source == "server"
    with pytest.raises(PlanMiss, match="replay_only"):
        pc.plan(MATMUL)
    with pytest.raises(PlanMiss):
        pc.plan(SDPA)
    assert [c[0] for c in pc._backend.calls] == ["deserialize"]


def test_a_verified_blob_that_cudnn_refuses_falls_back_to_the_engine_config(srv, tmp_path, signer):
    seed(srv, CONV, signer)
    pc = client(srv, tmp_path, signer, backend=RecordingBackend(fail=("deserialize",)))
    assert pc.plan(CONV).source == "rebuild"
    assert pc.stats().rejects == {"deserialize": 1}
    assert not list((tmp_path / "cache").rglob("*.blob"))
    both = client(srv, tmp_path / "b", signer, backend=RecordingBackend(fail=("deserialize", "engine_config")))
    assert both.plan(CONV).source == "heuristic" and both.stats().fallbacks["rebuild"] == 1


def test_credentials_the_server_refuses_turn_the_remote_off(srv, tmp_path, signer, wire):
    seed(srv, CONV, signer)
    pc = PlanCache(srv.url, backend=RecordingBackend(), token="pct_not-a-real-token", trusted_keys=trusted(signer),
                   cache_dir=tmp_path / "cache", transport=wire)
    assert pc.plan(CONV).source == "heuristic" and pc.plan(SDPA).source == "heuristic"
    assert pc.stats().remote_errors == 1 and pc.stats().remote_skipped == 1


def test_without_trusted_keys_digests_are_checked_and_a_warning_says_signatures_are_not(srv, tmp_path, caplog):
    seed(srv, CONV, signer=None)
    seed(srv, SDPA, signer=None)
    wire = Wire()
    wire.edit_answer = lambda body: body["plans"].get(SDPA.graph_key, {}).update(blob_b64=base64.b64encode(b"x").decode())
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        pc = PlanCache(srv.url, backend=RecordingBackend(), token=srv.token("reader"), cache_dir=tmp_path / "cache",
                       settings=Settings(trusted_keys=None), transport=wire)
    assert "signatures are not checked" in caplog.text
    assert pc.plan(CONV).source == "server"
    assert pc.plan(SDPA).source == "rebuild" and pc.stats().rejects == {"size": 1}


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


def test_a_shape_family_shares_one_kernel_cache(tmp_path, signer):
    backend = RecordingBackend()
    pc = client(None, tmp_path, signer, backend=backend)
    convs = [pc.plan(SPECS[n]) for n in ("conv_bias_relu_n8", "conv_bias_relu_n16", "conv_bias_relu")]
    sdpa = pc.plan(SDPA)
    caches = [p._built.kernel_cache for p in convs]
    assert caches[0] is caches[1] is caches[2] is not None
    assert sdpa._built.kernel_cache is not None and sdpa._built.kernel_cache is not caches[0]
    assert len(backend.kernel_caches) == 2
    assert len({family_key(SPECS[n]) for n in ("conv_bias_relu_n8", "conv_bias_relu_n16", "conv_bias_relu")}) == 1
    assert family_key(CONV) != family_key(SDPA)
    # Another layout (NCHW instead of NHWC) is another family.
    nchw = CONV.to_json()
    for t in nchw["tensors"]:
        if t["dim"]:
            t["stride"] = contiguous_strides(t["dim"])
    assert family_key(nchw) != family_key(CONV)


def test_a_family_whose_dynamic_build_fails_is_built_statically(tmp_path, signer):
    backend = RecordingBackend(fail=("dynamic",))
    pc = client(None, tmp_path, signer, backend=backend)
    assert pc.plan(SPECS["conv_bias_relu_n8"]).source == "heuristic"
    assert pc.plan(SPECS["conv_bias_relu_n16"]).source == "heuristic"
    assert [c[0] for c in backend.calls] == ["heuristic_dynamic", "heuristic", "heuristic"]


def test_a_failing_local_build_raises(tmp_path, signer):
    pc = client(None, tmp_path, signer, backend=RecordingBackend(fail=("dynamic", "heuristic")))
    with pytest.raises(RuntimeError, match="no engine supports"):
        pc.plan(CONV)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        PlanCache(None, backend=RecordingBackend(), mode="lenient", cache_dir=tmp_path)


class Bundled(Step):
    """A custom step (plans shipped with the application, say): its blobs are verified and loaded like any other."""

    name = "bundle"
    builds = Builds.NOTHING

    def __init__(self, cache: PlanCache, entries: dict[str, tuple[Any, bytes]]) -> None:
        super().__init__(cache)
        self.entries = entries

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        found = {}
        for p in batch:
            if p.key not in self.entries:
                p.note(self.name, "no entry")
            elif (plan := self.admit(p, *self.entries[p.key])) is not None:
                found[p] = plan
        return found


class Guess(Step):
    """A custom step that builds without a tuned record, so only the normal mode keeps it."""

    name = "guess"
    builds = Builds.HEURISTIC

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        return {}


def test_a_mode_keeps_the_steps_it_allows(tmp_path):
    config = ClientConfig(server_url="", backend=RecordingBackend(), cache_dir=tmp_path, steps=(*LADDER, Guess))
    assert PlanCache(config).config is config
    ladders = {mode: [s.name for s in PlanCache(config, mode=mode).steps] for mode in MODES}
    assert ladders == {"normal": ["memory", "disk", "server", "rebuild", "heuristic", "guess"],
                       "strict": ["memory", "disk", "server", "rebuild"],
                       "replay_only": ["memory", "disk", "server"]}


def test_a_custom_step_joins_the_ladder(srv, tmp_path, signer, wire):
    seed(srv, SDPA, signer)
    n8 = SPECS["conv_bias_relu_n8"]
    conv, matmul = blob_of(CONV), blob_of(MATMUL)
    entries = {CONV.graph_key: (make_record(CONV.graph_key, H200, conv, signer), conv),
               MATMUL.graph_key: (make_record(MATMUL.graph_key, H200, matmul, signer), matmul[:-1])}  # truncated
    asked: list[str] = []
    wire.edit_request = lambda body: asked.extend(body["graph_keys"])
    steps = (*LADDER[:2], partial(Bundled, entries=entries), *LADDER[2:])
    pc = client(srv, tmp_path, signer, wire=wire, steps=steps)
    assert [s.name for s in pc.steps] == ["memory", "disk", "bundle", "server", "rebuild", "heuristic"]
    plans = pc.prefetch([CONV, SDPA, MATMUL, n8])
    assert {k: p.source for k, p in plans.items()} == {
        CONV.graph_key: "bundle", SDPA.graph_key: "server", MATMUL.graph_key: "rebuild", n8.graph_key: "heuristic"}
    assert sorted(asked) == sorted([SDPA.graph_key, MATMUL.graph_key, n8.graph_key])  # one resolve, for the rest
    assert pc._backend.deserialized == [conv, blob_of(SDPA)]
    s = pc.stats()
    assert s.hits == {"bundle": 1, "server": 1, "rebuild": 1, "heuristic": 1}  # the bundle's authentic record rebuilt
    assert s.rejects == {"size": 1} and s.misses == 2
    assert s.fallbacks == {"disk": 4, "bundle": 3, "server": 2, "rebuild": 1}
    assert pc.plan(CONV) is plans[CONV.graph_key] and pc.stats().hits["memory"] == 1
    # The step serves verified blobs, so replay-only mode keeps it; its notes explain a miss.
    replay = client(None, tmp_path / "replay", signer, steps=steps, mode="replay_only")
    assert replay.plan(CONV).source == "bundle"
    with pytest.raises(PlanMiss, match=r"disk: no entry; bundle: rejected \(size\); server: none configured$"):
        replay.plan(MATMUL)
