"""``plancache enqueue`` of capture files against a live server: every captured graph is registered and queued with
source ``capture``, and ``--vary`` queues exactly the keys the same code builds at each size (SpecBuilder is the
reference here; FE's own pygraphs in tests/unit/test_capture.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plancache.cli import make_app
from plancache.cli.failures import ExitCode
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
    capture_file.write_text(capture_file.read_text().replace('"count":2', '"count":0'))
    expected_failure(enqueue(server, str(capture_file)), ExitCode.FAILED, "not a valid capture file",
                     "plancache capture")


@pytest.mark.parametrize(("args", "phrase"), [
    (["--vary", "s=128", "--vary", "s_q=64,256"], "s_q given twice"),     # each variant's s_q would be one of them
    (["--vary", "s=" + ",".join(map(str, range(1, 201))), "--vary", "b=" + ",".join(map(str, range(1, 101)))],
     "20000 combinations"),                                               # refused before any is built
    (["--priority", "2000000"], "--priority 2000000"),                    # refused before any spec is registered
])
def test_vary_and_priority_out_of_bounds_are_usage_errors(server, capture_file, args, phrase):
    expected_failure(enqueue(server, str(capture_file), *args), ExitCode.USAGE, phrase)
    assert server.store.list_jobs() == []


def test_a_capture_or_spec_file_nested_too_deeply_is_refused(server, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    expected_failure(enqueue(server, str(deep)), ExitCode.FAILED, "nested too deeply")
    out = CliRunner().invoke(make_app(), ["capture", "--out", str(deep), "--", "true"])
    expected_failure(out, ExitCode.USAGE, "is not a capture file")


def test_more_keys_than_one_request_takes_are_queued_in_several(server, tmp_path, monkeypatch):
    """Before: over MAX_KEYS_PER_REQUEST (10,000) keys, the TuneRequest failed to validate (an internal error) after
    every spec was registered, and no job was queued (10,001 variants: 32.7 s, then exit 70). Now the keys go in
    requests of that many at most (here a limit of 3, so that the test registers 6 specs, not 10,002)."""
    import plancache.protocol
    from plancache.worker.jobs_api import JobsApi

    monkeypatch.setattr(plancache.protocol, "MAX_KEYS_PER_REQUEST", 3)
    sent: list[int] = []
    real = JobsApi.enqueue
    monkeypatch.setattr(JobsApi, "enqueue", lambda self, req: (sent.append(len(req.graph_keys)), real(self, req))[1])
    path = tmp_path / "graphs.json"
    recorder = Recorder(path)
    for b in (2, 3):
        recorder.add(attention(512, 512, b))
    recorder.flush()
    result = enqueue(server, str(path), "--vary", "s=128,256,512")
    assert result.exit_code == 0, result.output[-2000:]
    assert sent == [3, 3] and len(server.store.list_jobs()) == 6


def test_a_cut_off_capture_file_is_reported_as_a_capture_file(server, capture_file):
    """Before: a capture file cut off was read as a spec: "spec is not valid JSON ... fix the spec (docs/SPEC.md)"."""
    capture_file.write_bytes(capture_file.read_bytes()[:-100])
    out = expected_failure(enqueue(server, str(capture_file)), ExitCode.FAILED, "graphs.json: the capture file is cut "
                           "off or damaged (not valid JSON", "copy it again, or capture again (plancache capture)")
    assert "spec" not in out
    assert server.store.list_jobs() == []


def test_a_spec_or_capture_file_over_its_limit_is_refused(server, capture_file, tmp_path, monkeypatch):
    """Before: enqueue read its files whole, whatever their size (/dev/zero: until memory ran out)."""
    from plancache.client import capture
    from plancache.settings import DEFAULT_MAX_JSON_BYTES

    spec = tmp_path / "big.json"
    spec.write_text(EXAMPLE.read_text() + " " * DEFAULT_MAX_JSON_BYTES)
    size = spec.stat().st_size
    expected_failure(enqueue(server, str(spec)), ExitCode.OS_ERROR,
                     f"big.json: {size} bytes, over the limit of {DEFAULT_MAX_JSON_BYTES} bytes")
    monkeypatch.setattr(capture, "MAX_CAPTURE_BYTES", 100)
    expected_failure(enqueue(server, str(capture_file)), ExitCode.OS_ERROR,
                     f"graphs.json: {capture_file.stat().st_size} bytes, over the limit of 100 bytes")
    expected_failure(enqueue(server, "/dev/zero"), ExitCode.OS_ERROR, "/dev/zero: more than 100 bytes")
    assert server.store.list_jobs() == []
