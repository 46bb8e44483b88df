"""FE's norm ops served whole (:mod:`plancache.client.fe_ops`), on the CPU: FE 1.32's own graph cache of those ops
(``cudnn.ops.norm._common.GraphCache``) patched by the hook, the op's build written with the hook's stand-in pygraph
(:class:`tests.unit.test_hook.StageGraph`) and a recording backend for the GPU. Real ops on a GPU:
tests/integration/test_fe_ops_gpu.py."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
from cudnn.ops.norm._common import GraphCache  # noqa: E402

from plancache.client import PlanCache, fe_ops, hook  # noqa: E402
from plancache.errors import PlanMiss  # noqa: E402
from plancache.spec import GraphSpec, from_pygraph  # noqa: E402
from tests.client_fakes import FakeBuiltPlan, RecordingBackend  # noqa: E402
from tests.factories import H200, make_record, new_signer, trusted  # noqa: E402
from tests.unit.test_hook import StageGraph, five_steps, rmsnorm, rmsnorm_op  # noqa: E402

BLOB = b"tuned-rmsnorm-plan-of-the-op"
OP_WORKSPACE = 123  # what the op's own build would report


class LoadedGraph:
    """A plan loaded into an empty graph (what the real backend's ``deserialize`` makes without a caller's graph);
    records each execute; with ``refuse_ordered`` FE's ordered binding refuses it, as it refuses before a launch."""

    def __init__(self, refuse_ordered: bool = False) -> None:
        self.refuse_ordered = refuse_ordered
        self.runs: list[tuple[Any, Any, Any, Any]] = []

    def execute(self, buffers: Any, workspace: Any, handle: Any = None, tensor_uids: Any = None) -> None:
        if tensor_uids is not None and self.refuse_ordered:
            raise ValueError("The graph has no operand layout for ordered execution")
        self.runs.append((buffers, workspace, handle, tensor_uids))

    def get_workspace_size(self) -> int:
        return 4096


class LoadingBackend(RecordingBackend):
    """A recording backend whose loads into no caller's graph hold a :class:`LoadedGraph`; ``into`` records the graph
    each load was asked to go into (None: on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.into: list[Any] = []

    def deserialize(self, spec: GraphSpec, blob: bytes, *, engine_id: int | None, knobs: dict[str, int],
                    plan_name: str, graph: Any = None) -> FakeBuiltPlan:
        self.into.append(graph)
        built = super().deserialize(spec, blob, engine_id=engine_id, knobs=knobs, plan_name=plan_name, graph=graph)
        built.graph = graph if graph is not None else LoadedGraph()
        return built


def make_cache(tmp_path, signer, *, mode: str = "normal", seeded: bool = True) -> PlanCache:
    cache = PlanCache("", backend=LoadingBackend(), cache_dir=tmp_path, trusted_keys=trusted(signer), mode=mode)
    if seeded:
        key = from_pygraph(rmsnorm_op()).graph_key
        cache.disk.save(make_record(key, H200, BLOB, signer), BLOB)
    return cache


class Op:
    """An FE norm op's graph cache and build, as ``cudnn.ops.norm.rmsnorm`` has them: ``graphs`` the graphs it wrote."""

    def __init__(self, write: Any = rmsnorm_op) -> None:
        self.cache = GraphCache()
        self.write = write
        self.graphs: list[StageGraph] = []

    def build(self) -> tuple[Any, int]:
        g = self.write()
        self.graphs.append(g)
        five_steps(g)
        return g, OP_WORKSPACE

    def __call__(self, key: Any = ("rmsnorm_fprop", (8, 64))) -> tuple[Any, int]:
        return self.cache.get_or_build(key, self.build)


@pytest.fixture
def signer():
    return new_signer()


