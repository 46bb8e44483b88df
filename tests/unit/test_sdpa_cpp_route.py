"""The attention route's C++ steady path on the CPU: what the Python route hands it (:func:`plancache.client.sdpa._hand`)
and when, its counters in ``stats()``, install and uninstall, and every way it is unavailable
(:mod:`plancache.client.sdpa_ext`). The compiled kernels run on the GPU in tests/integration/test_sdpa_route_gpu.py."""

from __future__ import annotations

import logging
import sys
import threading
import time
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

import torch.utils.cpp_extension  # noqa: E402 - before a test empties sys.path: it imports setuptools

import plancache.torch  # noqa: E402
from plancache.client import PlanCache, sdpa, sdpa_ext  # noqa: E402
from plancache.client.core import VerifiedBlob  # noqa: E402
from tests.unit.test_sdpa_route import GraphBackend, forward, fwd_specs, qkv  # noqa: E402

RECORD = types.SimpleNamespace(winner_median_ms=1.0, native_median_ms={"flash": 0.99, "cudnn_aten": 0.99})


class FakeExt:
    """Stands for the compiled module: records what it is handed; ``refuse`` makes ``add_*`` raise."""

    def __init__(self) -> None:
        self.installed: tuple[Any, ...] | None = None
        self.forwards: list[tuple[Any, ...]] = []
        self.backwards: list[tuple[Any, ...]] = []
        self.preloaded: list[tuple[str, bytes]] = []
        self.served = {"fwd": 0, "bwd": 0, "fwd_replayed": 0, "bwd_replayed": 0, "captured": 0, "capture_failed": 0}
        self.refuse = False
        self.lose = False  # serve_forward finds nothing (a defect the route survives)
        self.uninstalled = 0
        self.gate = threading.Event()  # add_backward waits for it (set: at once)
        self.gate.set()
        self.threads: list[str] = []  # the thread of each add_backward
        self.refuse_backward = False

    def install(self, device: int, py_forward: Any, py_backward: Any, replay: bool) -> None:
        self.installed = (device, py_forward, py_backward, replay)

    def uninstall(self) -> None:
        self.uninstalled += 1

    def preload(self, graph_key: str, blob: bytes) -> None:
        if self.refuse:
            raise RuntimeError("FE could not load the plan")
        self.preloaded.append((graph_key, blob))

    def add_forward(self, *args: Any) -> bool:
        if self.refuse:
            raise RuntimeError("plancache: the plan binds 6 tensors; the call has 5")
        self.forwards.append(args)
        return self._loads(args[-4])

    def add_backward(self, *args: Any) -> bool:
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        if self.refuse or self.refuse_backward:
            raise RuntimeError("refused")
        self.backwards.append(args)
        return self._loads(args[-3])

    def _loads(self, graph_key: str) -> bool:
        """Whether add_* deserializes (True) or binds a preloaded plan; a little time passes either way."""
        time.sleep(0.001)
        return graph_key not in dict(self.preloaded)

    def counts(self) -> dict[str, int]:
        return {**self.served, "fwd_configs": len(self.forwards), "bwd_configs": len(self.backwards)}

    def serve_forward(self, *call: Any) -> Any:
        if self.lose:
            return None
        self.served["fwd"] += 1
        return ("served forward", call)

    def serve_backward(self, *call: Any) -> Any:
        self.served["bwd"] += 1
        return ("served backward", call)


@pytest.fixture
def ext(monkeypatch) -> FakeExt:
    fake = FakeExt()
    monkeypatch.setattr(sdpa_ext, "load", lambda **_: fake)
    return fake


@pytest.fixture
def route(tmp_path, monkeypatch, ext):
    backend = GraphBackend()
    cache = PlanCache("", backend=backend, cache_dir=tmp_path, trusted_keys=[])
    monkeypatch.setattr(sdpa._Route, "handle", lambda self: "handle")
    aten: list[str] = []
    monkeypatch.setattr(sdpa, "_aten_forward", lambda *a, **k: aten.append("fwd") or "aten")
    monkeypatch.setattr(sdpa, "_aten_backward", lambda *a, **k: aten.append("bwd") or "aten")
    sdpa.install(cache, cpp=True)
    yield backend, ext, cache
    sdpa.uninstall()


def test_install_registers_the_cpp_kernels_over_the_python_ones_which_serve_what_they_miss(route):
    _, ext, _ = route
    device, py_forward, py_backward, replay = ext.installed
    assert device == 0 and py_forward is sdpa._forward and py_backward is sdpa._backward and replay is True
    sdpa.uninstall()
    assert ext.uninstalled == 1 and not sdpa.installed()


