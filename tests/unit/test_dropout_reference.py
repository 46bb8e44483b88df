"""The float32 reference of attention with dropout (CPU): what cuDNN drops is read off a probe graph's dump
(:func:`plancache.gpu.runtime.draw_dropout`), checked against the probe's own output, and applied by the forward and
backward references; the backward's saved ``o`` is the dropped forward's."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

from plancache.errors import TuningError  # noqa: E402
from plancache.gpu import families, reference, runtime  # noqa: E402
from plancache.gpu.fegraph import decode  # noqa: E402
from plancache.spec import GraphSpec, from_pygraph  # noqa: E402

B, H, S, D, P, SCALE = 2, 4, 64, 32, 0.25, 0.125
LAYOUT = [H * S * D, S * D, D, 1]
VISIBLE = torch.ones(S, S, dtype=torch.bool).tril().expand(B, H, S, S)  # what a causal mask lets a query see


def _graph(backward: bool, *, causal: bool = True) -> GraphSpec:
    """An FE attention graph with dropout drawn from a seed and an offset, written as the route writes one."""
    io, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32)
    q, k, v = (g.tensor(name=n, dim=[B, H, S, D], stride=LAYOUT, data_type=io, uid=u) for n, u in (("q", 1), ("k", 2),
                                                                                                   ("v", 3)))
    seed, offset = (g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=u)
                    for n, u in (("seed", 5), ("offset", 6)))
    mask: dict[str, Any] = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT,
                            "diagonal_band_right_bound": 0} if causal else {}
    if not backward:
        o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=SCALE,
                          dropout=(P, seed, offset), **mask)
        o.set_uid(100).set_output(True).set_dim([B, H, S, D]).set_stride(LAYOUT).set_data_type(io)
        stats.set_uid(101).set_output(True).set_dim([B, H, S, 1]).set_stride([H * S, S, 1, 1]).set_data_type(f32)
    else:
        o = g.tensor(name="o", dim=[B, H, S, D], stride=LAYOUT, data_type=io, uid=100)
        d_o = g.tensor(name="dO", dim=[B, H, S, D], stride=LAYOUT, data_type=io, uid=200)
        stats = g.tensor(name="stats", dim=[B, H, S, 1], stride=[H * S, S, 1, 1], data_type=f32, uid=101)
        grads = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=d_o, stats=stats, attn_scale=SCALE,
                                dropout=(P, seed, offset), use_deterministic_algorithm=True, **mask)
        for grad, uid in zip(grads, (201, 202, 203)):
            grad.set_uid(uid).set_output(True).set_dim([B, H, S, D]).set_stride(LAYOUT).set_data_type(io)
    return from_pygraph(g, name="attention with dropout")


def _kept(seed: int = 0) -> Any:
    return torch.rand(B, H, S, S, generator=torch.Generator().manual_seed(seed)) >= P


def _by_hand(inputs: dict[int, Any], kept: Any) -> tuple[Any, Any, Any]:
    """Attention with these dropped elements, from q, k, v by torch alone: (O, Stats, the three gradients of dO)."""
    q, k, v = (inputs[u].float().requires_grad_() for u in (1, 2, 3))
    s = (q @ k.transpose(-1, -2)) * SCALE
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = (p * kept.float() / (1 - P)) @ v
    grads = torch.autograd.grad(o, (q, k, v), inputs[200].float()) if 200 in inputs else None
    return o.detach(), torch.logsumexp(s, dim=-1, keepdim=True).detach(), grads


def test_only_dropout_drawn_from_a_seed_and_an_offset_is_covered():
    spec = _graph(False)
    assert families.dropout_nodes(spec) == [0] and families.dropout_probability(spec.nodes[0]) == P
    assert families.uncovered(spec) == []
    probe = families.dropout_probe(spec, 0)
    assert families.uncovered(probe.spec) and "dropout" in families.uncovered(probe.spec)[0], "a dumped dropout"


@pytest.mark.parametrize("backward", [False, True])
def test_a_nodes_probe_is_a_forward_on_its_own_inputs_that_dumps_its_dropout(backward):
    spec = _graph(backward)
    probe = families.dropout_probe(spec, 0)
    (node,) = probe.spec.nodes
    assert node.type == "SDPA" and node.inputs == {"q": 1, "k": 2, "v": 3, "dropout_1": 5, "dropout_2": 6}
    assert set(node.outputs) == {"O", "Stats", "rng_dump"} and probe.p == P
    assert probe.spec.tensor(probe.dump_uid).dim == [B, H, S, S]
    assert "use_deterministic_algorithm" not in node.params and node.params["generate_stats"] is True
    assert node.params["diagonal_band_right_bound"] == 0, "the node's own masks"
    assert set(probe.checked.nodes[0].outputs) == {"O", "Stats"}
    assert {t.uid for t in probe.checked.input_tensors()} == {1, 2, 3, 5, 6}
    decode(probe.spec)  # FE writes the probe (no handle: nothing is built)


def test_the_forward_reference_drops_what_it_is_given_and_keeps_the_undropped_statistics():
    spec = _graph(False)
    inputs = reference.make_inputs(spec, "cpu", seed=3)
    kept = _kept()
    got = reference.reference_outputs(spec, inputs, dropout={0: kept.float() / (1 - P)})
    o, lse, _ = _by_hand(inputs, kept)
    torch.testing.assert_close(got[100], o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[101], lse, atol=1e-5, rtol=1e-5)
    undropped = reference.reference_outputs(spec, inputs, dropout={0: torch.ones(B, H, S, S)})
    assert (got[100] - undropped[100]).abs().max() > 1e-2, "the dropout changed O"


def test_the_backward_reference_is_the_gradient_of_the_dropped_forward_and_its_saved_o_matches_it():
    spec = _graph(True)
    inputs = reference.make_inputs(spec, "cpu", seed=4)
    kept = _kept(1)
    multiplier = kept.float() / (1 - P)
    before = inputs[100].clone()
    reference.redraw_saved_attention(spec, inputs, {0: multiplier})
    o, lse, grads = _by_hand(inputs, kept)
    assert not torch.equal(before, inputs[100])
    torch.testing.assert_close(inputs[100].float(), o, atol=2e-2, rtol=2e-2)  # stored in bf16
    torch.testing.assert_close(inputs[101], lse, atol=1e-5, rtol=1e-5)
    got = reference.reference_outputs(spec, inputs, dropout={0: multiplier})
    for uid, want in zip((201, 202, 203), grads):
        torch.testing.assert_close(got[uid], want, atol=1e-4, rtol=1e-4)


def test_a_dropout_node_without_what_cudnn_drops_cannot_be_evaluated():
    spec = _graph(False)
    inputs = reference.make_inputs(spec, "cpu", seed=5)
    with pytest.raises(TuningError, match="its dropout needs the elements cuDNN drops"):
        reference.reference_outputs(spec, inputs)
    with pytest.raises(TuningError, match="its dropout needs"):
        reference.evaluate(spec, inputs, exact_float32=False)  # never torch's fused kernel, which draws its own


def _probe_run(spec: GraphSpec, kept: Any, dump: Any, *, drop_in_output: Any = None) -> tuple[Any, dict, dict]:
    """A probe of ``spec`` and what cuDNN would give running it: O and Stats of ``drop_in_output`` (else ``kept``),
    in bf16 / float32, and ``dump`` as its rng_dump."""
    probe = families.dropout_probe(spec, 0)
    inputs = reference.make_inputs(spec, "cpu", seed=6)
    bound = {t.uid: inputs[t.uid] for t in probe.spec.input_tensors()}
    used = kept if drop_in_output is None else drop_in_output
    ref = reference.reference_outputs(probe.checked, bound, dropout={0: used.float() / (1 - P)})
    o_uid, stats_uid = probe.checked.nodes[0].outputs["O"], probe.checked.nodes[0].outputs["Stats"]
    got = {o_uid: ref[o_uid].to(torch.bfloat16), stats_uid: ref[stats_uid], probe.dump_uid: dump}
    return probe, bound, got


@pytest.mark.parametrize("form", ["mask", "scaled", "draws_at_least_p", "draws_below_one_minus_p"])
def test_each_form_of_cudnns_dump_reads_as_the_elements_it_kept(form):
    spec = _graph(False)
    draws = torch.rand(B, H, S, S, generator=torch.Generator().manual_seed(7))
    kept = {"draws_below_one_minus_p": draws < 1 - P}.get(form, draws >= P)
    dump = {"mask": kept.float(), "scaled": kept.float() / (1 - P)}.get(form, draws)
    probe, bound, got = _probe_run(spec, kept, dump)
    multiplier = runtime._read_dropout(probe, bound, got, "node 0")
    assert torch.equal(multiplier, torch.where(VISIBLE, kept.float() / (1 - P), 1 / (1 - P)))


def test_the_elements_a_mask_hides_are_not_read_as_cudnn_leaves_them_unwritten():
    """Measured on an H100: a causal probe's dump holds NaN and garbage where cuDNN skipped a masked tile."""
    spec = _graph(False)
    kept = _kept(13)
    dump = kept.float().masked_fill(~VISIBLE, float("nan"))
    dump[..., 0, -1] = 7.0  # hidden too: no form has it
    probe, bound, got = _probe_run(spec, kept, dump)
    multiplier = runtime._read_dropout(probe, bound, got, "node 0")
    assert torch.isfinite(multiplier).all()
    assert torch.equal(multiplier[VISIBLE], kept[VISIBLE].float() / (1 - P))


