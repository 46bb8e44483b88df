"""Warm start: the hook, installed with a capture file of the program's graphs (``warm=``, ``PLANCACHE_WARM``), fetches
and verifies all their plans in one resolve round trip, and each graph FE builds later loads its own with no request
and one deserialization. A live server, FE's pipeline on the CPU (tests/unit/test_hook.py's StageGraph) and the
recording backend; real FE ops on an H200: tests/integration/test_fe_ops_gpu.py."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

from plancache.client import PlanCache, fe_ops, hook  # noqa: E402
from plancache.client.capture import Recorder  # noqa: E402
from plancache.errors import PlanMiss, SpecError  # noqa: E402
from plancache.spec import GraphSpec, from_pygraph  # noqa: E402
from plancache.spec.axes import variants, vary  # noqa: E402
from tests.client_fakes import RecordingBackend  # noqa: E402
from tests.factories import H200, make_meta, new_signer, patient, trusted  # noqa: E402
from tests.live_server import LiveServer  # noqa: E402
from tests.unit.test_hook import StageGraph, five_steps, rmsnorm, rmsnorm_op  # noqa: E402

RESOLVE = "/v1/plans/resolve"
BF16, FP32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT


def attention(s: int, b: int = 2, h: int = 4, d: int = 64) -> StageGraph:
    """FE's SDPA forward in BSHD layout, as ``cudnn.sdpa_torch`` lays it out (the shape axes vary moves)."""
    g = StageGraph(io_data_type=BF16, intermediate_data_type=FP32, compute_data_type=FP32, name="attention")
    stride = [s * h * d, d, h * d, 1]
    q, k, v = (g.tensor(name=n, dim=[b, h, s, d], stride=stride, data_type=BF16) for n in ("q", "k", "v"))
    o, stats = g.sdpa(name="attention", q=q, k=k, v=v, generate_stats=True, attn_scale=0.125)
    o.set_output(True).set_dim([b, h, s, d]).set_stride(stride).set_data_type(BF16)
    stats.set_output(True).set_data_type(FP32)
    return g


def step_graphs() -> list[StageGraph]:
    """The graphs of a training step, new each call: two norms and an attention (distinct keys)."""
    return [rmsnorm(1)[0], rmsnorm(5)[0], attention(256)]


def spec_of(g: StageGraph) -> GraphSpec:
    return from_pygraph(g)


def blob_of(spec: GraphSpec) -> bytes:
    return f"tuned plan of {spec.graph_key}".encode()


@pytest.fixture
def signer():
    return new_signer()


@pytest.fixture
def srv(tmp_path):
    with LiveServer(tmp_path / "server", autotune=False) as server:
        yield server


def seed(srv: LiveServer, signer: Any, *specs: GraphSpec) -> None:
    for spec in specs:
        srv.store.put_spec(spec.graph_key, spec.to_json())
        srv.store.publish_plan(make_meta(spec.graph_key, H200, blob_of(spec), signer), blob_of(spec))


def capture(path: Path, *graphs: StageGraph) -> Path:
    recorder = Recorder(path)
    for g in graphs:
        recorder.add(spec_of(g))
    recorder.flush()
    return path


def loaded(cache: PlanCache) -> list[bytes]:
    """The blobs the cache's recording backend deserialized, in order."""
    return cache.config.backend.deserialized


def make_cache(srv: LiveServer, tmp_path: Path, signer: Any, **kw: Any) -> PlanCache:
    """A client of ``srv``, :func:`~tests.factories.patient` (past the default deadline a loaded CI
    machine added a warning to a test counting them; past the default read timeout a warm start found nothing)."""
    return PlanCache(srv.url, backend=RecordingBackend(), token=srv.token("reader"), cache_dir=tmp_path / "cache",
                     trusted_keys=trusted(signer), **patient(kw))


@contextlib.contextmanager
def installed(cache: PlanCache, **options: Any) -> Iterator[None]:
    hook.install(cache, graph_class=StageGraph, **options)
    try:
        yield
    finally:
        hook.uninstall()


def build_all(cache: PlanCache, graphs: list[StageGraph], **options: Any) -> None:
    """Install the hook (``options``: warm start), build every graph through FE's five steps, uninstall."""
    with installed(cache, **options):
        for g in graphs:
            five_steps(g)


