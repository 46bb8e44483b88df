"""Capture and pre-tune, on the CPU: the hook counts every graph a program builds into a capture file (processes
merging into one file), ``plancache capture`` does it for a program that never heard of plancache, and
``vary`` rewrites a captured graph at another shape exactly as the graph's own code builds it (checked against
FE's pygraph built at that shape, read back by ``from_pygraph``, and against SpecBuilder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

from plancache.client import hook  # noqa: E402
from plancache.client.capture import Recorder, parse_capture  # noqa: E402
from plancache.errors import SpecError  # noqa: E402
from plancache.spec import SpecBuilder, from_pygraph  # noqa: E402
from plancache.spec.axes import axes_of, vary  # noqa: E402
from tests.factories import new_signer  # noqa: E402
from tests.unit.test_hook import StageGraph, make_cache, rmsnorm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "fe"))
import graphs  # noqa: E402

BF16 = cudnn.data_type.BFLOAT16


def captured(path: Path) -> dict[str, int]:
    return {spec.graph_key: n for spec, n in parse_capture(json.loads(path.read_text()))}


# ------------------------------------------------------------------------------------------------ vary


@pytest.mark.parametrize("example", ["sdpa_fwd_train", "sdpa_bwd"])
@pytest.mark.parametrize("sizes", [{"s": 1}, {"s": 128}, {"s": 1000}, {"s": 4096}, {"b": 1}, {"b": 7},
                                   {"b": 3, "s": 77}])
def test_varied_keys_are_the_keys_of_the_graph_built_at_that_shape(example, sizes):
    base = from_pygraph(graphs.EXAMPLES[example]()[0])           # captured at b=2, s=512
    reference = from_pygraph(graphs.EXAMPLES[example](**sizes)[0])
    assert vary(base, sizes).graph_key == reference.graph_key
    assert vary(base, sizes).graph_key != base.graph_key


def test_varying_from_a_size_of_one_recomputes_the_outer_strides():
    """At s=1 (decode) and b=1 the strides of the outer dims equal inner ones: the layout still comes back."""
    for start, sizes in (({"s": 1}, {"s": 256}), ({"b": 1}, {"b": 5})):
        base = from_pygraph(graphs.sdpa_fwd_train(**start)[0])
        assert vary(base, sizes).graph_key == from_pygraph(graphs.sdpa_fwd_train(**sizes)[0]).graph_key


def cross_attention(s_q: int, s_kv: int, b: int = 2, h: int = 4, d: int = 64):
    """Cross-attention in BSHD layout as FE's own ops lay it out: q and O at s_q, k and v at s_kv."""
    g = cudnn.pygraph(io_data_type=BF16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    q = g.tensor(name="q", dim=[b, h, s_q, d], stride=graphs.bshd_strides(b, h, s_q, d), data_type=BF16)
    k = g.tensor(name="k", dim=[b, h, s_kv, d], stride=graphs.bshd_strides(b, h, s_kv, d), data_type=BF16)
    v = g.tensor(name="v", dim=[b, h, s_kv, d], stride=graphs.bshd_strides(b, h, s_kv, d), data_type=BF16)
    o, stats = g.sdpa(name="xattn", q=q, k=k, v=v, generate_stats=True, attn_scale=0.125)
    o.set_output(True).set_dim([b, h, s_q, d]).set_stride(graphs.bshd_strides(b, h, s_q, d)).set_data_type(BF16)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    return g


def test_s_q_and_s_kv_move_their_own_tensors():
    base = from_pygraph(cross_attention(100, 300))
    for sizes, (s_q, s_kv) in (({"s_q": 1}, (1, 300)), ({"s_kv": 4096}, (100, 4096)),
                               ({"s_q": 7, "s_kv": 9}, (7, 9)), ({"s": 64}, (64, 64))):
        assert vary(base, sizes).graph_key == from_pygraph(cross_attention(s_q, s_kv)).graph_key, sizes


def specbuilder_sdpa(s_q: int, s_kv: int):
    b = SpecBuilder(io_data_type="bfloat16", name="sdpa")
    q = b.tensor("Q", dim=[2, 8, s_q, 64])
    k = b.tensor("K", dim=[2, 8, s_kv, 64])
    v = b.tensor("V", dim=[2, 8, s_kv, 64])
    b.sdpa(q, k, v, causal=True).set_output(True).set_name("O")
    return b.build()


def test_varied_specbuilder_graphs_are_the_ones_specbuilder_builds():
    base = specbuilder_sdpa(256, 256)
    for s_q, s_kv in ((1, 256), (256, 1024), (8192, 8192)):
        assert vary(base, {"s_q": s_q, "s_kv": s_kv}).graph_key == specbuilder_sdpa(s_q, s_kv).graph_key


def test_graphs_vary_cannot_move_consistently_are_refused():
    matmul = from_pygraph(graphs.mlp_matmul()[0])
    assert axes_of(matmul) == []
    with pytest.raises(SpecError, match="has no axis s"):
        vary(matmul, {"s": 128})
    decode = from_pygraph(graphs.EXAMPLES["paged_decode"]()[0])  # page tables and sequence lengths would move too
    assert "s_kv" in axes_of(decode)
    with pytest.raises(SpecError, match="would have to move"):
        vary(decode, {"s_kv": 128})
    with pytest.raises(SpecError, match="positive integer"):
        vary(from_pygraph(graphs.sdpa_fwd_train()[0]), {"s": 0})


# ------------------------------------------------------------------------------------------------ capture file


def test_processes_capturing_into_one_file_add_their_counts(tmp_path):
    path = tmp_path / "graphs.json"
    a, b = (from_pygraph(graphs.sdpa_fwd_train(s=s)[0]) for s in (128, 256))
    one, two = Recorder(path), Recorder(path)
    one.add(a)
    one.add(a)                       # a known key is counted, written at flush
    two.add(a)
    two.add(b)
    assert captured(path) == {a.graph_key: 2, b.graph_key: 1}
    one.flush()
    two.flush()
    assert captured(path) == {a.graph_key: 3, b.graph_key: 1}
    doc = json.loads(path.read_text())
    assert doc["graphs"][0]["name"] == "sdpa_fwd_train" and doc["graphs"][0]["count"] == 3  # most built first
    doc["graphs"][0]["spec"]["tensors"][0]["dim"][2] = 64          # edited: the key no longer matches
    with pytest.raises(SpecError, match="graphs\\[0\\]: its spec's graph key"):
        parse_capture(doc)
    with pytest.raises(SpecError, match="not a valid capture file"):
        parse_capture({"format": "plancache-capture", "version": 2, "graphs": []})


def test_the_hook_counts_every_graph_built_and_serves_as_before(tmp_path, monkeypatch):
    path = tmp_path / "graphs.json"
    monkeypatch.setenv("PLANCACHE_CAPTURE", str(path))            # what plancache.torch.install() honours too
    cache = make_cache(tmp_path, new_signer(), seeded=False)
    with hook.installed(cache, graph_class=StageGraph):
        for uid in (1, 1, 5):
            g, _ = rmsnorm(uid_x=uid)
            g.build([cudnn.heur_mode.A])
            g.validate()                                             # validated twice: still one build
    assert cache.stats().fe_builds == {"miss": 3}
    assert captured(path) == {from_pygraph(rmsnorm(1)[0]).graph_key: 2, from_pygraph(rmsnorm(5)[0]).graph_key: 1}


def test_capture_only_leaves_every_build_to_fe(tmp_path):
    path = tmp_path / "graphs.json"
    hook.install(None, graph_class=StageGraph, capture=path)
    try:
        g, _ = rmsnorm()
        g.build([cudnn.heur_mode.A])
    finally:
        hook.uninstall()
    assert [s[0] for s in g.stages] == ["validate", "build_operation_graph", "create_execution_plans",
                                        "check_support", "build_plans"]
    assert captured(path) == {from_pygraph(rmsnorm()[0]).graph_key: 1}


def test_plancache_capture_runs_a_program_that_never_imports_plancache(tmp_path):
    """The program builds FE graphs (real cudnn.pygraph, on the CPU) at three sequence lengths, one twice; its own
    sitecustomize still runs; no server is asked even when one is configured."""
    program = tmp_path / "app.py"
    program.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'examples' / 'fe')!r})\n"
        "import graphs\n"
        "for s in (128, 256, 128, 512):\n"
        "    g, _ = graphs.sdpa_fwd_train(s=s)\n"
        "    try:\n"
        "        g.validate()\n"
        "    except Exception:\n"
        "        pass  # no GPU: FE's backend may refuse, the spec was read before\n"
        "print('user site', os.environ.get('USER_SITE_RAN'), 'server', os.environ.get('PLANCACHE_SERVER_URL'))\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = 'yes'\n")
    out = tmp_path / "graphs.json"
    env = {**os.environ, "PYTHONPATH": str(site), "PLANCACHE_SERVER_URL": "http://127.0.0.1:9"}
    run = subprocess.run([sys.executable, "-m", "plancache", "capture", "--out", str(out), "--", sys.executable,
                          str(program)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "user site yes server None" in run.stdout
    assert "captured 3 graphs (4 builds)" in run.stderr
    expected = {from_pygraph(graphs.sdpa_fwd_train(s=s)[0]).graph_key: n for s, n in ((128, 2), (256, 1), (512, 1))}
    assert captured(out) == expected


def test_plancache_capture_exits_with_the_programs_code(tmp_path):
    run = subprocess.run([sys.executable, "-m", "plancache", "capture", "--out", str(tmp_path / "g.json"), "--",
                          sys.executable, "-c", "raise SystemExit(3)"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3 and "captured no graph" in run.stderr
    run = subprocess.run([sys.executable, "-m", "plancache", "capture", "--out", str(tmp_path / "g.json"), "--",
                          str(tmp_path / "no-such-program")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 5 and "cannot run" in run.stderr and "hint:" in run.stderr


def test_a_capture_file_that_cannot_be_written_never_breaks_the_build(tmp_path, caplog):
    path = tmp_path / "graphs.json"
    path.write_text("not json")                      # e.g. an --out of PLANCACHE_CAPTURE naming some other file
    hook.install(None, graph_class=StageGraph, capture=path)
    try:
        g, _ = rmsnorm()
        g.build([cudnn.heur_mode.A])                 # built as asked, the failure logged
    finally:
        hook.uninstall()
    assert [s[0] for s in g.stages][-1] == "build_plans"
    assert "could not write the capture file" in caplog.text and path.read_text() == "not json"


def test_plancache_capture_refuses_an_out_file_that_is_not_a_capture_file(tmp_path):
    out = tmp_path / "notes.json"
    out.write_text('{"some": "thing"}')
    run = subprocess.run([sys.executable, "-m", "plancache", "capture", "--out", str(out), "--", sys.executable, "-c",
                          "print('ran')"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "not a capture file" in run.stderr and "hint:" in run.stderr
    assert "ran" not in run.stdout and out.read_text() == '{"some": "thing"}'