def test_a_configuration_run_here_once_is_handed_over_with_its_plan_and_uids_in_call_order(route):
    backend, ext, _ = route
    q, k, v = qkv()
    out = forward(q, k, v, scale=0.25)
    forward(q, k, v, scale=0.25)  # in the process, the C++ kernel serves this one: here, nothing is handed again
    (handed,) = ext.forwards
    hq, hk, hv, bias, stats, p, causal, scale, graph_key, blob, uids, out_strides = handed
    assert (hq, hk, hv, bias) == (q, k, v, None) and (stats, p, causal, scale) == (True, 0.0, True, 0.25)
    spec = fwd_specs(backend)[0]
    assert graph_key == spec.graph_key
    canonical = spec.canonical_uids()
    assert uids == [canonical[u] for u in (1, 2, 3, 100, 101)]
    assert out_strides == list(out[0].stride())
    assert blob.startswith(b"plan of graph"), "a plan built here: its graph serialized"


def test_a_plan_the_python_route_loaded_from_a_store_is_handed_over_as_its_verified_blob(route, monkeypatch):
    """The Python route loads a plan the C++ path did not get from ``verified_blobs`` (say the server was down for
    that call, then the disk answered the ladder): its verified blob is what is handed over, not a re-serialized
    graph."""
    _, ext, cache = route
    monkeypatch.setattr(cache, "verified_blobs", lambda specs: {})
    ladder = cache.plan

    def admitted(spec: Any) -> Any:  # the plan as a store's, admitted with its verified blob
        plan = ladder(spec)
        cache.context.verified[plan.graph_key] = ("record", b"verified bytes")
        return plan

    monkeypatch.setattr(cache, "plan", admitted)
    q, k, v = qkv()
    forward(q, k, v, lse=False)
    assert ext.forwards[0][9] == b"verified bytes"


def test_a_backward_is_handed_over_with_nine_buffers_and_its_deterministic_setting(route):
    backend, ext, _ = route
    q, k, v = qkv()
    o, lse = forward(q, k, v)[:2]
    sdpa._backward(torch.randn_like(o), q, k, v, o, lse.squeeze(-1), None, None, None, None, None, 64, 64, 0.0,
                   True)
    (handed,) = ext.backwards
    assert len(handed) == 13
    hq, hk, hv, ho, hlse, bias, p, causal, scale, deterministic, graph_key, blob, uids = handed
    assert bias is None and p == 0.0
    assert graph_key == backend.specs[-1].graph_key
    assert ho is o and hlse.shape == (2, 4, 64, 1) and (causal, scale, deterministic) == (True, None, False)
    canonical = backend.specs[-1].canonical_uids()
    assert uids == [canonical[u] for u in (1, 2, 3, 100, 200, 101, 201, 202, 203)]


@pytest.mark.parametrize("variant", ["bool_mask", "float32_bias", "broadcast_rows"])
def test_a_converted_mask_is_handed_over_converted_and_later_calls_convert_here_and_run_there(route, variant):
    _, ext, _ = route
    q, k, v = qkv()
    mask = {"bool_mask": torch.ones(2, 1, 1, 64, dtype=torch.bool),
            "float32_bias": torch.zeros(2, 1, 64, 64),
            "broadcast_rows": torch.zeros(2, 1, 1, 64, dtype=torch.bfloat16)}[variant]
    forward(q, k, v, mask)
    (handed,) = ext.forwards
    converted = handed[3]
    assert converted.dtype == torch.bfloat16 and converted.shape == (2, 1, 64, 64) and converted.is_contiguous()
    served = forward(q, k, v, mask)  # the C++ kernel sends it here to be converted; then it runs there
    assert served[0] == "served forward" and served[1][3].shape == (2, 1, 64, 64)
    assert sdpa.stats()["fwd"] == 2 and sdpa.stats()["cpp:fwd"] == 1


def test_a_dropout_configuration_is_handed_over_with_p_and_its_seed_and_offset_bound_last(route, monkeypatch):
    backend, ext, _ = route
    seeds = (torch.full((), 7, dtype=torch.long), torch.full((), 1000, dtype=torch.long))
    monkeypatch.setattr(sdpa, "_philox", lambda q, k: seeds)
    q, k, v = qkv()
    out = forward(q, k, v, dropout=0.1)
    (handed,) = ext.forwards
    assert handed[5] == pytest.approx(0.1)
    canonical = fwd_specs(backend)[0].canonical_uids()
    assert handed[10] == [canonical[u] for u in (1, 2, 3, 100, 101, 5, 6)]
    sdpa._backward(torch.randn_like(q), q, k, v, out[0], out[1], out[6], out[7], None, None, None, 64, 64, 0.1, True)
    (bwd,) = ext.backwards
    assert bwd[6] == pytest.approx(0.1) and len(bwd[12]) == 11