def test_a_warm_start_asks_once_for_every_graph_and_loads_each_once_into_its_own_graph(srv, tmp_path, signer):
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    path = capture(tmp_path / "capture.json", *step_graphs())
    cache = make_cache(srv, tmp_path, signer)
    graphs = step_graphs()
    build_all(cache, graphs, warm=path)
    assert srv.requests[RESOLVE] == 1  # one for the three graphs, at install; none when they are built
    assert loaded(cache) == [blob_of(s) for s in specs]  # once each, into the caller's graph
    assert all(g.stages == [("validate",), ("build_operation_graph",)] for g in graphs)  # no FE planning
    s = cache.stats()
    assert s.hits == {"server": 3, "memory": 3} and s.fe_builds == {} and s.misses == 0


class SlowBackend(RecordingBackend):
    """Takes 20 ms to deserialize, as cuDNN takes milliseconds."""

    def deserialize(self, *args: Any, **kw: Any) -> Any:
        time.sleep(0.02)
        return super().deserialize(*args, **kw)


def test_a_warm_start_counts_the_deserializations_into_the_callers_graphs(srv, tmp_path, signer):
    """The blobs kept at install are loaded when the graphs are built: that time is deserialize_seconds too."""
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    path = capture(tmp_path / "capture.json", *step_graphs())
    cache = PlanCache(srv.url, backend=SlowBackend(), token=srv.token("reader"), cache_dir=tmp_path / "cache",
                      trusted_keys=trusted(signer))
    build_all(cache, step_graphs(), warm=path)
    assert len(loaded(cache)) == 3
    assert 0.06 <= cache.stats().deserialize_seconds < 1.0


def test_without_a_warm_start_each_graph_asks_when_it_is_built(srv, tmp_path, signer):
    """What the warm start saves: a round trip per graph."""
    seed(srv, signer, *(spec_of(g) for g in step_graphs()))
    cache = make_cache(srv, tmp_path, signer)
    build_all(cache, step_graphs())
    assert srv.requests[RESOLVE] == 3 and len(loaded(cache)) == 3


def test_prefetch_loads_a_throwaway_plan_that_a_warm_start_does_not(srv, tmp_path, signer):
    """prefetch() deserializes each spec into a graph of its own, and the hook again into the caller's; warm() keeps
    the verified blob for the caller's graph."""
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    prefetched = make_cache(srv, tmp_path / "a", signer)
    prefetched.prefetch(specs)
    build_all(prefetched, step_graphs())
    assert len(loaded(prefetched)) == 6
    warmed = make_cache(srv, tmp_path / "b", signer)
    assert warmed.warm(specs) == [s.graph_key for s in specs]
    assert loaded(warmed) == []  # fetched and verified, not loaded
    build_all(warmed, step_graphs())
    assert len(loaded(warmed)) == 3 and srv.requests[RESOLVE] == 2


def test_a_warm_start_from_disk_asks_nothing(srv, tmp_path, signer):
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    with make_cache(srv, tmp_path, signer) as first:  # closing finishes the disk cache's writes
        first.warm(specs)
    second = make_cache(srv, tmp_path, signer)
    assert second.warm(specs) == [s.graph_key for s in specs] and loaded(second) == []
    build_all(second, step_graphs())
    assert srv.requests[RESOLVE] == 1 and len(loaded(second)) == 3
    assert second.stats().hits == {"disk": 3, "memory": 3}


def test_warm_vary_fetches_the_variants_the_program_will_build(srv, tmp_path, signer):
    later = attention(1024)
    seed(srv, signer, spec_of(attention(256)), spec_of(later))
    blob = blob_of(spec_of(later))
    path = capture(tmp_path / "capture.json", attention(256), rmsnorm(1)[0])  # the norm has no axis s: itself only
    cache = make_cache(srv, tmp_path, signer)
    build_all(cache, [later], warm=path, warm_vary={"s": [512, 1024]})
    assert srv.requests[RESOLVE] == 1 and cache.stats().hits == {"server": 2, "memory": 1}
    assert loaded(cache) == [blob]


