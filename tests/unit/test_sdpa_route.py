"""plancache's route for torch's cuDNN attention (:mod:`plancache.client.sdpa`) on the CPU: the executor cache and
its keys, the FE graphs it writes, the output layouts against torch's own fake (meta) kernel, and every fallback to
torch's kernel. The kernels run on the GPU in tests/integration/test_sdpa_route_gpu.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

import plancache.torch  # noqa: E402
from plancache.client import PlanCache, sdpa  # noqa: E402
from plancache.errors import PlanMiss  # noqa: E402
from plancache.gpu.native import matching_layout  # noqa: E402
from plancache.spec import GraphSpec  # noqa: E402
from tests.client_fakes import FakeBuiltPlan, RecordingBackend  # noqa: E402


class FakeGraph:
    """A loaded plan's graph: records each ordered execute."""

    def __init__(self) -> None:
        self.runs: list[tuple[list[Any], Any, Any, tuple[int, ...]]] = []

    def execute(self, buffers: list[Any], workspace: Any, handle: Any = None, tensor_uids: Any = None) -> None:
        self.runs.append((list(buffers), workspace, handle, tuple(tensor_uids)))

    def serialize(self, as_bytes: bool = False) -> bytes:
        assert as_bytes
        return f"plan of graph {id(self)}".encode()


class GraphBackend(RecordingBackend):
    """Heuristic builds hold a :class:`FakeGraph`; ``specs`` keeps every spec built."""

    def __init__(self, *, fail: tuple[str, ...] = ()) -> None:
        super().__init__(fail=fail)
        self.specs: list[GraphSpec] = []

    def build_heuristic(self, spec: GraphSpec, kernel_cache: Any, *, graph: Any = None) -> FakeBuiltPlan:
        built = super().build_heuristic(spec, kernel_cache, graph=graph)
        built.graph = FakeGraph()
        self.specs.append(spec)
        return built


@pytest.fixture
def route(tmp_path, monkeypatch):
    backend = GraphBackend()
    cache = PlanCache("", backend=backend, cache_dir=tmp_path, trusted_keys=[])
    monkeypatch.setattr(sdpa._Route, "handle", lambda self: "handle")
    aten: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(sdpa, "_aten_forward", lambda *a, **k: aten.append(("fwd", a)) or "aten")
    monkeypatch.setattr(sdpa, "_aten_backward", lambda *a, **k: aten.append(("bwd", a)) or "aten")
    sdpa.install(cache, cpp=False)
    yield backend, aten
    sdpa.uninstall()


def fwd_specs(backend: GraphBackend) -> list[GraphSpec]:
    """The forward graphs built (a training forward builds its backward's with it)."""
    return [spec for spec in backend.specs if spec.nodes[0].type == "SDPA"]


def qkv(b: int = 2, h: int = 4, s: int = 64, d: int = 32, dtype: Any = torch.bfloat16, kv_heads: int | None = None):
    kv = kv_heads or h
    return (torch.randn(b, h, s, d, dtype=dtype), torch.randn(b, kv, s, d, dtype=dtype),
            torch.randn(b, kv, s, d, dtype=dtype))


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms on, for the block."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def forward(q, k, v, bias=None, *, causal=True, dropout=0.0, lse=True, scale=None):
    return sdpa._forward(q, k, v, bias, lse, dropout, causal, False, scale=scale)


def test_a_configuration_is_prepared_once_and_each_call_binds_its_buffers_in_plan_order(route):
    backend, aten = route
    q, k, v = qkv()
    out = forward(q, k, v)
    again = forward(q, k, v)
    assert aten == [] and len(fwd_specs(backend)) == 1, "one plan for one configuration"
    graph = fwd_specs(backend)[0]
    o, lse = out[0], out[1]
    assert o.shape == (2, 4, 64, 32) and lse.shape == (2, 4, 64, 1) and lse.dtype == torch.float32
    assert out[4:6] == (64, 64) and again[0].data_ptr() != o.data_ptr()
    stats = sdpa.stats()
    assert stats["fwd"] == 2 and stats["load:heuristic"] == 2  # with its backward's
    # the spec is the attention forward torch's op stands for: causal, stats, the default scale
    (node,) = graph.nodes
    assert node.type == "SDPA" and node.params["generate_stats"] is True
    assert node.params["attn_scale"] == pytest.approx(32 ** -0.5) and node.params["diagonal_band_right_bound"] == 0