def test_a_new_shape_gets_the_served_plan_loaded_on_its_own_and_the_ops_graph_is_never_built(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    op = Op()
    with hook.installed(cache, graph_class=StageGraph):
        graph, workspace = op()
        again = op()
    assert isinstance(graph, fe_ops.Loaded) and isinstance(graph.graph, LoadedGraph)
    assert workspace == 4096 and graph.get_workspace_size() == 4096  # the plan's own workspace size
    assert again == (graph, workspace) and len(op.graphs) == 1, "the op's cache keeps it: one build per shape"
    (written,) = op.graphs
    assert written.stages == [], "the build ended at validate: FE never validated, lowered or built the op's graph"
    assert cache._backend.into == [None] and cache._backend.deserialized == [BLOB]
    stats = cache.stats()
    assert stats.hits == {"disk": 1} and stats.fe_builds == {} and stats.misses == 0


def test_a_warm_start_loads_the_ops_plan_ahead_and_its_first_build_loads_nothing(tmp_path, signer):
    """A warm start that knows the op's graph deserializes its plan on its own then; the op's first build of that
    shape takes the loaded graph from memory: no deserialize on the first call, the op's graph never built."""
    cache = make_cache(tmp_path, signer)
    op = Op()
    spec = from_pygraph(rmsnorm_op())
    hook.install(cache, graph_class=StageGraph, warm=[spec])
    try:
        hook._await_warm()
        assert cache._backend.into == [None] and cache._backend.deserialized == [BLOB], "loaded at the warm start"
        graph, workspace = op()
    finally:
        hook.uninstall()
    assert isinstance(graph, fe_ops.Loaded) and graph.graph is cache.context.memory[spec.graph_key].graph
    assert workspace == 4096 and cache._backend.deserialized == [BLOB], "the first build loaded nothing more"
    assert op.graphs[0].stages == []
    assert cache.stats().hits == {"disk": 1, "memory": 1}


def test_without_a_plan_fe_builds_the_ops_graph_after_one_ask(tmp_path, signer):
    cache = make_cache(tmp_path, signer, seeded=False)
    op = Op()
    with hook.installed(cache, graph_class=StageGraph):
        graph, workspace = op()
    assert graph is op.graphs[0] and workspace == OP_WORKSPACE
    assert [s[0] for s in graph.stages] == ["validate", "build_operation_graph", "create_execution_plans",
                                            "check_support", "build_plans"]
    stats = cache.stats()
    assert stats.misses == 1, "asked once, when offered whole: build_plans did not ask again"
    assert stats.fe_builds == {"miss": 1} and stats.hits == {}


@pytest.mark.parametrize("mode", ["strict", "replay_only"])
def test_strict_modes_raise_plan_miss_from_the_ops_cache_and_keep_nothing(tmp_path, signer, mode):
    cache = make_cache(tmp_path, signer, mode=mode, seeded=False)
    op = Op()
    with hook.installed(cache, graph_class=StageGraph), pytest.raises(PlanMiss, match="no verified tuned plan"):
        op()
    assert op.cache._entries == {} and op.graphs[0].stages == []


def test_a_graph_with_uids_fe_assigned_is_served_into_the_ops_own_graph(tmp_path, signer):
    """An op that binds by uids it did not set could not bind a plan loaded on its own: such a graph is served the
    way any graph is, into itself (FE validates and lowers it; no heuristic query, no build)."""
    cache = PlanCache("", backend=LoadingBackend(), cache_dir=tmp_path, trusted_keys=trusted(signer))
    key = from_pygraph(rmsnorm()[0]).graph_key
    cache.disk.save(make_record(key, H200, BLOB, signer), BLOB)
    op = Op(write=lambda: rmsnorm()[0])  # inv_rms keeps an auto-assigned uid
    with hook.installed(cache, graph_class=StageGraph):
        graph, workspace = op()
    assert graph is op.graphs[0] and workspace == OP_WORKSPACE
    assert graph.stages == [("validate",), ("build_operation_graph",)] and cache._backend.into == [graph]


def test_a_graph_built_outside_an_ops_cache_is_served_into_itself(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    g = rmsnorm_op()
    with hook.installed(cache, graph_class=StageGraph):
        five_steps(g)
    assert g.stages == [("validate",), ("build_operation_graph",)] and cache._backend.into == [g]


def test_only_the_first_graph_of_a_build_is_offered(tmp_path, signer):
    """A build that writes a second graph after a miss (FE's ops write one) builds it as any graph."""
    cache = make_cache(tmp_path, signer)
    second: list[StageGraph] = []

    def build() -> tuple[Any, int]:
        five_steps(rmsnorm(uid_x=5)[0])  # not seeded: a miss, left to FE
        g = rmsnorm_op()
        second.append(g)
        five_steps(g)
        return g, OP_WORKSPACE

    with hook.installed(cache, graph_class=StageGraph):
        graph, _ = GraphCache().get_or_build("k", build)
    assert graph is second[0] and graph.stages == [("validate",), ("build_operation_graph",)]
    assert cache._backend.into == [graph]  # served into itself, not whole


def test_a_plan_over_the_workspace_cap_is_refused_and_fe_builds_after_one_ask(tmp_path, signer, monkeypatch):
    monkeypatch.setenv("PLANCACHE_HOOK_MAX_WORKSPACE_BYTES", "1024")  # the record states 1024 + more below
    cache = make_cache(tmp_path, signer, seeded=False)
    key = from_pygraph(rmsnorm_op()).graph_key
    cache.disk.save(make_record(key, H200, BLOB, signer, workspace_bytes=1 << 20), BLOB)
    op = Op()
    with hook.installed(cache, graph_class=StageGraph):
        graph, _ = op()
    stats = cache.stats()
    assert graph is op.graphs[0] and stats.rejects == {"workspace": 1} and stats.fe_builds == {"miss": 1}
    assert cache._backend.deserialized == []


def test_an_error_of_the_hooks_own_leaves_the_graph_to_fe_in_normal_mode(tmp_path, signer, monkeypatch):
    cache = make_cache(tmp_path, signer)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug of the hook")

    monkeypatch.setattr(cache, "serve", broken)
    op = Op()
    with hook.installed(cache, graph_class=StageGraph):
        graph, workspace = op()
    assert graph is op.graphs[0] and workspace == OP_WORKSPACE
    assert cache.stats().fe_builds == {"error": 1}


def test_fes_graph_cache_is_patched_while_installed_and_restored(tmp_path, signer):
    original = GraphCache.__dict__["get_or_build"]
    with hook.installed(make_cache(tmp_path, signer), graph_class=StageGraph):
        assert fe_ops.patched() and GraphCache.get_or_build is not original
        assert GraphCache.get_or_build.__wrapped__ is original
    assert GraphCache.__dict__["get_or_build"] is original and not fe_ops.patched()
    op = Op()
    op()  # no hook: FE's own build
    assert [s[0] for s in op.graphs[0].stages][:2] == ["validate", "build_operation_graph"]


@pytest.fixture
def handles_here(monkeypatch):
    """FE's ``get_handle`` runnable on the CPU: the stream it binds is a stand-in and a handle FE makes itself is
    ``("fe", n)``; yields what ``set_stream`` was given, as (handle, stream) pairs."""
    import torch
    from cudnn.ops.norm import _common

    bound: list[tuple[Any, Any]] = []
    made = iter(range(100))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(_common.cudnn, "create_handle", lambda: ("fe", next(made)))
    monkeypatch.setattr(_common.cudnn, "set_stream", lambda handle, stream: bound.append((handle, stream)))
    yield bound


def _on_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_threads_first_norm_op_takes_a_handle_made_ahead_and_keeps_it(tmp_path, signer, handles_here):
    """FE's norm ops keep one cuDNN handle per thread and device (16 ms each to make on an H100): handles made ahead
    (:func:`plancache.client.fe_ops.stock_handles`) are each taken by one thread's first op on that device, which
    keeps it; a thread past the stock, or on another device, makes its own as FE does."""
    import torch
    from cudnn.ops.norm import _common

    made = [("ahead", 0), ("ahead", 1)]
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    with hook.installed(make_cache(tmp_path, signer), graph_class=StageGraph):
        fe_ops.stock_handles(0, iter(made).__next__)
        fe_ops.stock_handles(0, lambda: pytest.fail("the stock is full: nothing more is made"))
        first = _on_thread(lambda: [_common.get_handle(cuda0), _common.get_handle(cuda0), _common.get_handle(cuda1)])
        second = _on_thread(lambda: _common.get_handle(cuda0))
        third = _on_thread(lambda: _common.get_handle(cuda0))
    assert first[0] == first[1] and first[0] in made, "the thread keeps the handle it took"
    assert first[2] == ("fe", 0), "another device's handle is FE's own"
    assert {first[0], second} == set(made) and third == ("fe", 1), "two threads took the stock, the third made its own"
    assert handles_here == [(first[0], 7), (first[0], 7), (("fe", 0), 7), (second, 7), (("fe", 1), 7)], \
        "each handle taken is bound to the caller's stream by FE's own get_handle"


def test_handles_made_ahead_go_with_the_hook_and_fes_get_handle_comes_back(tmp_path, signer, handles_here,
                                                                           monkeypatch):
    """Uninstalled: FE's own ``get_handle`` is back where the op modules imported it (before the hook or while it was
    installed), the stock is dropped and nothing is made ahead any more."""
    import sys

    import torch
    from cudnn.ops.norm import _common, layernorm, rmsnorm

    own = _common.get_handle
    assert layernorm.get_handle is own and rmsnorm.get_handle is own
    later = ModuleType("cudnn.ops.norm.later_op")
    with hook.installed(make_cache(tmp_path, signer), graph_class=StageGraph):
        assert layernorm.get_handle is _common.get_handle is not own and layernorm.get_handle.original is own
        later.get_handle = _common.get_handle  # an op module imported now: `from ._common import get_handle`
        monkeypatch.setitem(sys.modules, later.__name__, later)
        fe_ops.stock_handles(0, lambda: ("ahead", 0))
    assert layernorm.get_handle is own and rmsnorm.get_handle is own and _common.get_handle is own
    assert later.get_handle is own
    fe_ops.stock_handles(0, lambda: pytest.fail("not patched: nothing is made ahead"))
    assert _on_thread(lambda: _common.get_handle(torch.device("cuda", 0))) == ("fe", 0)


def test_uninstall_waits_for_the_handles_a_warm_start_is_making(tmp_path, signer, monkeypatch):
    """Builds wait only for the warm start's loads; uninstalling waits for all of it, so no cuDNN handle is still
    being made once the hook is gone (nor at the exit that often follows)."""
    import torch

    cache = make_cache(tmp_path, signer)
    cache._backend.device = torch.device("cuda", 0)
    made: list[object] = []

    def slow() -> object:
        time.sleep(0.2)
        made.append(object())
        return made[-1]

    monkeypatch.setattr(cache._backend, "new_handle", slow)
    hook.install(cache, graph_class=StageGraph, warm=[from_pygraph(rmsnorm_op())])
    hook._await_warm()
    thread = hook._warm_start._thread
    hook.uninstall()
    assert len(made) == 2 and thread is not None and not thread.is_alive()
    assert fe_ops._stock == {}, "made while installed, dropped with the hook"


def test_a_handle_that_cannot_be_made_ahead_is_logged_and_the_ops_make_their_own(tmp_path, signer, caplog,
                                                                                  monkeypatch):
    import torch

    caplog.set_level(logging.INFO, logger="plancache.client")
    cache = make_cache(tmp_path, signer)
    cache._backend.device = torch.device("cuda", 0)

    def refuse() -> Any:
        raise RuntimeError("cudnnCreate failed")

    monkeypatch.setattr(cache._backend, "new_handle", refuse)
    hook.install(cache, graph_class=StageGraph, warm=[from_pygraph(rmsnorm_op())])
    try:
        hook._await_warm()
        hook._warm_start._thread.join()
        assert fe_ops._stock.get(0, []) == []
    finally:
        hook.uninstall()
    assert "FE's norm ops' cuDNN handles were not made ahead (RuntimeError: cudnnCreate failed)" in caplog.text


def test_a_warm_start_that_loads_norm_plans_makes_their_handles_ahead_after_its_loads(tmp_path, signer):
    """A warm start that deserializes FE's norm ops' plans then makes those ops' handles on its own thread, after
    the loads a build waits for; a warm start without such a plan makes none."""
    import torch

    spec = from_pygraph(rmsnorm_op())
    for warm, want in (([spec], 2), ([from_pygraph(rmsnorm()[0])], 0)):
        cache = make_cache(tmp_path / str(want), signer)
        cache._backend.device = torch.device("cuda", 0)
        hook.install(cache, graph_class=StageGraph, warm=warm)
        try:
            hook._await_warm()
            hook._warm_start._thread.join()
            assert len(cache._backend.handles_made) == want
            assert fe_ops._stock.get(0, []) == cache._backend.handles_made
        finally:
            hook.uninstall()
        assert fe_ops._stock == {}


def test_capture_only_installs_leave_fes_graph_cache_alone(tmp_path):
    original = GraphCache.__dict__["get_or_build"]
    hook.install(None, capture=str(tmp_path / "capture.json"), graph_class=StageGraph)
    try:
        assert GraphCache.__dict__["get_or_build"] is original
    finally:
        hook.uninstall()


def _real_op_builds() -> dict[str, Any]:
    """The builds of FE 1.32's own norm ops at one small shape (CPU tensors: only the graphs are written)."""
    import torch
    from cudnn.ops.norm import layernorm, rmsnorm

    rows, hidden = 8, 64
    x = torch.zeros(rows, hidden, 1, 1, dtype=torch.bfloat16)
    dy = torch.zeros_like(x)
    param = torch.zeros(1, hidden, 1, 1)
    stat = torch.zeros(rows, 1, 1, 1)
    return {
        "layernorm_fprop": lambda: layernorm._build_fprop_graph(None, x, param, param),
        "layernorm_bprop": lambda: layernorm._build_bprop_graph(None, dy, x, param, stat, stat),
        "rmsnorm_fprop": lambda: rmsnorm._build_fprop_graph(None, x, param.bfloat16(), None),
    }


class _Written(Exception):  # noqa: N818 - carries the graph a build wrote, before FE validates it
    def __init__(self, graph: Any) -> None:
        super().__init__("written")
        self.graph = graph


@pytest.mark.parametrize("name", ["layernorm_fprop", "layernorm_bprop", "rmsnorm_fprop"])
def test_fes_own_norm_graphs_bind_their_own_uids_and_are_served_whole(tmp_path, signer, monkeypatch, name):
    """FE's real ops: their graphs set every bound uid, so a plan loaded on its own binds the buffers they hand over;
    served, their build ends before FE validates (no GPU is touched on this path)."""
    build = _real_op_builds()[name]

    def written(graph: Any) -> None:
        raise _Written(graph)

    with monkeypatch.context() as patch:
        patch.setattr(cudnn.pygraph, "validate", written)
        with pytest.raises(_Written) as caught:
            build()
    spec = from_pygraph(caught.value.graph)
    assert fe_ops.binds_own_uids(spec) and fe_ops.held_whole(spec), f"{name}: a bound tensor has a uid FE assigned"
    cache = PlanCache("", backend=LoadingBackend(), cache_dir=tmp_path, trusted_keys=trusted(signer))
    cache.disk.save(make_record(spec.graph_key, H200, BLOB, signer), BLOB)
    with hook.installed(cache):
        graph, workspace = GraphCache().get_or_build(name, build)
    assert isinstance(graph.graph, LoadedGraph) and workspace == 4096 and cache.stats().hits == {"disk": 1}


def test_the_op_runs_the_loaded_plan_in_its_own_uids_order():
    loaded = fe_ops.Loaded(LoadedGraph())
    loaded.execute(("x", "scale", "eps", "y"), "ws", handle="h", tensor_uids=(1, 2, 3, 10))
    assert loaded.graph.runs == [(("x", "scale", "eps", "y"), "ws", "h", (1, 2, 3, 10))] and loaded.ordered


def test_a_loaded_plan_fe_will_not_bind_in_order_is_bound_by_uid_from_then_on():
    loaded = fe_ops.Loaded(LoadedGraph(refuse_ordered=True))
    for _ in range(2):
        loaded.execute(("x", "scale", "eps", "y"), "ws", handle="h", tensor_uids=(1, 2, 3, 10))
    assert not loaded.ordered
    assert loaded.graph.runs == [({1: "x", 2: "scale", 3: "eps", 10: "y"}, "ws", "h", None)] * 2
    loaded.execute({1: "x"}, "ws", handle="h")  # a caller's own uid mapping goes straight through
    assert loaded.graph.runs[-1] == ({1: "x"}, "ws", "h", None)
