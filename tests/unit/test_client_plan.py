"""``Plan.execute`` on the CPU with a recording backend: tensors checked by name before any launch, the
workspace allocated once per stream, the handle's stream set only when it changes."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")

from plancache.client.plan import Plan  # noqa: E402
from plancache.spec import SpecBuilder, channels_last_strides  # noqa: E402
from tests.client_fakes import FakeBuiltPlan, FakeStream, RecordingBackend  # noqa: E402


def matmul_spec():
    b = SpecBuilder(io_data_type="bfloat16", name="tiny_matmul")
    a = b.tensor("A", dim=[2, 8, 16])
    w = b.tensor("B", dim=[2, 16, 4])
    alpha = b.tensor("alpha", dim=[1, 1, 1], data_type="float32", is_pass_by_value=True)
    bias = b.tensor("bias", dim=[1, 1, 4])
    b.relu(b.bias(b.scale(b.matmul(a, w), alpha), bias)).set_output(True).set_name("Y")
    return b.build()


def conv_spec():
    b = SpecBuilder(io_data_type="bfloat16", name="tiny_conv")
    x = b.tensor("X", dim=[2, 8, 6, 6], stride=channels_last_strides([2, 8, 6, 6]))
    w = b.tensor("W", dim=[4, 8, 3, 3], stride=channels_last_strides([4, 8, 3, 3]))
    b.relu(b.conv_fprop(x, w, padding=[1, 1])).set_output(True).set_name("Y").set_stride(channels_last_strides([2, 4, 6, 6]))
    return b.build()


def make_plan(spec, workspace_size: int = 4096):
    backend = RecordingBackend()
    built = FakeBuiltPlan(spec, "test", workspace_size=workspace_size)
    return Plan(spec, spec.graph_key, built, backend, source="server", lock=threading.Lock()), built, backend


def matmul_tensors():
    bf = torch.bfloat16
    return dict(A=torch.randn(2, 8, 16).to(bf), B=torch.randn(2, 16, 4).to(bf), alpha=0.5,
                bias=torch.randn(1, 1, 4).to(bf), Y=torch.empty(2, 8, 4, dtype=bf))


def test_execute_passes_checked_tensors_workspace_and_handle():
    plan, built, backend = make_plan(matmul_spec())
    t = matmul_tensors()
    plan.execute(**t)
    (pack, ws, handle), = built.executions
    uid = plan.spec.canonical_document().io_names()
    assert set(uid) == {"A", "B", "alpha", "bias", "Y"}
    assert set(pack) == set(uid.values())  # the graph executes by canonical uid
    pack = {name: pack[u] for name, u in uid.items()}
    assert pack["A"] is t["A"] and pack["Y"] is t["Y"]
    assert pack["alpha"].dtype == torch.float32 and pack["alpha"].device.type == "cpu" and pack["alpha"].item() == 0.5
    assert ws.dtype == torch.uint8 and ws.numel() >= 4096 and handle is backend.handle
    assert backend.streams_set == [backend.stream]


def test_workspace_is_allocated_once_per_stream_and_the_stream_set_only_when_it_changes():
    plan, built, backend = make_plan(matmul_spec())
    t = matmul_tensors()
    for _ in range(3):
        plan.execute(**t)
    other = FakeStream(9)
    plan.execute(**t, stream=other)
    plan.execute(**t)
    workspaces = [ws for _, ws, _ in built.executions]
    assert workspaces[0] is workspaces[1] is workspaces[2] is workspaces[4]
    assert workspaces[3] is not workspaces[0]
    assert backend.streams_set == [backend.stream, other, backend.stream]
    # Each allocated on the stream it runs on (allocated on the current stream, a workspace used on another could be
    # handed to the current stream's next allocation while the other stream still ran on it).
    assert backend.workspaces == [(4096, backend.stream), (4096, other)]


def test_a_callers_workspace_is_used_and_checked():
    plan, built, _ = make_plan(matmul_spec())
    t = matmul_tensors()
    mine = torch.empty(1024, dtype=torch.float32)  # 4096 bytes
    plan.execute(**t, workspace=mine)
    assert built.executions[-1][1] is mine
    with pytest.raises(ValueError, match="workspace has 4095 bytes, the plan needs 4096"):
        plan.execute(**t, workspace=torch.empty(4095, dtype=torch.uint8))
    with pytest.raises(TypeError, match="workspace"):
        plan.execute(**t, workspace=bytearray(4096))


def test_tensors_may_come_in_a_mapping_for_names_that_are_not_identifiers():
    plan, built, _ = make_plan(matmul_spec())
    t = matmul_tensors()
    y = t.pop("Y")
    plan.execute(t, Y=y)
    uid = plan.spec.canonical_document().io_names()
    assert built.executions[-1][0][uid["Y"]] is y
    with pytest.raises(ValueError, match="'Y' is given twice"):
        plan.execute({**t, "Y": y}, Y=y)
    by_uid = {uid[name]: value for name, value in {**t, "Y": y}.items()}  # unnamed tensors go by uid
    plan.execute(by_uid)
    assert built.executions[-1][0][uid["Y"]] is y


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("B"), "missing input tensor 'B'"),
    (lambda t: t.pop("Y"), "missing output tensor 'Y'"),
    (lambda t: t.update(Z=torch.empty(1)), "unknown tensor 'Z'"),
    (lambda t: t.update(A=t["A"].float()), r"input tensor 'A': dtype torch.float32, the plan needs torch.bfloat16"),
    (lambda t: t.update(Y=torch.empty(2, 8, 5, dtype=torch.bfloat16)),
     r"output tensor 'Y': shape \(2, 8, 5\), the plan needs \(2, 8, 4\)"),
    (lambda t: t.update(A=t["A"].transpose(1, 2).contiguous().transpose(1, 2)), r"input tensor 'A': strides \(128, 1, 8\)"),
    (lambda t: t.update(A=torch.empty(2, 8, 16, dtype=torch.bfloat16, device="meta")),
     "input tensor 'A' is on meta, the plan runs on cpu"),
    (lambda t: t.update(A=torch.empty(2 * 8 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 8, 16)),
     "'A': data pointer is not 16-byte aligned"),
    (lambda t: t.update(B=[[1.0]]), "input tensor 'B' must be a torch.Tensor, not list"),
    (lambda t: t.update(alpha=True), "'alpha' is a pass-by-value scalar: give a float"),
    (lambda t: t.update(alpha=torch.tensor([0.5], dtype=torch.float64)),
     "'alpha' is a pass-by-value scalar: it must be a one-element torch.float32 CPU tensor"),
    (lambda t: t.update(alpha=torch.ones(2)), "one-element torch.float32 CPU tensor"),
])
def test_a_bad_tensor_is_refused_by_name_before_launch(change, message):
    plan, built, _ = make_plan(matmul_spec())
    t = matmul_tensors()
    change(t)
    with pytest.raises((ValueError, TypeError), match=message):
        plan.execute(**t)
    assert built.executions == []


def test_a_scalar_may_be_a_one_element_cpu_tensor():
    plan, built, _ = make_plan(matmul_spec())
    t = matmul_tensors()
    alpha = torch.full((1, 1, 1), 2.0)
    plan.execute(**{**t, "alpha": alpha})
    assert built.executions[-1][0][plan.spec.canonical_document().io_names()["alpha"]] is alpha


def test_layouts_are_checked_but_strides_of_unit_dims_do_not_matter():
    plan, built, _ = make_plan(conv_spec())
    bf = torch.bfloat16
    x = torch.randn(2, 8, 6, 6).to(bf).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 8, 3, 3).to(bf).contiguous(memory_format=torch.channels_last)
    y = torch.empty(2, 4, 6, 6, dtype=bf).contiguous(memory_format=torch.channels_last)
    plan.execute(X=x, W=w, Y=y)
    with pytest.raises(ValueError,
                       match=r"input tensor 'X': strides \(288, 36, 6, 1\), the plan was built for \(288, 1, 48, 8\)"):
        plan.execute(X=x.contiguous(), W=w, Y=y)
    # Bias-like tensors: a size-1 dim's stride is never used to address memory.
    b = SpecBuilder(io_data_type="bfloat16")
    a = b.tensor("A", dim=[1, 4, 8])
    bias = b.tensor("bias", dim=[1, 1, 8])
    b.bias(a, bias).set_output(True).set_name("Y")
    plan2, built2, _ = make_plan(b.build())
    plan2.execute(A=torch.randn(1, 4, 8).to(bf), bias=torch.randn(8).to(bf).view(1, 1, 8).as_strided((1, 1, 8), (0, 0, 1)),
                  Y=torch.empty(1, 4, 8, dtype=bf))
    assert len(built2.executions) == 1


def test_describes_itself():
    plan, _, _ = make_plan(matmul_spec())
    assert plan.tensor_names() == ["A", "B", "alpha", "bias", "Y"]
    assert plan.workspace_size == 4096 and plan.source == "server"
    assert "tiny_matmul" in repr(plan)


def test_a_cache_without_the_gpu_extra_names_it(monkeypatch, tmp_path):
    import sys

    from plancache.client import PlanCache
    from plancache.errors import GpuUnavailable

    monkeypatch.setitem(sys.modules, "cudnn", None)  # as on the base install: ``import cudnn`` fails
    with pytest.raises(GpuUnavailable, match=r"pip install 'plancache\[gpu\]'"):
        PlanCache("", cache_dir=tmp_path)


def test_a_spec_of_the_same_graph_with_other_names_gets_the_loaded_plan_with_its_own_names(tmp_path):
    """Names are not part of the graph key, so two specs of one graph share the loaded plan; each caller's names bind
    as its own spec says. (The plan memoized for the first spec was returned to the second, which then bound ``X``
    to the first spec's ``X``: with the inputs' names swapped, a silent ``W @ X`` for ``X @ W``.)"""
    from plancache.client import PlanCache
    from plancache.spec import parse_spec

    b = SpecBuilder(io_data_type="float32")
    b.matmul(b.tensor("X", dim=[1, 4, 4]), b.tensor("W", dim=[1, 4, 4])).set_output(True).set_name("Y")
    first = b.build()  # Y = X @ W
    doc = first.to_json()
    for t in doc["tensors"]:
        t["name"] = {"X": "W", "W": "X"}.get(t["name"], t["name"])
    second = parse_spec(doc)  # the same graph, its inputs named the other way round: Y = W @ X
    assert second.graph_key == first.graph_key
    port_a = first.canonical_document().nodes[0].inputs["A"]
    x, w, y = torch.full((1, 4, 4), 1.0), torch.full((1, 4, 4), 2.0), torch.empty(1, 4, 4)
    with PlanCache("", backend=RecordingBackend(), cache_dir=tmp_path) as cache:
        one = cache.plan(first)
        two = cache.plan(second)
        assert two is not one and two._built is one._built and two.spec is second  # loaded once, named twice
        assert cache.plan(first) is one and cache.prefetch([second])[second.graph_key]._built is one._built
        two.execute(X=x, W=w, Y=y)
        assert one._built.executions[-1][0][port_a] is w  # the second spec's matmul takes its W first
        one.execute(X=x, W=w, Y=y)
        assert one._built.executions[-1][0][port_a] is x
        assert cache.stats().misses == 1 and len(cache._backend.calls) == 1


def inferred_output_matmul():
    """A ``[1, 256, 64] @ [1, 64, 128]`` matmul whose output ``Y`` carries no dims or strides, as a graph captured
    before FE inferred them (``PlanCache.build(graph)``, the hook) holds it."""
    from plancache.spec import parse_spec

    b = SpecBuilder(io_data_type="bfloat16", name="inferred_matmul")
    b.matmul(b.tensor("X", dim=[1, 256, 64]), b.tensor("W", dim=[1, 64, 128])).set_output(True).set_name("Y")
    doc = b.build().to_json()
    for t in doc["tensors"]:
        if t["name"] == "Y":
            t.update(dim=[], stride=[], dim_assigned=False, stride_assigned=False)
    return parse_spec(doc)


def test_an_output_whose_layout_fe_inferred_is_checked_against_the_loaded_plan():
    """The issue's reproduction: a one-element ``Y`` was accepted for a ``[1, 256, 128]`` matmul (cuDNN would write
    64 KiB into a 2-byte buffer). The output's layout comes from the loaded plan's graph."""
    spec = inferred_output_matmul()
    uid = spec.canonical_document().io_names()
    real = {uid["Y"]: ((1, 256, 128), (256 * 128, 128, 1))}
    built = FakeBuiltPlan(spec.canonical_document(), "test", real_layouts=real)
    plan = Plan(spec, spec.graph_key, built, RecordingBackend(), source="server", lock=threading.Lock())
    bf = torch.bfloat16
    x, w = torch.randn(1, 256, 64).to(bf), torch.randn(1, 64, 128).to(bf)
    with pytest.raises(ValueError, match=r"output tensor 'Y': shape \(1,\), the plan needs \(1, 256, 128\)"):
        plan.execute(X=x, W=w, Y=torch.empty(1, dtype=bf))
    with pytest.raises(ValueError, match=r"'Y': strides \(32768, 1, 256\), the plan was built for \(32768, 128, 1\)"):
        plan.execute(X=x, W=w, Y=torch.empty(1, 128, 256, dtype=bf).transpose(1, 2))
    with pytest.raises(ValueError, match=r"output tensor 'Y': shape \(2, 256, 128\), the plan needs"):
        plan.capture(X=x, W=w, Y=torch.empty(2, 256, 128, dtype=bf))
    assert built.executions == []
    plan.execute(X=x, W=w, Y=torch.empty(1, 256, 128, dtype=bf))
    assert len(built.executions) == 1


def test_an_output_whose_layout_the_loaded_plan_cannot_tell_is_refused_by_name():
    spec = inferred_output_matmul()
    built = FakeBuiltPlan(spec.canonical_document(), "test", real_layouts={})
    plan = Plan(spec, spec.graph_key, built, RecordingBackend(), source="server", lock=threading.Lock())
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="output tensor 'Y': the loaded plan does not tell its dims and strides"):
        plan.execute(X=torch.randn(1, 256, 64).to(bf), W=torch.randn(1, 64, 128).to(bf),
                     Y=torch.empty(1, 256, 128, dtype=bf))
    assert built.executions == []
    assert plan.tensor_names() == ["W", "X", "Y"]