def test_buffers_reach_the_loaded_graph_by_canonical_uid(route, monkeypatch):
    backend, _ = route
    q, k, v = (t.requires_grad_() for t in qkv())  # as autograd hands them over in training
    graphs = _runs(monkeypatch)
    o, lse = forward(q, k, v)[:2]
    (run,) = graphs[0].runs
    buffers, workspace, handle, uids = run
    assert handle == "handle" and buffers[3] is o and buffers[4] is lse
    assert [b.data_ptr() for b in buffers[:3]] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    assert not any(b.requires_grad for b in buffers), "detached: FE reads those natively, not by a Python fallback"
    canonical = backend.specs[0].canonical_uids()
    assert uids == tuple(canonical[u] for u in (1, 2, 3, 100, 101))
    assert workspace.numel() == 4096 and workspace.dtype == torch.uint8  # the plan's size, from torch's allocator


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "causal", "scale", "stats", "bias", "gqa"])
def test_every_layout_and_flag_is_part_of_the_key(route, change):
    backend, _ = route
    q, k, v = qkv()
    forward(q, k, v)
    kwargs: dict[str, Any] = {}
    if change == "shape":
        q, k, v = qkv(s=128)
    elif change == "stride":
        q = torch.randn(2, 64, 4, 32, dtype=torch.bfloat16).transpose(1, 2)
    elif change == "dtype":
        q, k, v = qkv(dtype=torch.float16)
    elif change == "causal":
        kwargs["causal"] = False
    elif change == "scale":
        kwargs["scale"] = 0.5
    elif change == "stats":
        kwargs["lse"] = False
    elif change == "bias":
        kwargs["bias"] = torch.zeros(2, 1, 64, 64, dtype=torch.bfloat16)
    else:
        q, k, v = qkv(kv_heads=2)
    forward(q, k, v, **kwargs)
    specs = fwd_specs(backend)
    assert len(specs) == 2 and specs[0].graph_key != specs[1].graph_key


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "sbhd"])
@pytest.mark.parametrize("d_v", [32, 48])
def test_the_output_layout_is_torchs_fake_kernels(layout, d_v):
    """torch.compile and autograd see the meta kernel's output: the route's must be the same, for every layout."""
    base = {"bhsd": (2, 4, 64, 32), "bshd": (2, 64, 4, 32), "sbhd": (64, 2, 4, 32)}[layout]
    perm = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3)}[layout]
    q = torch.empty(base, device="meta").permute(*perm)
    k = torch.empty(base, device="meta").permute(*perm)
    v = torch.empty(*base[:3], d_v, device="meta").permute(*perm)
    meta = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    assert meta[0].stride() == matching_layout(q, d_v)


def test_gradients_take_their_inputs_layouts_and_do_is_read_in_os(route):
    backend, aten = route
    q = torch.randn(2, 64, 4, 32, dtype=torch.bfloat16).transpose(1, 2)  # BSHD storage
    k, v = q.clone(), q.clone()
    o, lse = forward(q, k, v)[:2]
    assert o.stride() == q.stride()
    grad = torch.randn(o.shape, dtype=torch.bfloat16)  # BHSD: not O's layout
    dq, dk, dv = sdpa._backward(grad, q, k, v, o, lse.squeeze(-1), None, None, None, None, None, 64, 64, 0.0, True)
    assert aten == [] and dq.stride() == q.stride() and dk.stride() == k.stride() and dv.stride() == v.stride()
    bwd = backend.specs[-1]
    assert [n.type for n in bwd.nodes] == ["SDPA_BWD"]
    tensors = {t.name: t for t in bwd.tensors}
    assert tensors["dO"].stride == tensors["o"].stride == list(o.stride())
    summed = torch.ones((), dtype=torch.bfloat16).expand(o.shape)  # what sum().backward() hands over: strides 0
    sdpa._backward(summed, q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True)
    assert len(backend.specs) == 2 and sdpa.stats()["bwd"] == 2, "a dO in another layout is copied, not a new plan"