def test_a_dump_that_disagrees_with_the_probes_own_output_is_refused():
    spec = _graph(False)
    kept = _kept(8)
    probe, bound, got = _probe_run(spec, kept, _kept(9).float())  # the dump is of other elements than O used
    with pytest.raises(TuningError, match="no reading of cuDNN's dropout dump agrees with its own output"):
        runtime._read_dropout(probe, bound, got, "node 0")


def test_a_dropout_that_drops_too_many_elements_is_refused():
    spec = _graph(False)
    kept = torch.rand(B, H, S, S, generator=torch.Generator().manual_seed(10)) >= 0.5  # half, not P
    probe, bound, got = _probe_run(spec, kept, kept.float())
    with pytest.raises(TuningError, match=r"drops 0\.4\d+ of \d+ visible elements, not p = 0.25"):
        runtime._read_dropout(probe, bound, got, "node 0")


def test_draw_dropout_runs_each_nodes_probe_and_bounds_its_dump(monkeypatch):
    spec = _graph(True)
    inputs = reference.make_inputs(spec, "cpu", seed=11)
    kept = _kept(12)
    ran: list[GraphSpec] = []

    def execute(plan: Any, handle: Any, device: Any, bound: dict) -> dict:
        ran.append(plan)
        probe = families.dropout_probe(spec, 0)
        assert set(bound) == {t.uid for t in probe.spec.input_tensors()}, "the probe's inputs, the node's own"
        ref = reference.reference_outputs(probe.checked, bound, dropout={0: kept.float() / (1 - P)})
        return {**{u: t.to(torch.bfloat16) if u == probe.checked.nodes[0].outputs["O"] else t for u, t in ref.items()},
                probe.dump_uid: kept.float()}

    monkeypatch.setattr(runtime, "_plain_plan", lambda spec, handle: ("plan", "fallback"))
    monkeypatch.setattr(runtime, "_execute", execute)
    drawn = runtime.draw_dropout(spec, inputs, None, torch.device("cpu"))
    assert list(drawn) == [0] and torch.equal(drawn[0][VISIBLE], kept[VISIBLE].float() / (1 - P)) and len(ran) == 1
    monkeypatch.setattr(runtime, "DROPOUT_DUMP_BYTES", B * H * S * S * 4 - 1)
    with pytest.raises(TuningError, match="its dropout cannot be checked: the dump of"):
        runtime.draw_dropout(spec, inputs, None, torch.device("cpu"))
    monkeypatch.setattr(runtime, "DROPOUT_DUMP_BYTES", 1 << 30)
    monkeypatch.setattr(runtime, "_plain_plan", lambda spec, handle: None)
    with pytest.raises(TuningError, match="no FALLBACK or heuristic plan of its dropout probe builds"):
        runtime.draw_dropout(spec, inputs, None, torch.device("cpu"))
    assert math.isclose(families.dropout_probability(spec.nodes[0]) or 0, P)