def test_variants_are_every_combination_of_the_sizes():
    base = spec_of(attention(256))
    varied = list(variants(base, {"s": [128, 512], "b": [1, 3]}))
    assert [sizes for sizes, _ in varied] == [{"s": s, "b": b} for s in (128, 512) for b in (1, 3)]
    keys = [v.graph_key for _, v in varied]
    assert keys == [vary(base, {"s": s, "b": b}).graph_key for s in (128, 512) for b in (1, 3)]
    assert len(set(keys)) == 4 and spec_of(attention(512, b=3)).graph_key in keys


def test_a_graph_the_server_lacks_is_built_by_fe_in_normal_mode(srv, tmp_path, signer):
    graphs = step_graphs()
    seed(srv, signer, spec_of(graphs[0]), spec_of(graphs[1]))  # not the attention
    path = capture(tmp_path / "capture.json", *step_graphs())
    cache = make_cache(srv, tmp_path, signer)
    build_all(cache, graphs, warm=path)
    assert graphs[2].stages[-1] == ("build_plans", ())  # FE planned and built it, as the caller asked
    s = cache.stats()
    assert s.fe_builds == {"miss": 1} and s.hits == {"server": 2, "memory": 2}
    assert srv.requests[RESOLVE] == 1  # the warm start's: the missing graph's own build does not ask again (a miss)


