"""The hook's interception of FE's five-step build pipeline, on the CPU: a pygraph subclass whose C++ stages only
record their calls stands in for FE's backend, and a recording backend for the GPU. Real FE ops on a GPU:
tests/integration/test_fe_ops_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

from plancache.client import PlanCache, hook  # noqa: E402
from plancache.errors import PlanMiss  # noqa: E402
from plancache.spec import from_pygraph  # noqa: E402
from tests.client_fakes import RecordingBackend  # noqa: E402
from tests.factories import H200, make_record, new_signer, trusted  # noqa: E402

BLOB = b"tuned-rmsnorm-plan"


class StageGraph(cudnn.pygraph):
    """``cudnn.pygraph`` with its backend stages replaced by recorders (FE's own ``build()`` is kept)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stages: list[tuple[Any, ...]] = []

    def validate(self) -> None:
        self.stages.append(("validate",))
        self._lowered_graph, self._is_validated = "lowered", True
        self._freeze()

    def build_operation_graph(self) -> None:
        self.stages.append(("build_operation_graph",))

    def create_execution_plans(self, heuristics: Any = None) -> None:
        self.stages.append(("create_execution_plans", heuristics))
        self._planning_done = True

    def check_support(self) -> None:
        self.stages.append(("check_support",))

    def build_plans(self, *args: Any, ctx: Any = None, **kwargs: Any) -> None:
        self.stages.append(("build_plans", args))
        self._is_built = True

    def get_execution_plan_count(self) -> int:
        return 3 if self._planning_done else 0

    def deselect_workspace_greater_than(self, limit: int) -> StageGraph:
        self.stages.append(("deselect_workspace_greater_than", limit))
        return self


def rmsnorm(uid_x: int | None = 1) -> tuple[StageGraph, dict[str, Any]]:
    """FE's rms_norm forward graph as ``cudnn.ops.norm`` writes it (explicit uids on the I/O tensors)."""
    f32, bf16 = cudnn.data_type.FLOAT, cudnn.data_type.BFLOAT16
    g = StageGraph(intermediate_data_type=f32, compute_data_type=f32)
    x = g.tensor(name="X", dim=[8, 64, 1, 1], stride=[64, 1, 1, 1], data_type=bf16, uid=uid_x)
    scale = g.tensor(name="scale", dim=[1, 64, 1, 1], stride=[64, 1, 1, 1], data_type=f32, uid=2)
    eps = g.tensor(name="epsilon", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, uid=3, is_pass_by_value=True)
    y, inv_rms = g.rmsnorm(name="rmsnorm", norm_forward_phase=cudnn.norm_forward_phase.TRAINING, input=x, scale=scale,
                           epsilon=eps)
    y.set_uid(10).set_output(True).set_data_type(bf16)
    inv_rms.set_output(True).set_data_type(f32)  # an auto-assigned uid
    return g, {"X": x, "Y": y, "inv_rms": inv_rms}


def rmsnorm_op() -> StageGraph:
    """The rms_norm forward graph as FE's ``rms_norm`` op writes it: every bound tensor's uid set by the op."""
    g, t = rmsnorm()
    t["inv_rms"].set_uid(11)
    return g


@pytest.fixture
def signer():
    return new_signer()


def make_cache(tmp_path, signer, *, mode: str = "normal", seeded: bool = True) -> PlanCache:
    cache = PlanCache("", backend=RecordingBackend(), cache_dir=tmp_path, trusted_keys=trusted(signer), mode=mode)
    if seeded:
        key = from_pygraph(rmsnorm()[0]).graph_key
        cache.disk.save(make_record(key, H200, BLOB, signer), BLOB)
    return cache


def five_steps(g: Any) -> None:
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


def test_the_five_steps_of_fes_ops_load_the_tuned_plan_and_skip_fes_planning(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    g, t = rmsnorm()
    auto = t["inv_rms"].uid
    with hook.installed(cache, graph_class=StageGraph):
        five_steps(g)
        assert g.get_execution_plan_count() >= 1  # cudnn.Graph's __call__ asks for it before running
    assert g.stages == [("validate",), ("build_operation_graph",)]  # no heuristic query, no FE build
    assert cache.stats().hits == {"disk": 1} and cache.stats().fe_builds == {}
    assert cache._backend.deserialized == [BLOB]
    assert (t["X"].uid, t["Y"].uid) == (1, 10)  # uids the caller set are kept
    assert t["inv_rms"].uid == from_pygraph(rmsnorm()[0]).canonical_uids()[auto]  # auto uids made canonical


def test_build_goes_through_the_same_interception(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    g, _ = rmsnorm()
    with hook.installed(cache, graph_class=StageGraph):
        g.build([cudnn.heur_mode.B])
    assert ("create_execution_plans", [cudnn.heur_mode.B]) not in g.stages
    assert cache.stats().hits == {"disk": 1}


def test_a_forked_child_builds_with_fe_itself(tmp_path, signer):
    """In a child forked from the process that installed the hook (its cache is the parent's), every build is FE's
    own, exactly as asked; the parent's builds still go through the cache."""
    import os

    cache = make_cache(tmp_path, signer, mode="strict")
    with hook.installed(cache, graph_class=StageGraph):
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            g, _ = rmsnorm()
            five_steps(g)
            os.write(write, repr([s[0] for s in g.stages]).encode())
            os._exit(0)
        os.close(write)
        os.waitpid(child, 0)
        stages = os.read(read, 4096).decode()
        os.close(read)
        g, _ = rmsnorm()
        five_steps(g)
    assert stages == repr(["validate", "build_operation_graph", "create_execution_plans", "check_support",
                           "build_plans"])
    assert g.stages == [("validate",), ("build_operation_graph",)] and cache.stats().hits == {"disk": 1}


def test_a_miss_in_normal_mode_runs_fes_steps_exactly_as_the_caller_asked(tmp_path, signer):
    cache = make_cache(tmp_path, signer, seeded=False)
    g, _ = rmsnorm()
    with hook.installed(cache, graph_class=StageGraph):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.B])
        assert g.stages[-1] == ("build_operation_graph",)  # deferred until build_plans
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    assert g.stages[2:] == [("create_execution_plans", [cudnn.heur_mode.B]), ("check_support",),
                            ("build_plans", (cudnn.build_plan_policy.HEURISTICS_CHOICE,))]
    stats = cache.stats()
    assert stats.misses == 1 and stats.fe_builds == {"miss": 1} and stats.hits == {}


@pytest.mark.parametrize("mode", ["strict", "replay_only"])
def test_strict_modes_raise_plan_miss_instead_of_building(tmp_path, signer, mode):
    cache = make_cache(tmp_path, signer, mode=mode, seeded=False)
    g, _ = rmsnorm()
    with hook.installed(cache, graph_class=StageGraph), pytest.raises(PlanMiss, match="no verified tuned plan"):
        five_steps(g)
    assert [s[0] for s in g.stages] == ["validate", "build_operation_graph"]


def test_build_plans_all_is_left_to_fe(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    g, _ = rmsnorm()
    with hook.installed(cache, graph_class=StageGraph):
        g.validate()
        g.create_execution_plans([cudnn.heur_mode.A])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
    assert [s[0] for s in g.stages] == ["validate", "create_execution_plans", "check_support", "build_plans"]
    assert cache.stats().fe_builds == {"fe_candidates": 1} and cache._backend.deserialized == []


def test_a_filter_on_fes_candidates_makes_fe_plan_first(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    g, _ = rmsnorm()
    with hook.installed(cache, graph_class=StageGraph):
        g.validate()
        g.create_execution_plans([cudnn.heur_mode.A])
        g.deselect_workspace_greater_than(0)
        g.check_support()
        g.build_plans()
    assert [s[0] for s in g.stages] == ["validate", "create_execution_plans", "check_support",
                                        "deselect_workspace_greater_than", "check_support", "build_plans"]
    assert cache.stats().fe_builds == {"fe_candidates": 1} and cache._backend.deserialized == []


def test_a_graph_validated_before_the_hook_is_left_to_fe(tmp_path, signer):
    cache = make_cache(tmp_path, signer, mode="strict")
    g, _ = rmsnorm()
    g.validate()
    with hook.installed(cache, graph_class=StageGraph):
        g.create_execution_plans()
        g.build_plans()
    assert cache.stats().fe_builds == {"validated_early": 1}


def test_a_graph_the_spec_cannot_represent_is_left_to_fe(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    g, _ = rmsnorm()
    g._nodes[0].params["score_mod"] = lambda graph, score: score  # a callback: no document can hold it
    with hook.installed(cache, graph_class=StageGraph):
        five_steps(g)
    assert cache.stats().fe_builds == {"unsupported": 1}
    assert ("create_execution_plans", [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]) in g.stages


def test_an_override_shape_graph_is_left_to_fe(tmp_path, signer):
    cache = make_cache(tmp_path, signer)
    g, _ = rmsnorm()
    g._cpp_graph_kwargs["is_override_shape_enabled"] = True
    with hook.installed(cache, graph_class=StageGraph):
        five_steps(g)
    assert cache.stats().fe_builds == {"override_shape": 1}


def test_uninstall_gives_fe_its_methods_back(tmp_path, signer):
    before = {n: StageGraph.__dict__.get(n) for n in ("validate", "build_plans", "select_plan")}
    with hook.installed(make_cache(tmp_path, signer), graph_class=StageGraph):
        assert StageGraph.__dict__["validate"] is not before["validate"]
        assert "select_plan" in StageGraph.__dict__  # FE's plan-list calls are watched on the class
    assert {n: StageGraph.__dict__.get(n) for n in before} == before
    g, _ = rmsnorm()
    five_steps(g)
    assert [s[0] for s in g.stages] == ["validate", "build_operation_graph", "create_execution_plans",
                                        "check_support", "build_plans"]


def test_the_real_pygraph_is_patched_and_restored():
    cache = PlanCache("", backend=RecordingBackend(), cache_dir=None)
    original = cudnn.pygraph.create_execution_plans
    with hook.installed(cache):
        assert cudnn.pygraph.create_execution_plans is not original
        assert cudnn.pygraph.create_execution_plans.__wrapped__ is original
    assert cudnn.pygraph.create_execution_plans is original


def test_a_warm_kept_plan_cudnn_refuses_to_load_is_a_rejected_rung_not_an_error(tmp_path, signer):
    """A blob a warm start kept, which cuDNN then refuses to deserialize into the caller's graph, is refused like the
    same blob loaded without a warm start (``deserialize``): normal mode goes on down the ladder, no exception."""
    cache = make_cache(tmp_path, signer)
    spec = from_pygraph(rmsnorm()[0])
    assert cache.warm([spec]) == [spec.graph_key]
    cache._backend.fail.add("deserialize")
    g, _ = rmsnorm()
    with hook.installed(cache, graph_class=StageGraph):
        five_steps(g)  # raised cuDNN's RuntimeError from build_plans
    stats = cache.stats()
    assert stats.rejects.get("deserialize", 0) >= 1 and stats.hits == {"disk": 1, "rebuild": 1}  # disk: the warm start


def test_a_block_inside_a_process_wide_install_leaves_it_installed(tmp_path, signer):
    outer, inner = make_cache(tmp_path / "a", signer), make_cache(tmp_path / "b", signer)
    hook.install(outer, graph_class=StageGraph)
    try:
        with hook.installed(inner, graph_class=StageGraph):
            assert hook._cache is inner
        assert hook._cache is outer and "__wrapped__" in vars(StageGraph.__dict__["build_plans"])
        g, _ = rmsnorm()
        five_steps(g)
        assert outer.stats().hits == {"disk": 1}
    finally:
        hook.uninstall()
    assert not hasattr(StageGraph.__dict__["build_plans"], "__wrapped__")


def test_an_fe_without_a_pipeline_method_is_refused_at_install_and_left_untouched(tmp_path, signer, monkeypatch):
    from plancache.errors import SpecError

    monkeypatch.delattr(cudnn.pygraph, "get_execution_plan_count")
    before = dict(vars(cudnn.pygraph))
    cache = make_cache(tmp_path, signer)
    for _ in range(2):  # a second install is refused too, never half-installed
        with pytest.raises(SpecError, match="get_execution_plan_count"):
            hook.install(cache)
        assert dict(vars(cudnn.pygraph)) == before and hook._cache is None
    hook.uninstall()


# ------------------------------------------------------------------ one cache per device


def on_cuda(cache: PlanCache, device: int = 0) -> PlanCache:
    """``cache`` with its recording backend on ``cuda:<device>`` (a torch device: no GPU needed)."""
    import torch

    cache._backend.device = torch.device("cuda", device)
    return cache


def test_a_graph_of_another_device_is_served_by_a_cache_of_that_device(tmp_path, signer):
    """FE's ops build each graph with the handle of its tensors' device: a graph of ``cuda:1`` was checked against
    device 0's environment and loaded with device 0's backend."""
    cache = on_cuda(make_cache(tmp_path, signer))
    g0, _ = rmsnorm()
    g0._handle = cudnn.Handle(0x1000, 0)
    g1, _ = rmsnorm()
    g1._handle = cudnn.Handle(0x2000, 1)
    with hook.installed(cache, graph_class=StageGraph):
        five_steps(g0)
        five_steps(g1)
        made = hook.caches()
        assert set(made) == {0, 1} and made[0] is cache
        assert str(made[1]._backend.device) == "cuda:1" and made[1].environment == cache.environment
        assert cache._backend.deserialized == [BLOB] and made[1]._backend.deserialized == [BLOB]
        assert made[1].stats().hits == {"disk": 1} and cache.stats().hits == {"disk": 1}
    assert hook.caches() == {}  # closed with the hook


@pytest.mark.parametrize("mode", ["normal", "strict"])
def test_a_graph_of_another_device_is_refused_where_no_cache_can_be_made_for_it(tmp_path, signer, mode):
    cache = on_cuda(make_cache(tmp_path, signer, mode=mode))
    cache._backend.for_device = None  # a backend of one device only
    g, _ = rmsnorm()
    g._handle = cudnn.Handle(0x2000, 1)
    with hook.installed(cache, graph_class=StageGraph):
        if mode == "strict":
            with pytest.raises(PlanMiss, match="built for cuda:1, the cache serves cuda:0"):
                five_steps(g)
            return
        five_steps(g)
    assert cache.stats().fe_builds == {"other_device": 1} and cache._backend.deserialized == []
    assert [s[0] for s in g.stages][2:] == ["create_execution_plans", "check_support", "build_plans"]


# ------------------------------------------------------------------ workspace cap, the hook's own errors


@pytest.mark.parametrize("mode", ["normal", "strict"])
def test_a_served_plan_over_the_workspace_cap_is_refused_before_it_is_loaded(tmp_path, signer, monkeypatch, mode):
    monkeypatch.setenv("PLANCACHE_HOOK_MAX_WORKSPACE_BYTES", "1000")
    cache = make_cache(tmp_path, signer, mode=mode)  # its record needs 1024 bytes
    g, _ = rmsnorm()
    with hook.installed(cache, graph_class=StageGraph):
        if mode == "strict":
            with pytest.raises(PlanMiss, match=r"disk: rejected \(workspace\)"):
                five_steps(g)
        else:
            five_steps(g)
    stats = cache.stats()
    assert stats.rejects == {"workspace": 1} and cache._backend.deserialized == []
    assert ("engine_config", from_pygraph(rmsnorm()[0]).graph_key) not in cache._backend.calls  # nor rebuilt
    if mode == "normal":
        assert stats.fe_builds == {"miss": 1} and [s[0] for s in g.stages][-1] == "build_plans"


def test_the_workspace_cap_admits_a_plan_within_it(tmp_path, signer, monkeypatch):
    monkeypatch.setenv("PLANCACHE_HOOK_MAX_WORKSPACE_BYTES", "1024")
    cache = make_cache(tmp_path, signer)
    with hook.installed(cache, graph_class=StageGraph):
        five_steps(rmsnorm()[0])
    assert cache.stats().hits == {"disk": 1}


@pytest.mark.parametrize("where", ["serve", "prepare_graph"])
def test_an_error_of_the_hooks_own_leaves_the_graph_to_fe_logged_once(tmp_path, signer, monkeypatch, caplog, where):
    cache = make_cache(tmp_path, signer)
    monkeypatch.setattr(hook, "_error_logged", False)

    def boom(*args: Any, **kwargs: Any) -> None:
        raise KeyError("a bug of the hook")

    monkeypatch.setattr(cache if where == "serve" else cache._backend, where, boom)
    graphs = [rmsnorm()[0], rmsnorm()[0]]
    with caplog.at_level("WARNING", logger="plancache.client"), hook.installed(cache, graph_class=StageGraph):
        for g in graphs:
            five_steps(g)  # raised KeyError from build_plans / validate
    assert cache.stats().fe_builds == {"error": 2}
    for g in graphs:
        assert [s[0] for s in g.stages] == ["validate", "build_operation_graph", "create_execution_plans",
                                            "check_support", "build_plans"]
    assert [r.message for r in caplog.records if "the hook failed" in r.message] == [
        "plancache: the hook failed (KeyError: 'a bug of the hook'); FE builds such graphs itself, counted in "
        "stats().fe_builds['error'] (logged once)"]


def test_an_error_of_the_hooks_own_is_raised_in_strict_mode(tmp_path, signer, monkeypatch):
    cache = make_cache(tmp_path, signer, mode="strict")

    def boom(*args: Any, **kwargs: Any) -> None:
        raise KeyError("a bug of the hook")

    monkeypatch.setattr(cache, "serve", boom)
    with hook.installed(cache, graph_class=StageGraph), pytest.raises(KeyError, match="a bug of the hook"):
        five_steps(rmsnorm()[0])