@pytest.mark.parametrize("mask", ["bool_padding", "additive_per_batch", "float32_additive"])
def test_masks_become_the_additive_bias_cudnn_reads(route, mask):
    backend, aten = route
    q, k, v = qkv()
    if mask == "bool_padding":
        bias = (torch.arange(64) < 48).view(1, 1, 1, 64).expand(2, 4, 64, 64)
    elif mask == "additive_per_batch":
        bias = torch.randn(2, 1, 64, 64, dtype=torch.bfloat16).expand(2, 4, 64, 64)
    else:
        bias = torch.randn(2, 4, 64, 64)
    forward(q, k, v, bias)
    assert aten == []
    (spec,) = fwd_specs(backend)
    tensors = {t.name: t for t in spec.tensors}
    assert tensors["bias"].data_type == "BFLOAT16"
    assert tensors["bias"].dim[1] == (4 if mask == "float32_additive" else 1), "broadcast heads stay broadcast"
    converted = sdpa._bias(bias, q, k)
    assert converted.is_contiguous() and converted.shape == (2, 4 if mask == "float32_additive" else 1, 64, 64), \
        "batch and query rows materialised (cuDNN's backward was wrong with broadcast rows), heads kept broadcast"
    assert tensors["bias"].dim == list(converted.shape) and tensors["bias"].stride == list(converted.stride())
    if mask == "bool_padding":
        assert converted.dtype == torch.bfloat16 and (converted[:, :, :, 48:] == torch.finfo(torch.bfloat16).min).all()
        assert (converted[:, :, :, :48] == 0).all()


@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 1, 1, 64), (64, 64), (1, 64), (2, 4, 64, 1)])
def test_a_mask_broadcast_over_rows_batch_or_keys_reaches_cudnn_dense(shape):
    """A padding mask (B or 1, 1, 1, Skv), a 2-D (Sq, Skv) mask, a row vector or a mask broadcast over the keys: what
    cuDNN reads is dense over batch, query rows and keys, and equal to the mask torch broadcasts."""
    q, k, _ = qkv()
    mask = torch.rand(*shape) > 0.3
    converted = sdpa._bias(mask, q, k)
    want = torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16).masked_fill_(~mask.expand(2, 4, 64, 64),
                                                                        torch.finfo(torch.bfloat16).min)
    assert converted.is_contiguous() and converted.shape[0] == 2 and converted.shape[2:] == (64, 64)
    assert torch.equal(converted.expand(2, 4, 64, 64), want)


@pytest.mark.parametrize(("why", "call"), [
    ("debug_mask", lambda q, k, v: sdpa._forward(q, k, v, None, True, 0.0, True, True)),
    ("layout", lambda q, k, v: forward(q[..., ::2], k[..., ::2], v[..., ::2])),
])
def test_what_the_route_cannot_serve_runs_torchs_kernel_and_is_counted(route, why, call):
    backend, aten = route
    assert call(*qkv()) == "aten"
    assert [a[0] for a in aten] == ["fwd"] and sdpa.stats()[f"fwd_aten:{why}"] == 1