def test_an_additive_bias_of_the_inputs_dtype_is_handed_over_as_the_view_cudnn_reads(route):
    backend, ext, _ = route
    q, k, v = qkv()
    bias = torch.randn(2, 1, 64, 64, dtype=torch.bfloat16)
    o, lse = forward(q, k, v, bias)[:2]
    (handed,) = ext.forwards
    view = handed[3]
    assert view.data_ptr() == bias.data_ptr() and view.shape == (2, 1, 64, 64), "no copy: the caller's own bias"
    canonical = fwd_specs(backend)[0].canonical_uids()
    assert handed[10] == [canonical[u] for u in (1, 2, 3, 100, 101, 4)], "the bias bound last, as in Python"
    sdpa._backward(torch.randn_like(o), q, k, v, o, lse, None, None, bias, None, None, 64, 64, 0.0, True)
    (bwd,) = ext.backwards
    assert bwd[5].data_ptr() == bias.data_ptr() and len(bwd[12]) == 10


def test_nothing_is_handed_over_while_a_cuda_graph_is_captured_and_a_later_eager_call_hands_it(route, monkeypatch):
    """A training forward prepares its backward here; that backward's first run may be captured."""
    _, ext, _ = route
    q, k, v = qkv()
    o, lse = forward(q, k, v)[:2]
    assert ext.backwards == []
    monkeypatch.setattr(sdpa, "_capturing", lambda: True)
    sdpa._backward(torch.randn_like(o), q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True)
    assert ext.backwards == [], "loading a plan is not capturable"
    monkeypatch.setattr(sdpa, "_capturing", lambda: False)
    sdpa._backward(torch.randn_like(o), q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True)
    assert len(ext.backwards) == 1


def test_a_configuration_the_extension_refuses_stays_in_python_logged_once(route, caplog):
    _, ext, _ = route
    ext.refuse = True
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        forward(q, k, v)
        forward(q, k, v)
    assert sdpa.stats()["fwd"] == 2 and sdpa.stats()["fwd_cpp_refused"] == 1
    assert sum("did not take the attention fwd" in r.message for r in caplog.records) == 1
    assert "binds 6 tensors" in caplog.text


def test_stats_count_the_calls_the_cpp_kernels_served_with_the_routes(route):
    _, ext, _ = route
    q, k, v = qkv()
    forward(q, k, v)
    ext.served.update(fwd=7, bwd=3, fwd_replayed=5, bwd_replayed=2, captured=2, capture_failed=1)
    stats = sdpa.stats()
    assert stats["fwd"] == 8 and stats["cpp:fwd"] == 7 and stats["bwd"] == 3 and stats["cpp:bwd"] == 3
    assert stats["cpp:fwd_replayed"] == 5 and stats["cpp:bwd_replayed"] == 2
    assert stats["cpp:captured"] == 2 and stats["cpp:capture_failed"] == 1


@pytest.mark.parametrize("failure", ["build", "install"])
def test_where_the_extension_cannot_be_built_or_installed_python_serves_and_says_why(tmp_path, monkeypatch, ext,
                                                                                      caplog, failure):
    def fail(*_: Any, **__: Any) -> Any:
        if failure == "build":
            raise sdpa_ext.ExtensionUnavailable("cuDNN FE's C++ headers not found")
        raise RuntimeError("plancache: the C++ attention route is installed already")

    monkeypatch.setattr(sdpa_ext if failure == "build" else ext, "load" if failure == "build" else "install", fail)
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        sdpa.install(cache, cpp=True)
    try:
        assert sdpa.installed() and sdpa._route.ext is None and sdpa.stats()["cpp_unavailable"] == 1
        assert ("C++ steady path is unavailable: cuDNN FE's C++ headers not found" if failure == "build" else
                "did not install: plancache: the C++ attention route is installed already") in caplog.text
    finally:
        sdpa.uninstall()
    assert ext.uninstalled == 0, "nothing of it was installed to take back"


def test_the_setting_turns_the_cpp_path_on_and_a_changed_choice_reinstalls(tmp_path, monkeypatch, ext):
    monkeypatch.setenv("PLANCACHE_ATTENTION_CPP", "1")
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    plancache.torch.install(cache)
    try:
        assert sdpa._route.ext is ext and ext.installed is not None
        sdpa.install(cache, attention="fastest", cpp=False)
        assert sdpa._route.ext is None and ext.uninstalled == 1
    finally:
        plancache.torch.uninstall()


# ------------------------------------------------------------------ finding and building the extension


@pytest.mark.parametrize(("value", "replay"), [(None, True), ("false", False), ("1", True)])
def test_replays_are_on_unless_the_setting_turns_them_off_and_a_change_reinstalls(tmp_path, monkeypatch, ext, value,
                                                                                    replay):
    if value is not None:
        monkeypatch.setenv("PLANCACHE_ATTENTION_REPLAY", value)
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    plancache.torch.install(cache, attention_cpp=True)
    try:
        assert ext.installed is not None and ext.installed[3] is replay and sdpa._route.replay is replay
        sdpa.install(cache, cpp=True, replay=not replay)
        assert ext.uninstalled == 1 and ext.installed[3] is (not replay)
    finally:
        plancache.torch.uninstall()