def test_strict_mode_raises_plan_miss_when_the_missing_graph_is_built_not_at_the_warm_start(srv, tmp_path, signer):
    graphs = step_graphs()
    seed(srv, signer, spec_of(graphs[0]))
    blob = blob_of(spec_of(graphs[0]))
    path = capture(tmp_path / "capture.json", *step_graphs())
    cache = make_cache(srv, tmp_path, signer, mode="strict")
    with installed(cache, warm=path):
        five_steps(graphs[0])
        with pytest.raises(PlanMiss, match="no verified tuned plan"):
            five_steps(graphs[1])
    assert loaded(cache) == [blob]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read the capture file"),
    ("{not json", "not a capture file \\(not JSON"),
    ('{"graphs": []}', "not a capture file \\(write one"),
    ('{"format": "plancache-capture", "version": 1, "graphs": [{"graph_key": "00", "count": 1, "spec": {}}]}',
     "not a valid capture file"),
])
def test_an_unusable_capture_file_fails_strict_mode_and_is_one_warning_in_normal_mode(
        srv, tmp_path, signer, caplog, content, message):
    path = tmp_path / "capture.json"
    if content is not None:
        path.write_text(content)
    strict = make_cache(srv, tmp_path, signer, mode="strict")
    original = StageGraph.build_plans
    with pytest.raises(SpecError, match=f"{path}: {message}"):
        hook.install(strict, graph_class=StageGraph, warm=path)
    assert StageGraph.build_plans is original  # nothing installed
    normal = make_cache(srv, tmp_path, signer)
    seed(srv, signer, spec_of(rmsnorm()[0]))
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        build_all(normal, [rmsnorm()[0]], warm=path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"no warm start: {path}" in warnings[0]
    assert normal.stats().hits == {"server": 1} and srv.requests[RESOLVE] == 1  # served as without a warm start


def test_plancache_warm_names_the_file(srv, tmp_path, signer, monkeypatch):
    seed(srv, signer, *(spec_of(g) for g in step_graphs()))
    monkeypatch.setenv("PLANCACHE_WARM", str(capture(tmp_path / "capture.json", *step_graphs())))
    cache = make_cache(srv, tmp_path, signer)
    build_all(cache, step_graphs())
    assert srv.requests[RESOLVE] == 1 and cache.stats().hits == {"server": 3, "memory": 3}


def test_bad_arguments_are_refused(srv, tmp_path, signer):
    cache = make_cache(srv, tmp_path, signer)
    for axes, message in (({"seq": [1]}, "no shape axis seq"), ({"s": [0]}, "positive integers, not s=0")):
        with pytest.raises(ValueError, match=message):
            hook.install(cache, graph_class=StageGraph, warm=[], warm_vary=axes)
    with pytest.raises(ValueError, match="give install\\(\\) a PlanCache"):
        hook.install(None, graph_class=StageGraph, warm=[])


def test_install_returns_at_once_and_the_first_build_waits_for_the_warm_start(srv, tmp_path, signer):
    """The fetch runs on a thread, bounded by the request deadline; a build that comes first waits for it."""
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    srv.delay = 1.0
    cache = make_cache(srv, tmp_path, signer)
    t0 = time.monotonic()
    with installed(cache, warm=specs):
        assert time.monotonic() - t0 < 0.5
        for g in step_graphs():
            five_steps(g)
    assert srv.requests[RESOLVE] == 1 and cache.stats().hits == {"server": 3, "memory": 3}


def test_a_warm_start_past_the_deadline_leaves_each_graph_to_the_ladder(srv, tmp_path, signer):
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    srv.delay = 5.0
    cache = make_cache(srv, tmp_path, signer, request_deadline=1.0, cooldown=0.1)
    t0 = time.monotonic()
    assert cache.warm(specs) == []
    assert time.monotonic() - t0 < 2.5 and cache.stats().remote_errors == 1
    srv.delay = 0.0
    time.sleep(0.2)  # past the breaker's cool-down
    build_all(cache, step_graphs())
    assert cache.stats().hits == {"server": 3}


def test_processes_warming_on_one_cache_folder_ask_the_server_once(srv, tmp_path, signer):
    """The host's fetch lock: caches on one folder (here two in one process; flock is per open file) warming the same
    graphs together make one resolve; the other reads what the first wrote."""
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    srv.delay = 0.3
    caches = [make_cache(srv, tmp_path, signer) for _ in range(2)]
    kept: list[list[str]] = []
    threads = [threading.Thread(target=lambda c=c: kept.append(c.warm(specs))) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert srv.requests[RESOLVE] == 1 and kept == [[s.graph_key for s in specs]] * 2
    assert sorted(tuple(sorted(c.stats().hits)) for c in caches) == [("disk",), ("server",)]


def test_plancache_torch_install_passes_the_warm_start_on(srv, tmp_path, signer):
    pytest.importorskip("torch")
    import plancache.torch

    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    cache = make_cache(srv, tmp_path, signer)
    assert plancache.torch.install(cache, sdpa_route=False, warm=specs) is cache
    plancache.torch.uninstall()  # after the warm start under way
    assert srv.requests[RESOLVE] == 1 and cache.stats().hits == {"server": 3}
    assert loaded(cache) == []


def test_a_second_warm_start_of_kept_blobs_loads_nothing(srv, tmp_path, signer):
    """Two threads warming the same graphs at once (the hook's warm start and the program's own ``warm``): the second
    load finds the blobs the first kept, and deserialized every one of them to throw it away; it keeps them as they
    are. (The race itself is timing; this is the second thread's load as it runs.)"""
    from plancache.client.context import Builds, Pending

    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    cache = make_cache(srv, tmp_path, signer)
    assert cache.warm(specs) == [s.graph_key for s in specs]
    again = cache._load_many([Pending(s.graph_key, s, None, warm=True) for s in specs], frozenset({Builds.NOTHING}))
    assert [type(r._built).__name__ for r in again] == ["Kept"] * 3  # type: ignore[union-attr]
    assert loaded(cache) == [] and len(cache.context.memory) == 0
    build_all(cache, step_graphs())
    assert len(loaded(cache)) == 3


def test_warm_load_deserializes_the_named_plans_now_and_keeps_the_rest(srv, tmp_path, signer):
    """``load``: graphs run from the plan's own loaded graph (the attention route's) are deserialized at the warm
    start, once, into an empty graph each; their first plan() is a memory hit that loads nothing more."""
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    cache = make_cache(srv, tmp_path, signer)
    whole = specs[2]
    assert cache.warm(specs, load={whole.graph_key}) == [s.graph_key for s in specs]
    assert loaded(cache) == [blob_of(whole)] and list(cache.context.memory) == [whole.graph_key]
    assert cache.plan(whole).graph is cache.context.memory[whole.graph_key].graph
    assert loaded(cache) == [blob_of(whole)]
    assert cache.stats().hits == {"server": 3, "memory": 1}
    assert cache.warm(specs, load={whole.graph_key}) == [s.graph_key for s in specs]  # nothing asked or loaded again
    assert srv.requests[RESOLVE] == 1 and len(loaded(cache)) == 1
    build_all(cache, step_graphs())  # a caller's own graph loads its plan into itself, whole-loaded or not
    assert loaded(cache)[1:] == [blob_of(s) for s in specs]


def test_warm_load_of_a_blob_kept_earlier_loads_it_from_memory(srv, tmp_path, signer):
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    cache = make_cache(srv, tmp_path, signer)
    cache.warm(specs)
    assert cache.warm(specs, load={specs[0].graph_key}) == [s.graph_key for s in specs]
    assert loaded(cache) == [blob_of(specs[0])] and srv.requests[RESOLVE] == 1


def test_the_hook_warm_start_loads_the_graphs_named_in_warm_load(srv, tmp_path, signer):
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    path = capture(tmp_path / "capture.json", *step_graphs())
    cache = make_cache(srv, tmp_path, signer)
    with installed(cache, warm=path, warm_load=[specs[2].name, "another name"]):
        hook._await_warm()
        assert loaded(cache) == [blob_of(specs[2])]
    assert list(cache.context.memory) == [specs[2].graph_key]


@pytest.mark.parametrize("route", [True, False])
def test_plancache_torch_install_loads_the_attention_routes_graphs_at_a_warm_start(srv, tmp_path, signer,
                                                                                   monkeypatch, route):
    pytest.importorskip("torch")
    import plancache.torch
    from plancache.client import sdpa

    started: list[Any] = []
    monkeypatch.setattr(hook._warm_start, "start",
                        lambda cache, specs, load=(), loader=None, whole=None, then=None:
                        started.append((set(load), whole, then)))
    monkeypatch.setattr(sdpa, "install", lambda cache, attention, cpp, replay: None)
    cache = make_cache(srv, tmp_path, signer)
    plancache.torch.install(cache, sdpa_route=route, warm=[spec_of(g) for g in step_graphs()])
    plancache.torch.uninstall()
    assert [(load, whole) for load, whole, _ in started] == [
        ({"torch fwd attention", "torch bwd attention"} if route else set(), fe_ops.held_whole)], \
        "FE's norm ops are served whole once torch is imported: their plans load at the warm start too"
    assert started[0][2] is not None, "and their handles are made ahead"


@pytest.mark.parametrize("with_loader", [False, True], ids=["cache", "loader"])
def test_a_warm_start_loads_the_plans_fes_norm_ops_take_whole(srv, tmp_path, signer, with_loader):
    """``whole`` (FE's norm ops' graphs, :func:`plancache.client.fe_ops.held_whole`): their plans are deserialized at
    the warm start into an empty graph each, never offered to a loader (the attention route's C++ path takes only
    the graphs named for it); a graph of the same node whose uids FE assigned is only fetched."""
    specs = [spec_of(rmsnorm_op()), spec_of(rmsnorm()[0]), spec_of(attention(256))]
    assert [fe_ops.held_whole(s) for s in specs] == [True, False, False]
    seed(srv, signer, *specs)
    cache = make_cache(srv, tmp_path, signer)
    offered: list[str] = []

    def loader(spec: GraphSpec, blob: bytes) -> bool:
        offered.append(spec.graph_key)
        return True

    hook._warm_start.start(cache, specs, [specs[2].name] if with_loader else (), loader if with_loader else None,
                           whole=fe_ops.held_whole)
    hook._warm_start.wait()
    assert offered == ([specs[2].graph_key] if with_loader else [])
    assert loaded(cache) == [blob_of(specs[0])] and list(cache.context.memory) == [specs[0].graph_key]
    assert {s.graph_key for s in specs} <= set(cache.context.verified) and srv.requests[RESOLVE] == 1


def test_what_a_warm_start_does_last_is_not_waited_for_and_runs_only_after_loading_a_norm_plan(srv, tmp_path,
                                                                                                signer, caplog):
    """``then`` (FE's norm ops' handles made ahead) runs on the warm thread after its loads, where it loaded a plan
    ``whole`` names; builds wait for the loads only, not for it; a failure of it is logged, never raised."""
    specs = [spec_of(rmsnorm_op()), spec_of(attention(256))]
    seed(srv, signer, *specs)
    release, ran = threading.Event(), []

    def then() -> None:
        ran.append(threading.current_thread().name)
        release.wait(5)
        raise RuntimeError("no handle")

    cache = make_cache(srv, tmp_path / "a", signer)
    hook._warm_start.start(cache, specs, whole=fe_ops.held_whole, then=then)
    hook._warm_start.wait()
    assert hook._warm_start._thread.is_alive(), "the wait returned while then() is still to run or running"
    assert loaded(cache) == [blob_of(specs[0])]
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["plancache-warm"]
    release.set()
    hook._warm_start._thread.join(5)
    assert not hook._warm_start._thread.is_alive()
    assert "the work after its loads failed (RuntimeError: no handle)" in caplog.text
    hook._warm_start.start(make_cache(srv, tmp_path / "b", signer), specs[1:], whole=fe_ops.held_whole,
                           then=lambda: ran.append("again"))
    hook._warm_start.wait()
    hook._warm_start._thread.join(5)
    assert ran == ["plancache-warm"], "nothing whole was loaded: then() does not run"


def test_verified_blobs_are_fetched_together_loaded_nowhere_and_say_where_they_came_from(srv, tmp_path, signer):
    """What the attention route's C++ steady path loads itself: one round trip for the specs it asks for, nothing
    deserialized by the cache, each blob with its record and its source (``memory`` once kept); a spec the server
    lacks is left out, never built."""
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs[:2])
    cache = make_cache(srv, tmp_path, signer)
    found = cache.verified_blobs(specs)
    assert list(found) == [s.graph_key for s in specs[:2]] and srv.requests[RESOLVE] == 1
    assert [(f.blob, f.source, f.record.graph_key) for f in found.values()] == [
        (blob_of(s), "server", s.graph_key) for s in specs[:2]]
    assert loaded(cache) == [] and cache.stats().hits == {"server": 2}
    again = cache.verified_blobs(specs[:2])
    assert [f.source for f in again.values()] == ["memory", "memory"] and srv.requests[RESOLVE] == 1
    assert cache.stats().hits == {"server": 2, "memory": 2}, "each kept blob handed out is a memory hit, as plan()'s"
    cache.count_load(0.25)
    assert cache.stats().deserialize_seconds == 0.25


def test_a_kept_blob_is_verified_again_and_refused_once_a_newer_revision_was_accepted(srv, tmp_path, signer, caplog):
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    cache = make_cache(srv, tmp_path, signer)
    cache.verified_blobs(specs)
    stale = specs[0].graph_key
    cache.context.disk.accept_revision(stale, cache.context.verified[stale][0].revision + 1)  # a withdrawal, say
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        found = cache.verified_blobs(specs)
    assert stale not in found and len(found) == 2 and stale not in cache.context.verified
    assert cache.stats().rejects == {"revision": 1} and "is refused now (revision)" in caplog.text


def test_a_warm_loader_takes_the_named_plans_it_can_and_the_cache_loads_the_rest(srv, tmp_path, signer):
    """The attention route's C++ steady path loads its plans itself at a warm start (``warm_loader``): the named
    plans it takes are deserialized nowhere else; one it declines is loaded into an empty graph as without it."""
    specs = [spec_of(g) for g in step_graphs()]
    seed(srv, signer, *specs)
    cache = make_cache(srv, tmp_path, signer)
    names = [specs[1].name, specs[2].name]  # both norms share a name
    taken: list[tuple[str, bytes]] = []

    def loader(spec: GraphSpec, blob: bytes) -> bool:
        if spec.graph_key == specs[2].graph_key:
            return False
        taken.append((spec.graph_key, blob))
        return True

    hook._warm_start.start(cache, specs, names, loader)
    hook._warm_start.wait()
    assert taken == [(s.graph_key, blob_of(s)) for s in specs[:2]]
    assert loaded(cache) == [blob_of(specs[2])] and list(cache.context.memory) == [specs[2].graph_key]
    assert {s.graph_key for s in specs} <= set(cache.context.verified) and srv.requests[RESOLVE] == 1