def _shifted(t: Any) -> Any:
    """``t``'s values at an address 2 bytes past a 16-byte boundary, in the same layout."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)


def test_an_input_off_the_alignment_is_left_to_torch_at_each_call_and_its_configuration_still_runs_the_plan(route):
    """The inner strides are part of the key (checked once, when it is prepared); an address is checked each call."""
    backend, aten = route
    q, k, v = qkv()
    assert forward(_shifted(q), k, v) == "aten" and sdpa.stats()["fwd_aten:layout"] == 1
    assert forward(q, k, v) != "aten" and sdpa.stats()["fwd"] == 1, "the same configuration, aligned: the plan"
    o, lse = forward(q, k, v)[:2]
    assert sdpa._backward(_shifted(o), q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True) == "aten"
    assert sdpa.stats()["bwd_aten:layout"] == 1 and [a[0] for a in aten] == ["fwd", "bwd"]
    strided = torch.randn(2, 4, 64, 64, dtype=torch.bfloat16)[..., ::2]
    assert sdpa._backward(o, strided, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True) == "aten"
    assert sdpa.stats()["bwd_aten:layout"] == 2


def test_nested_and_dropout_backward_run_torchs_kernel(route):
    _, aten = route
    q, k, v = qkv()
    o = torch.empty_like(q)
    lse = torch.empty(2, 4, 64, 1)
    sdpa._backward(o, q, k, v, o, lse, None, None, None, torch.zeros(3), torch.zeros(3), 64, 64, 0.0, True)
    sdpa._backward(o, q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.1, True)
    assert [a[0] for a in aten] == ["bwd", "bwd"]
    assert sdpa.stats()["bwd_aten:nested"] == 1 and sdpa.stats()["bwd_aten:dropout"] == 1


class Philox:
    """A device generator's seed and offset (the CPU generator keeps no offset)."""

    def __init__(self, seed: int, offset: int) -> None:
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


@pytest.fixture
def generator(monkeypatch):
    gen = Philox((1 << 64) - 5, 1000)  # a seed past int64: handed over as the int64 of the same bits
    monkeypatch.setattr(sdpa, "_generator", lambda device: gen)
    return gen


def _runs(monkeypatch) -> list[FakeGraph]:
    """The graph of each plan built from now on (each records its runs)."""
    graphs: list[FakeGraph] = []
    original = GraphBackend.build_heuristic

    def keep(self, spec, kernel_cache, *, graph=None):
        built = original(self, spec, kernel_cache, graph=graph)
        graphs.append(built.graph)
        return built

    monkeypatch.setattr(GraphBackend, "build_heuristic", keep)
    return graphs


def test_dropout_is_served_with_the_generators_seed_and_offset_which_it_advances(route, generator, monkeypatch):
    backend, aten = route
    graphs = _runs(monkeypatch)
    q, k, v = qkv(b=2, h=4, s=64)
    first = forward(q, k, v, dropout=0.1)
    second = forward(q, k, v, dropout=0.1)
    assert aten == [] and sdpa.stats()["fwd"] == 2 and len(fwd_specs(backend)) == 1
    (node,) = fwd_specs(backend)[0].nodes
    assert node.params["dropout_0"] == pytest.approx(0.1) and {"dropout_1", "dropout_2"} <= set(node.inputs)
    draws = 2 * 4 * 64 * 64
    assert generator.offset == 1000 + 2 * draws, "each call draws past the last"
    for out, offset in ((first, 1000), (second, 1000 + draws)):
        seed_t, offset_t = out[6], out[7]
        assert seed_t.dtype == torch.long and seed_t.shape == () and int(seed_t) == -5 and int(offset_t) == offset
    buffers, _, _, uids = graphs[0].runs[1]
    canonical = fwd_specs(backend)[0].canonical_uids()
    assert buffers[-2] is second[6] and buffers[-1] is second[7]
    assert uids[-2:] == (canonical[5], canonical[6])
    forward(q, k, v, dropout=0.2)
    assert len(fwd_specs(backend)) == 2, "p is part of the key"