def test_a_torch_without_cuda_cannot_build_it(monkeypatch):
    monkeypatch.setattr(sdpa_ext, "_module", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(sdpa_ext.ExtensionUnavailable, match="a build without CUDA"):
        sdpa_ext.load()


def test_missing_headers_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(sdpa_ext.ExtensionUnavailable, match=r"cuDNN FE's C\+\+ headers .*not found"):
        sdpa_ext.build_options()
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cudnn_frontend.h").write_text("")
    with pytest.raises(sdpa_ext.ExtensionUnavailable, match="cuDNN's headers"):
        sdpa_ext.build_options()


def test_build_options_take_fe_cudnn_and_cuda_from_wheels_and_link_torchs_cuda_libraries(monkeypatch, tmp_path):
    for rel in ("include/cudnn_frontend.h", "nvidia/cudnn/include/cudnn.h", "nvidia/cudnn/lib/libcudnn.so.9",
                "nvidia/cu13/include/cuda_runtime_api.h", "nvidia/cu13/include/crt/host_defines.h",
                "nvidia/cu13/include/nvrtc.h"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", None)
    monkeypatch.setattr(sdpa_ext, "SYSTEM_CUDA_INCLUDE", str(tmp_path / "no-toolkit"))
    options = sdpa_ext.build_options()
    assert options["extra_include_paths"] == [str(tmp_path / "include"), str(tmp_path / "nvidia/cudnn/include"),
                                              str(tmp_path / "nvidia/cu13/include")]
    lib = tmp_path / "nvidia/cudnn/lib"
    assert options["extra_ldflags"] == [f"-L{lib}", "-l:libcudnn.so.9", f"-Wl,-rpath,{lib}", "-lc10_cuda",
                                        "-ltorch_cuda"]


def test_a_killed_builds_lock_is_removed_and_a_live_build_is_waited_for(tmp_path, caplog):
    """torch's builder waits for ever on a lock a killed build left: an old one is removed, a young one awaited."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - sdpa_ext.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    sdpa_ext._await_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text

    lock.write_text("")  # a build under way: waited for until it releases its lock
    timer = threading.Timer(0.3, lock.unlink)
    timer.start()
    t0 = time.perf_counter()
    sdpa_ext._await_lock(tmp_path, poll=0.02)
    assert time.perf_counter() - t0 >= 0.25 and not lock.exists()
    timer.join()
    sdpa_ext._await_lock(tmp_path)  # no lock: returns at once


def test_the_source_ships_in_the_package():
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["plancache"]
    relative = sdpa_ext.SOURCE.relative_to(root / "plancache").as_posix()
    assert sdpa_ext.SOURCE.is_file() and any(fnmatch(relative, p) for p in patterns)


# ------------------------------------------------------------------ plans the cache verified: loaded in C++ only


@pytest.fixture
def served(route, monkeypatch):
    """The route's cache answers every spec with a verified blob from the server (``asked`` records each call)."""
    backend, ext, cache = route
    asked: list[list[str]] = []

    def verified_blobs(specs):
        keys = [s.graph_key for s in specs]
        asked.append(keys)
        return {k: VerifiedBlob(RECORD, f"blob {k}".encode(), "server") for k in keys}

    monkeypatch.setattr(cache, "verified_blobs", verified_blobs)
    return backend, ext, cache, asked


def test_a_verified_plan_is_loaded_in_cpp_only_and_serves_the_first_call_there(served):
    backend, ext, cache, asked = served
    q, k, v = qkv()
    out = forward(q, k, v, lse=False)
    assert out[0] == "served forward" and backend.specs == [], "no plan built nor loaded in Python"
    (handed,) = ext.forwards
    assert handed[8] == asked[0][0] and handed[9] == f"blob {asked[0][0]}".encode() and len(handed[10]) == 4
    stats = sdpa.stats()
    assert stats["fwd"] == 1 and stats["cpp:fwd"] == 1 and stats["load:server"] == 1
    assert cache.stats().deserialize_seconds > 0, "the C++ load is counted as the cache's own loads are"


def test_a_training_forward_hands_its_backward_over_with_it_in_one_request(served):
    _, ext, _, asked = served
    q, k, v = qkv()
    forward(q, k, v)
    assert len(asked) == 1 and len(asked[0]) == 2, "forward and backward plans asked for together"
    sdpa._route.close()  # the backward's plan loads on the loader thread
    (bwd,) = ext.backwards
    out, lse = bwd[3], bwd[4]
    assert out.device.type == "meta" and lse.shape == (2, 4, 64, 1), "keyed by the layouts the forward will return"
    assert sdpa.stats()["load:server"] == 2


def _backward_of(q: Any, k: Any, v: Any) -> Any:
    """The backward call of ``forward(q, k, v)``'s outputs (contiguous inputs: O in their layout)."""
    o = torch.empty_like(q)
    return sdpa._backward(o, q, k, v, o, torch.randn(q.shape[:3]), None, None, None, None, None, 64, 64, 0.0, True)


def _forward_while_loading(ext: FakeExt, after: float) -> tuple[Any, Any, Any]:
    """A training forward whose backward's load in C++ is held back until ``after`` seconds later."""
    ext.gate.clear()
    q, k, v = qkv()
    assert forward(q, k, v)[0] == "served forward" and ext.backwards == [], "returned before the backward loaded"
    threading.Timer(after, ext.gate.set).start()
    return q, k, v


def test_a_training_forwards_backward_loads_on_the_loader_thread_and_its_first_call_takes_it(served):
    """The forward returns while its backward's plan still loads in C++; the backward's first call takes that load,
    and nothing is asked for, written or loaded again."""
    _, ext, _, asked = served
    q, k, v = _forward_while_loading(ext, 0.05)
    sdpa._route.close()
    assert _backward_of(q, k, v)[0] == "served backward"
    assert ext.threads == ["plancache-attention-load_0"] and len(ext.backwards) == 1 and len(asked) == 1
    assert sdpa._route.pending == {} and sdpa.stats()["cpp:bwd"] == 1 and sdpa.stats()["load:server"] == 2


def test_the_backwards_load_is_under_way_on_the_loader_thread_while_the_forwards_loads(served, monkeypatch):
    """The two deserializations of a training forward's first call overlap: the backward's is handed to the loader
    thread before the forward's starts on the calling thread."""
    _, ext, _, _ = served
    began: list[bool] = []
    add_forward = ext.add_forward

    def watched(*args: Any) -> bool:
        deadline = time.monotonic() + 2
        while not ext.threads and time.monotonic() < deadline:
            time.sleep(0.001)
        began.append(bool(ext.threads))
        return add_forward(*args)

    monkeypatch.setattr(ext, "add_forward", watched)
    q, k, v = qkv()
    forward(q, k, v)
    sdpa._route.close()
    assert began == [True] and ext.threads == ["plancache-attention-load_0"]


def test_the_backwards_first_call_waits_for_its_load_under_way(served):
    _, ext, _, asked = served
    q, k, v = _forward_while_loading(ext, 0.1)
    t0 = time.perf_counter()
    assert _backward_of(q, k, v)[0] == "served backward", "served once its plan was loaded"
    assert time.perf_counter() - t0 >= 0.05 and len(ext.backwards) == 1 and len(asked) == 1
    assert sdpa._route.pending == {}


def test_a_backward_the_extension_refuses_on_the_loader_thread_is_loaded_in_python_logged_once(served, caplog):
    backend, ext, _, asked = served
    ext.refuse_backward = True
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        forward(q, k, v)
        dq, _, _ = _backward_of(q, k, v)
    assert dq.shape == q.shape and len(backend.specs) == 1, "loaded by the Python route's ladder instead"
    assert caplog.text.count("did not take the attention bwd") == 1 and sdpa.stats()["bwd_cpp_refused"] == 1
    assert sdpa.stats()["bwd"] == 1 and len(asked) == 1 and sdpa._route.pending == {}
    assert sdpa.stats()["load:server"] == 1, "the refused backward counts where it loaded, not as a server load too"


def test_a_backward_loading_in_cpp_is_not_written_ahead_again(served):
    _, ext, _, _ = served
    q, k, v = _forward_while_loading(ext, 0.05)
    ahead = sdpa._backward_ahead(q, k, v, None, True, None, 0.0)
    assert ahead.ckey in sdpa._route.pending and sdpa._write_ahead(sdpa._route, ahead) is None
    sdpa._route.close()


def test_uninstall_waits_for_the_loads_under_way(served):
    _, ext, _, _ = served
    _forward_while_loading(ext, 0.05)
    sdpa.uninstall()
    assert len(ext.backwards) == 1 and ext.uninstalled == 1


def test_a_backward_held_in_cpp_is_served_there(served):
    _, ext, _, _ = served
    result = _backward_of(*qkv())
    assert result[0] == "served backward" and sdpa.stats()["cpp:bwd"] == 1


def test_a_record_that_measured_a_native_kernel_faster_loads_no_plan_at_all(served, monkeypatch):
    _, ext, _, _ = served
    natives = []
    monkeypatch.setattr(sdpa._Native, "of", classmethod(lambda cls, kernel: natives.append(kernel) or cls(
        kernel, lambda *a: ("native", None), lambda *a: None)))
    record = types.SimpleNamespace(winner_median_ms=1.0, native_median_ms={"flash": 0.5})
    monkeypatch.setattr(sys.modules[__name__], "RECORD", record)
    q, k, v = qkv()
    sdpa._route.cache.verified_blobs = lambda specs: {s.graph_key: VerifiedBlob(record, b"b", "disk") for s in specs}
    forward(q, k, v, lse=False, causal=True)
    assert natives == ["flash"] and ext.forwards == [] and sdpa.stats()["fwd_native:flash"] == 1


def test_a_dropout_configuration_never_takes_a_native_kernel_a_record_names(served, monkeypatch):
    _, ext, cache, _ = served
    record = types.SimpleNamespace(winner_median_ms=1.0, native_median_ms={"cudnn_aten": 0.5})
    cache.verified_blobs = lambda specs: {s.graph_key: VerifiedBlob(record, b"b", "disk") for s in specs}
    monkeypatch.setattr(sdpa, "_philox", lambda q, k: (torch.zeros((), dtype=torch.long),) * 2)
    q, k, v = qkv()
    forward(q, k, v, lse=False, dropout=0.1)
    assert len(ext.forwards) == 1 and not any(k.startswith("fwd_native") for k in sdpa.stats())


def test_a_verified_plan_the_extension_refuses_is_loaded_in_python(served):
    backend, ext, _, _ = served
    ext.refuse = True
    q, k, v = qkv()
    forward(q, k, v, lse=False)
    assert len(fwd_specs(backend)) == 1, "loaded by the Python route's ladder instead"
    assert sdpa.stats()["fwd_cpp_refused"] == 1 and sdpa.stats()["fwd"] == 1 and "load:server" not in sdpa.stats()


def test_a_held_configuration_the_extension_cannot_serve_runs_torchs_kernel_logged(served, caplog):
    _, ext, _, _ = served
    ext.lose = True
    q, k, v = qkv()
    with caplog.at_level(logging.ERROR, logger="plancache.client"):
        assert forward(q, k, v, lse=False) == "aten"
    assert sdpa.stats()["fwd_aten:unsupported"] == 1 and "lost the attention fwd" in caplog.text


def test_a_converted_masks_verified_plan_is_loaded_in_cpp_and_its_first_call_served_there(served):
    _, ext, _, asked = served
    q, k, v = qkv()
    out = forward(q, k, v, torch.ones(2, 1, 64, 64, dtype=torch.bool), lse=False)
    assert asked and out[0] == "served forward" and ext.forwards[0][3].dtype == torch.bfloat16


# ------------------------------------------------------------------ a warm start's plans, loaded ahead in C++


def _spec(*names: str) -> Any:
    return types.SimpleNamespace(graph_key=f"key of {'+'.join(names)}",
                                 tensors=[types.SimpleNamespace(name=n) for n in names])


def test_preload_loads_the_routes_plans_ahead(route):
    _, ext, cache = route
    assert sdpa.preload(_spec("q", "k", "v", "o", "stats"), b"plan") is True
    assert sdpa.preload(_spec("q", "k", "v", "o", "bias", "seed", "offset"), b"masked dropout plan") is True
    assert ext.preloaded == [("key of q+k+v+o+stats", b"plan"),
                             ("key of q+k+v+o+bias+seed+offset", b"masked dropout plan")]
    assert cache.stats().deserialize_seconds > 0


def test_plancache_torch_installs_the_route_first_and_hands_the_warm_start_its_preload(tmp_path, monkeypatch, ext):
    from plancache.client import hook

    seen: dict[str, Any] = {}
    monkeypatch.setattr(hook, "install", lambda cache, **kw: seen.update(kw, route=sdpa.installed()))
    monkeypatch.setattr(hook, "uninstall", lambda: None)
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    plancache.torch.install(cache, attention_cpp=True)
    try:
        assert seen["route"] and seen["warm_loader"] is sdpa.preload
        assert set(seen["warm_load"]) == set(sdpa.SPEC_NAMES.values())
    finally:
        plancache.torch.uninstall()
    plancache.torch.install(cache, attention_cpp=False)
    plancache.torch.uninstall()
    assert seen["warm_loader"] is None


def test_a_hook_install_that_fails_leaves_no_route_installed(tmp_path, monkeypatch, ext):
    from plancache.client import hook
    from plancache.errors import SpecError

    def refuse(cache: Any, **kw: Any) -> None:
        raise SpecError("capture.json: not a capture file")

    monkeypatch.setattr(hook, "install", refuse)
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    with pytest.raises(SpecError, match="not a capture file"):
        plancache.torch.install(cache, attention_cpp=True)
    assert not sdpa.installed() and ext.uninstalled == 1


def test_each_version_of_the_source_builds_under_a_name_of_its_own(monkeypatch, tmp_path):
    first = sdpa_ext.module_name()
    assert first.startswith("plancache_sdpa_route_") and first == sdpa_ext.module_name()
    changed = tmp_path / "sdpa_route.cpp"
    changed.write_bytes(sdpa_ext.SOURCE.read_bytes() + b"// another version\n")
    monkeypatch.setattr(sdpa_ext, "SOURCE", changed)
    assert sdpa_ext.module_name() != first


def test_another_torch_or_python_builds_under_another_name(monkeypatch):
    first = sdpa_ext.module_name()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert sdpa_ext.module_name() != first


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """load() with a CUDA torch, a build folder under ``tmp_path`` and torch's builder recorded."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(sdpa_ext, "_module", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(sdpa_ext, "build_options", lambda: {"extra_include_paths": ["/fe"], "extra_ldflags": []})
    monkeypatch.setattr(sdpa_ext, "_build_directory", lambda name: tmp_path)
    monkeypatch.setattr(sdpa_ext, "_usual_directory", lambda name: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: calls.append(kw) or "compiled")
    monkeypatch.setattr(sdpa_ext, "_import", lambda name, path: f"imported {path.name}")
    return calls


def test_load_compiles_a_missing_build_once_and_says_so(builds, caplog):
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        assert sdpa_ext.load() == "compiled" and sdpa_ext.load() == "compiled"
    (call,) = builds
    assert call["name"] == sdpa_ext.module_name() and call["sources"] == [str(sdpa_ext.SOURCE)]
    assert call["extra_include_paths"] == ["/fe"] and call["with_cuda"] is False
    assert "compiling the attention route's C++ steady path" in caplog.text


def test_load_imports_this_versions_build_without_the_builder(builds, tmp_path, caplog):
    name = sdpa_ext.module_name()
    (tmp_path / f"{name}.so").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        assert sdpa_ext.load(build=False) == f"imported {name}.so"
    assert builds == [] and "compiling" not in caplog.text


@pytest.mark.parametrize("env_dir", [False, True])
def test_the_usual_folder_is_torchs_own_and_a_build_there_is_imported_without_the_builder(monkeypatch, tmp_path,
                                                                                        env_dir):
    """A build where torch's builder keeps it by its rule is imported without importing the builder (setuptools:
    70 ms at install); the rule copied is checked against the builder's own answer on this torch."""
    from pathlib import Path

    from torch import _appdirs
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setattr(sdpa_ext, "_module", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_appdirs, "user_cache_dir", lambda appname: str(tmp_path / "home" / appname))
    if env_dir:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    name = sdpa_ext.module_name()
    usual = sdpa_ext._usual_directory(name)
    assert usual == Path(_get_build_directory(name, False))
    (usual / f"{name}.so").write_bytes(b"")
    monkeypatch.setattr(sdpa_ext, "_import", lambda name, path: f"imported {path}")
    monkeypatch.setattr(sdpa_ext, "_build_directory", lambda name: pytest.fail("the builder was asked"))
    assert sdpa_ext.load(build=False) == f"imported {usual / f'{name}.so'}"


def test_a_builder_that_cannot_be_imported_is_named(builds, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # as without setuptools
    with pytest.raises(sdpa_ext.ExtensionUnavailable, match="torch's extension builder cannot be imported .*setuptools"):
        sdpa_ext.load()


def test_without_build_a_missing_or_unfinished_build_is_not_built(builds, tmp_path):
    with pytest.raises(sdpa_ext.NotBuilt, match="is not built here yet"):
        sdpa_ext.load(build=False)
    (tmp_path / f"{sdpa_ext.module_name()}.so").write_bytes(b"")
    (tmp_path / "lock").write_text("")  # another process is still linking it
    with pytest.raises(sdpa_ext.NotBuilt, match="is being built"):
        sdpa_ext.load(build=False)
    assert builds == []


def test_a_failed_compile_is_unavailable_with_the_compilers_last_words(builds, monkeypatch):
    def compile_fails(**_: Any) -> Any:
        raise RuntimeError("Error building extension 'plancache_sdpa_route': sdpa_route.cpp:12: error: no match")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_fails)
    with pytest.raises(sdpa_ext.ExtensionUnavailable, match="could not build sdpa_route.cpp: .*error: no match"):
        sdpa_ext.load()


def test_a_failed_build_is_not_started_again_until_asked(builds, monkeypatch, tmp_path):
    """A failed build is noted beside it: the processes after it serve in Python without starting it again (not
    NotBuilt, which starts a build), until a build asked for (``build=True``, the command) succeeds."""
    def compile_fails(**_: Any) -> Any:
        raise RuntimeError("c++: fatal error: cudnn_frontend.h: No such file or directory")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_fails)
    with pytest.raises(sdpa_ext.ExtensionUnavailable):
        sdpa_ext.load()
    with pytest.raises(sdpa_ext.ExtensionUnavailable, match="its build here failed .*No such file") as caught:
        sdpa_ext.load(build=False)
    assert not isinstance(caught.value, sdpa_ext.NotBuilt)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: "compiled")
    assert sdpa_ext.load() == "compiled" and not (tmp_path / "failed").exists()


