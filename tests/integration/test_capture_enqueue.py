"""``plancache enqueue`` of capture files against a live server: every captured graph is registered and queued with
source ``capture``, and ``--vary`` queues exactly the keys the same code builds at each size (SpecBuilder is the
reference here; FE's own pygraphs in tests/unit/test_capture.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plancache.cli import make_app
from plancache.cli.common import ExitCode
from plancache.client.capture import Recorder
from plancache.spec import SpecBuilder
from tests.integration.test_cli import EXAMPLE, expected_failure
from tests.live_server import LiveServer


def attention(s_q: int, s_kv: int, b: int = 2):
    builder = SpecBuilder(io_data_type="bfloat16", name="attention")
    q = builder.tensor("Q", dim=[b, 8, s_q, 64])
    k = builder.tensor("K", dim=[b, 8, s_kv, 64])
    v = builder.tensor("V", dim=[b, 8, s_kv, 64])
    builder.sdpa(q, k, v, causal=True).set_output(True).set_name("O")
    return builder.build()


def matmul():
    builder = SpecBuilder(io_data_type="bfloat16", name="mlp")
    builder.matmul(builder.tensor("A", dim=[1, 64, 32]), builder.tensor("B", dim=[1, 32, 16])).set_output(True)
    return builder.build()


@pytest.fixture
def server(tmp_path):
    with LiveServer(tmp_path, autotune=False) as srv:
        yield srv


@pytest.fixture
def capture_file(tmp_path) -> Path:
    path = tmp_path / "graphs.json"
    recorder = Recorder(path)
    for spec in (attention(512, 512), attention(512, 512), matmul()):
        recorder.add(spec)
    recorder.flush()
    return path


def enqueue(server, *args: str):
    return CliRunner().invoke(make_app(), ["enqueue", *args, "--server", server.url, "--token", server.admin_token,
                                           "--sm", "90", "--wait", "0"])


def test_a_capture_file_queues_every_graph_as_capture(server, capture_file):
    result = enqueue(server, str(capture_file), str(EXAMPLE))
    assert result.exit_code == 0, result.output
    jobs = server.store.list_jobs()
    assert Counter(j.source for j in jobs) == {"capture": 2, "admin": 1}
    assert {j.graph_key for j in jobs if j.source == "capture"} == {attention(512, 512).graph_key, matmul().graph_key}
    assert "graphs.json:attention (built 2x)" in result.output


def test_vary_queues_the_keys_the_code_builds_at_each_size(server, capture_file):
    result = enqueue(server, str(capture_file), "--vary", "s=1,128,4096")
    assert result.exit_code == 0, result.output
    assert "skipped graphs.json:mlp" in result.output            # a matmul has no sequence axis
    keys = {j.graph_key for j in server.store.list_jobs()}
    assert keys == {attention(s, s).graph_key for s in (1, 128, 4096)}
    assert {j.source for j in server.store.list_jobs()} == {"capture"}
    result = enqueue(server, str(capture_file), "--vary", "s_kv=100,200", "--vary", "b=1,4")
    assert result.exit_code == 0, result.output
    keys = {j.graph_key for j in server.store.list_jobs()} - keys
    assert keys == {attention(512, s, b).graph_key for s in (100, 200) for b in (1, 4)}


@pytest.mark.parametrize("vary", ["s", "s=", "s=0", "s=a,b", "=4"])
def test_a_malformed_vary_is_a_usage_error(server, capture_file, vary):
    expected_failure(enqueue(server, str(capture_file), "--vary", vary), ExitCode.USAGE, "--vary", "s=128")


def test_vary_without_a_graph_that_has_the_axis(server):
    expected_failure(enqueue(server, str(EXAMPLE), "--vary", "s=128"), ExitCode.USAGE, "no graph has the axes s")


def test_an_edited_capture_file_is_refused(server, capture_file):
    capture_file.write_text(capture_file.read_text().replace('"count": 2', '"count": 0'))
    expected_failure(enqueue(server, str(capture_file)), ExitCode.FAILED, "not a valid capture file",
                     "plancache capture")