def test_a_dropout_backward_binds_the_forwards_seed_and_offset(route, generator, monkeypatch):
    backend, aten = route
    graphs = _runs(monkeypatch)
    q, k, v = qkv()
    out = forward(q, k, v, dropout=0.1)
    grads = sdpa._backward(torch.randn_like(q), q, k, v, out[0], out[1].squeeze(-1), out[6], out[7], None, None,
                           None, 64, 64, 0.1, True)
    assert aten == [] and len(grads) == 3 and sdpa.stats()["bwd"] == 1
    (node,) = backend.specs[1].nodes
    assert node.type == "SDPA_BWD" and node.params["dropout_0"] == pytest.approx(0.1)
    buffers, _, _, uids = graphs[1].runs[0]
    assert buffers[-2] is out[6] and buffers[-1] is out[7]
    canonical = backend.specs[1].canonical_uids()
    assert uids[-2:] == (canonical[5], canonical[6])


def test_dropout_under_capture_or_without_a_cudnn_seed_runs_torchs_kernel(route, generator, monkeypatch):
    _, aten = route
    q, k, v = qkv()
    monkeypatch.setattr(sdpa, "_capturing", lambda: True)
    assert forward(q, k, v, dropout=0.1) == "aten"  # a replay must draw anew: torch's generator does that
    monkeypatch.setattr(sdpa, "_capturing", lambda: False)
    o = torch.empty_like(q)
    sdpa._backward(o, q, k, v, o, torch.empty(2, 4, 64, 1), None, None, None, None, None, 64, 64, 0.1, True)
    assert [a[0] for a in aten] == ["fwd", "bwd"] and generator.offset == 1000
    assert sdpa.stats()["fwd_aten:dropout"] == 1 and sdpa.stats()["bwd_aten:dropout"] == 1


def test_a_configuration_fe_refuses_is_remembered_and_runs_torchs_kernel(route, monkeypatch):
    backend, aten = route
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise ValueError("cuDNN attention takes float16 or bfloat16, not torch.float32")

    monkeypatch.setattr(sdpa, "_forward_graph", refuse)
    q, k, v = qkv(dtype=torch.float32)
    assert forward(q, k, v) == "aten" and forward(q, k, v) == "aten"
    assert len(calls) == 1 and sdpa.stats()["fwd_aten:unsupported"] == 2


def test_a_float32_call_is_refused_by_the_graph_writer_with_a_clear_error():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        sdpa._fe_types(torch.float32)


def test_strict_mode_raises_plan_miss_instead_of_building(tmp_path, monkeypatch):
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[], mode="strict")
    monkeypatch.setattr(sdpa._Route, "handle", lambda self: "handle")
    sdpa.install(cache, cpp=False)
    try:
        with pytest.raises(PlanMiss):
            forward(*qkv())
    finally:
        sdpa.uninstall()


def test_tensors_of_another_device_run_torchs_kernel(route, monkeypatch):
    _, aten = route
    monkeypatch.setattr(sdpa._route, "device", torch.device("meta"))
    assert forward(*qkv()) == "aten" and sdpa.stats()["fwd_aten:device"] == 1


def test_install_replaces_the_two_kernels_and_uninstall_gives_them_back(tmp_path):
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    original = cudnn.pygraph.build_plans
    plancache.torch.install(cache, attention_cpp=False)
    try:
        assert sdpa.installed() and cudnn.pygraph.build_plans is not original  # route and hook
        for op in sdpa.OPS:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA")
    finally:
        plancache.torch.uninstall()
    assert not sdpa.installed() and sdpa.stats() == {} and cudnn.pygraph.build_plans is original


def test_the_route_can_be_left_off(tmp_path):
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    plancache.torch.install(cache, sdpa_route=False)
    try:
        assert not sdpa.installed()
    finally:
        plancache.torch.uninstall()


def test_a_graph_that_refuses_ordered_execution_is_bound_by_uid_from_then_on(route, monkeypatch):
    backend, _ = route
    calls: list[Any] = []

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        calls.append("ordered" if tensor_uids is not None else dict(buffers))
        if tensor_uids is not None:
            raise ValueError("The graph has no operand layout for ordered execution")

    monkeypatch.setattr(FakeGraph, "execute", execute)
    q, k, v = qkv()
    o = forward(q, k, v)[0]
    forward(q, k, v)
    canonical = backend.specs[0].canonical_uids()
    assert calls[0] == "ordered" and calls[1][canonical[1]].data_ptr() == q.data_ptr() and calls[1][canonical[100]] is o
    assert calls[2] != "ordered" and len(calls) == 3 and sdpa.stats()["unordered"] == 1