def test_a_background_build_runs_this_module_detached_unless_one_is_under_way(monkeypatch, tmp_path):
    import os
    import subprocess
    import time

    started: list[tuple[list[str], dict[str, Any]]] = []
    monkeypatch.setattr(sdpa_ext, "_build_directory", lambda name: tmp_path / name)
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: started.append((argv, kw)))
    assert sdpa_ext.build_in_background() is True
    ((argv, kw),) = started
    assert argv == [sys.executable, "-m", "plancache.client.sdpa_ext"] and kw["start_new_session"] is True
    assert kw["env"]["CUDA_VISIBLE_DEVICES"] == "" and kw["env"]["PATH"] == os.environ["PATH"]
    assert (tmp_path / sdpa_ext.module_name() / "build.log").exists()
    lock = tmp_path / sdpa_ext.module_name() / "lock"
    lock.write_text("")
    assert sdpa_ext.build_in_background() is False and len(started) == 1
    old = time.time() - sdpa_ext.STALE_LOCK_SECONDS - 5  # a killed build's: the new build removes it
    os.utime(lock, (old, old))
    assert sdpa_ext.build_in_background() is True and len(started) == 2
    lock.unlink()
    monkeypatch.setattr(sys, "executable", "/opt/app/bin/inference-server")  # embeds Python: not run with -m
    assert sdpa_ext.build_in_background() is False and len(started) == 2