def test_a_dropout_graphs_expected_outputs_are_the_float32_reference_of_the_drawn_elements(monkeypatch):
    spec = runtime.canonical(_graph(True))
    inputs = reference.make_inputs(spec, "cpu", seed=13)
    multiplier = _kept(14).float() / (1 - P)
    monkeypatch.setattr(runtime, "draw_dropout", lambda spec, inputs, handle, device: {0: multiplier})
    before = {u: t.clone() for u, t in inputs.items()}
    expected, check = runtime.expected_outputs(spec, inputs, None, torch.device("cpu"))
    assert check == "reference"
    saved_o = spec.nodes[0].inputs["o"]
    assert not torch.equal(before[saved_o], inputs[saved_o]), "the saved o is the dropped forward's"
    want = reference.reference_outputs(spec, inputs, dropout={0: multiplier})
    assert expected.keys() == want.keys() and all(torch.equal(expected[u], want[u]) for u in want)


def test_a_plan_is_run_on_the_inputs_its_expected_outputs_were_computed_from(monkeypatch):
    """A dropout backward's saved o is rewritten while its expected outputs are worked out: the plan runs after."""
    spec = runtime.canonical(_graph(True))
    order: list[str] = []
    monkeypatch.setattr(runtime, "expected_outputs", lambda *a: order.append("expected") or ({}, "reference"))
    monkeypatch.setattr(runtime, "_execute", lambda *a: order.append("execute") or {})
    monkeypatch.setattr(reference, "compare_outputs", lambda *a, **k: 0.0)
    plan = runtime.BuiltPlan(spec, None, 0)
    assert runtime.run_and_check(plan, None, torch.device("cpu"), seed=1) == (0.0, "reference")
    assert order == ["expected", "execute"]