# ------------------------------------------------------------------ native kernels: measured or pinned


def _record(winner: float, **native: float) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(winner_median_ms=winner, native_median_ms=native)


@pytest.mark.parametrize(("choice", "record", "flash", "want"), [
    ("fastest", None, True, "plan"),  # a local build: nothing measured
    ("fastest", _record(1.0), True, "plan"),
    ("fastest", _record(1.0, cudnn_aten=0.9, flash=1.2), True, "cudnn_aten"),
    ("fastest", _record(1.0, cudnn_aten=0.99), True, "plan"),  # within the margin: the plan
    # torch's cuDNN: the same engines, and a build of its own in every process: a wider margin than flash's
    ("fastest", _record(1.0, cudnn_aten=0.97), True, "plan"),
    ("fastest", _record(1.0, cudnn_aten=0.94), True, "cudnn_aten"),
    ("fastest", _record(1.0, flash=0.97), True, "flash"),
    ("fastest", _record(1.0, flash=0.97, cudnn_aten=0.96), True, "flash"),  # aten's lead is within its margin
    ("fastest", _record(1.0, flash=0.5, cudnn_aten=0.9), True, "flash"),
    ("fastest", _record(1.0, flash=0.5, cudnn_aten=0.9), False, "cudnn_aten"),  # flash cannot run this call
    ("fastest", _record(1.0, mem_efficient=0.1), True, "plan"),  # a later release's kernel: never run here
    ("plan", _record(1.0, flash=0.5), True, "plan"),
    ("cudnn_aten", None, True, "cudnn_aten"),
    ("flash", None, True, "flash"),
    ("flash", None, False, "plan"),
])
def test_the_route_takes_the_fastest_measured_kernel_or_the_pinned_one(choice, record, flash, want):
    assert sdpa._pick(choice, record, flash) == want


@pytest.fixture
def natives(monkeypatch):
    """Calls of plancache.gpu.native's kernels, recorded instead of run."""
    from plancache.gpu import native

    calls: list[tuple[str, str]] = []

    def fwd(kernel, q, k, v, bias, is_causal, scale):
        calls.append(("fwd", kernel))
        return torch.empty_like(q), torch.empty(*q.shape[:3], 1)

    def bwd(kernel, d_o, q, k, v, out, lse, bias, is_causal, scale):
        calls.append(("bwd", kernel))
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    monkeypatch.setattr(native, "forward", fwd)
    monkeypatch.setattr(native, "backward", bwd)
    return calls


def _measured(monkeypatch, **native_ms):
    """Every plan the route's cache hands out (asked for alone or fetched together) carries a record in which the
    plan measured 1 ms and ``native_ms`` the native kernels."""
    cls = type(sdpa._route.cache)
    plan, prefetch = cls.plan, cls.prefetch

    def planned(self, spec, **kwargs):
        p = plan(self, spec, **kwargs)
        p.record = _record(1.0, **native_ms)
        return p

    def prefetched(self, specs):
        plans = prefetch(self, specs)
        for p in plans.values():
            p.record = _record(1.0, **native_ms)
        return plans

    monkeypatch.setattr(cls, "plan", planned)
    monkeypatch.setattr(cls, "prefetch", prefetched)