def test_the_build_command_says_why_it_cannot_build(monkeypatch, capsys):
    monkeypatch.setattr(sdpa_ext, "_module", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert sdpa_ext.main() == 1
    assert "cannot be built here: torch" in capsys.readouterr().err


@pytest.mark.skipif(torch.version.cuda is not None, reason="on a CUDA torch the command compiles (a GPU test's job)")
def test_the_build_command_runs_as_the_docs_write_it():
    """``python -m plancache.client.sdpa_ext`` (README, FE.md): on a torch without CUDA, one line saying why."""
    import subprocess
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "plancache.client.sdpa_ext"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("plancache: the attention route's C++ steady path cannot be "
                                                           "built here: torch ")


@pytest.mark.parametrize(("value", "expected"), [(None, "auto"), ("auto", "auto"), ("1", True), ("true", True),
                                                 ("0", False), ("false", False)])
def test_plancache_attention_cpp_reads_auto_or_a_boolean(monkeypatch, value, expected):
    from plancache.settings import ClientSettings

    if value is None:
        monkeypatch.delenv("PLANCACHE_ATTENTION_CPP", raising=False)
    else:
        monkeypatch.setenv("PLANCACHE_ATTENTION_CPP", value)
    assert ClientSettings().attention_cpp == expected


@pytest.mark.parametrize("cpp", ["auto", True])
def test_auto_starts_a_missing_build_in_the_background_and_true_builds_it_now(tmp_path, monkeypatch, caplog, cpp):
    asked: list[bool] = []
    started: list[bool] = []

    def load(*, build: bool = True, verbose: bool = False) -> Any:
        asked.append(build)
        raise (sdpa_ext.NotBuilt("plancache_sdpa_route_x is not built here yet") if not build
               else sdpa_ext.ExtensionUnavailable("no compiler"))

    monkeypatch.setattr(sdpa_ext, "load", load)
    monkeypatch.setattr(sdpa_ext, "build_in_background", lambda: started.append(True) or True)
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[], mode="normal")
    with caplog.at_level(logging.WARNING, logger="plancache.client"):
        sdpa.install(cache, cpp=cpp)
    try:
        assert sdpa._route.ext is None and sdpa.stats()["cpp_unavailable"] == 1
        assert asked == [cpp is True]
        assert started == ([True] if cpp == "auto" else [])
        assert ("compiling it in the background" if cpp == "auto" else "no compiler") in caplog.text
    finally:
        sdpa.uninstall()
    with pytest.raises(ValueError, match="expected True, False or 'auto'"):
        sdpa.install(cache, cpp="yes")