def test_a_plan_whose_record_measured_torchs_cudnn_faster_runs_torchs_cudnn(route, natives, monkeypatch):
    backend, aten = route
    _measured(monkeypatch, cudnn_aten=0.5)
    q, k, v = qkv()
    out = forward(q, k, v)
    forward(q, k, v)
    lse = out[1].squeeze(-1)
    sdpa._backward(torch.randn_like(q), q, k, v, out[0], lse, None, None, None, None, None, 64, 64, 0.0, True)
    assert natives == [("fwd", "cudnn_aten"), ("fwd", "cudnn_aten"), ("bwd", "cudnn_aten")] and aten == []
    stats = sdpa.stats()
    assert stats["fwd_native:cudnn_aten"] == 2 and stats["bwd_native:cudnn_aten"] == 1 and stats["fwd"] == 0
    assert len(backend.specs) == 2, "the plans were loaded: what they measured decided"


def test_a_pinned_native_kernel_loads_no_plan(tmp_path, natives, monkeypatch):
    backend = GraphBackend()
    cache = PlanCache("", backend=backend, cache_dir=tmp_path, trusted_keys=[], mode="strict")
    monkeypatch.setattr(sdpa._Route, "handle", lambda self: "handle")
    sdpa.install(cache, attention="flash", cpp=False)
    try:
        q, k, v = qkv()
        forward(q, k, v)  # strict mode, no server: only a pin can serve it
        assert natives == [("fwd", "flash")] and backend.specs == []
        with pytest.raises(PlanMiss):  # flash takes no bias: the pin falls back to the plan, which strict misses
            forward(q, k, v, torch.zeros(2, 1, 64, 64, dtype=torch.bfloat16))
    finally:
        sdpa.uninstall()


@pytest.mark.parametrize("choice", ["cudnn_aten", "flash", "fastest"])
def test_dropout_never_runs_a_native_kernel_without_it(route, natives, generator, choice, monkeypatch):
    backend, aten = route
    sdpa._route.choice = choice
    _measured(monkeypatch, cudnn_aten=0.5)  # a record measuring torch's cuDNN faster (of a graph without dropout)
    q, k, v = qkv()
    out = forward(q, k, v, dropout=0.1)
    assert natives == []
    if choice != "cudnn_aten":  # flash cannot run a dropout call (its own generator's draws): the plan does
        assert sdpa.stats()["fwd"] == 1 and len(fwd_specs(backend)) == 1, "the plan draws the dropout"
    else:
        assert out == "aten" and sdpa.stats()["fwd_aten:dropout"] == 1 and backend.specs == []


def test_a_deterministic_backward_never_takes_flash(route, natives, monkeypatch):
    backend, _ = route
    sdpa._route.choice = "flash"
    q, k, v = qkv()
    o, lse = forward(q, k, v)[:2]
    with deterministic():
        sdpa._backward(torch.randn_like(q), q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True)
    assert natives == [("fwd", "flash")] and sdpa.stats()["bwd"] == 1


def test_an_unknown_attention_choice_is_refused_before_anything_is_installed(tmp_path, monkeypatch):
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    with pytest.raises(ValueError, match="expected one of fastest, plan, flash, cudnn_aten"):
        sdpa.install(cache, attention="fast")
    monkeypatch.setenv("PLANCACHE_ATTENTION", "fast")
    with pytest.raises(Exception, match="attention"):
        plancache.torch.install(cache)
    assert not sdpa.installed()


def test_plancache_attention_setting_pins_the_route(tmp_path, monkeypatch):
    from typing import get_args

    from plancache.protocol import NATIVE_KERNELS
    from plancache.settings import ClientSettings

    assert get_args(ClientSettings.model_fields["attention"].annotation) == sdpa.CHOICES
    assert sdpa.NATIVE == NATIVE_KERNELS
    monkeypatch.setenv("PLANCACHE_ATTENTION", "cudnn_aten")
    cache = PlanCache("", backend=GraphBackend(), cache_dir=tmp_path, trusted_keys=[])
    plancache.torch.install(cache, attention_cpp=False)
    try:
        assert sdpa._route.choice == "cudnn_aten"
    finally:
        plancache.torch.uninstall()