def test_a_strict_process_without_the_plans_raises_plan_miss_through_the_cpp_path(tmp_path, monkeypatch, ext):
    from plancache.errors import PlanMiss

    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[], mode="strict")
    asked: list[int] = []
    real = cache.verified_blobs
    monkeypatch.setattr(cache, "verified_blobs", lambda specs: asked.append(len(specs)) or real(specs))
    sdpa.install(cache, cpp=True)
    try:
        with pytest.raises(PlanMiss):
            forward(*qkv())
        assert asked == [2] and ext.forwards == [] and ext.backwards == []
    finally:
        sdpa.uninstall()


def test_a_plan_preloaded_by_the_warm_start_is_only_bound_at_the_first_call(served):
    """Its deserializing was counted when the warm start loaded it (:func:`sdpa.preload`); binding it counts nothing
    more."""
    _, ext, cache, _ = served
    q, k, v = qkv()
    forward(q, k, v, lse=False)  # deserialized by the C++ side now: counted
    counted = cache.stats().deserialize_seconds
    assert counted > 0
    ext.preloaded.append((ext.forwards[0][8], b"preloaded"))  # as a warm start's preload leaves it
    sdpa._route.executors.clear()  # the configuration met anew, as in a process that warm-started
    sdpa._route.handed.clear()
    forward(q, k, v, lse=False)
    assert len(ext.forwards) == 2 and cache.stats().deserialize_seconds == counted