def test_the_routes_own_builds_are_not_the_users_fe_builds_the_hook_counts(route, monkeypatch):
    """The route's graphs are written and built by plancache: the FE pipeline hook lets them through to FE, so
    they are neither served twice nor counted in stats().fe_builds (the GPU test saw {'miss': 2} for one call)."""
    from plancache.client import hook

    backend, _ = route
    inside: list[bool] = []
    original = GraphBackend.build_heuristic

    def build(self, spec, kernel_cache, *, graph=None):
        inside.append(getattr(hook._local, "inside", False))
        return original(self, spec, kernel_cache, graph=graph)

    monkeypatch.setattr(GraphBackend, "build_heuristic", build)
    forward(*qkv())
    assert inside == [True, True] and not getattr(hook._local, "inside", False)  # the forward and its backward


def test_a_training_forward_fetches_its_backwards_plan_with_its_own(route, monkeypatch):
    """A new shape's backward plan was asked for at the backward's first call: a second round trip to the server in
    the first step. A training forward (compute_log_sumexp) asks for both at once and prepares the backward, which
    then loads nothing; an inference forward asks for its own alone. Each plan fetched is counted once in the cache's
    hits (the GPU test saw {'heuristic': 2, 'memory': 2} when the route asked the cache again after fetching)."""
    backend, aten = route
    cache = sdpa._route.cache
    batches: list[list[str]] = []
    original = type(cache).prefetch

    def prefetch(self, specs):
        specs = list(specs)
        batches.append([spec.nodes[0].type for spec in specs])
        return original(self, specs)

    monkeypatch.setattr(type(cache), "prefetch", prefetch)
    graphs = _runs(monkeypatch)
    q, k, v = qkv()
    o, lse = forward(q, k, v)[:2]
    assert batches == [["SDPA", "SDPA_BWD"]] and sdpa.stats()["load:heuristic"] == 2
    assert cache.stats().hits == {"heuristic": 2}, "each plan counted once, where it came from (not again from memory)"
    grads = sdpa._backward(torch.randn_like(o), q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True)
    assert aten == [] and len(grads) == 3 and len(backend.specs) == 2 and sdpa.stats()["load:heuristic"] == 2
    assert sorted(len(g.runs) for g in graphs) == [1, 1], "the backward ran the plan its forward prepared"
    forward(*qkv(s=128), lse=False)  # inference: no backward to come
    assert len(batches) == 1 and [spec.nodes[0].type for spec in backend.specs[2:]] == ["SDPA"]


def test_a_backward_plan_missing_when_its_forward_is_served_is_raised_by_the_backward(route, monkeypatch):
    """Strict mode with the forward's plan and not the backward's: the forward runs (an inference-only caller never
    needs the other) and the backward's own first call raises PlanMiss."""
    _, _ = route
    cache = sdpa._route.cache
    original = type(cache).plan

    def plan(self, spec, **kwargs):
        if spec.nodes[0].type == "SDPA_BWD":
            raise PlanMiss("no backward plan")
        return original(self, spec, **kwargs)

    def prefetch(self, specs):
        raise PlanMiss("1 of 2 graphs have no verified tuned plan")

    monkeypatch.setattr(type(cache), "plan", plan)
    monkeypatch.setattr(type(cache), "prefetch", prefetch)
    q, k, v = qkv()
    o, lse = forward(q, k, v)[:2]
    assert sdpa.stats()["fwd"] == 1 and sdpa.stats()["load:heuristic"] == 1
    with pytest.raises(PlanMiss, match="no backward plan"):
        sdpa._backward(torch.randn_like(o), q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True)


def test_a_backward_under_another_deterministic_setting_prepares_its_own(route):
    backend, _ = route
    q, k, v = qkv()
    o, lse = forward(q, k, v)[:2]
    with deterministic():
        sdpa._backward(torch.randn_like(o), q, k, v, o, lse, None, None, None, None, None, 64, 64, 0.0, True)
    backwards = [spec.nodes[0] for spec in backend.specs if spec.nodes[0].type == "SDPA_BWD"]
    assert [bool(node.params.get("use_deterministic_algorithm")) for node in backwards] == [False, True]
