"""Capture files on the CPU, without FE: the merge of counts into a file (a forked process, a key listed twice, a
hostile file) and vary's axes (SpecBuilder graphs; tests/unit/test_capture.py checks FE's own pygraphs)."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading

import pytest

from plancache.client import hook
from plancache.client.capture import Recorder, parse_capture, read_capture
from plancache.errors import SpecError
from plancache.spec import SpecBuilder
from plancache.spec.axes import variants, vary


def attention(s: int, b: int = 2):
    builder = SpecBuilder(io_data_type="bfloat16", name="attention")
    q, k, v = (builder.tensor(n, dim=[b, 8, s, 64]) for n in ("Q", "K", "V"))
    builder.sdpa(q, k, v, causal=True).set_output(True).set_name("O")
    return builder.build()


def counts(path) -> dict[str, int]:
    return {spec.graph_key: n for spec, n in parse_capture(json.loads(path.read_text()))}


class Graph:
    """Stands for an FE graph (the hook counts each graph object once)."""


def _child_builds(spec) -> None:
    hook._count(Graph(), spec)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_does_not_write_its_parent_s_pending_counts(tmp_path):
    """A forked child (a fork-started worker) inherited the recorder with the parent's unwritten counts and wrote them
    at its own first build; the parent wrote them again at exit: a graph built 3 times was counted 5."""
    path = tmp_path / "graphs.json"
    a, b = attention(512), attention(256)
    hook._start_capture(path)
    try:
        for _ in range(3):
            hook._count(Graph(), a)               # the first written at once, two pending
        child = multiprocessing.get_context("fork").Process(target=_child_builds, args=(b,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
    finally:
        hook._stop_capture()                      # the parent's exit flush
    assert counts(path) == {a.graph_key: 3, b.graph_key: 1}


def test_a_key_listed_twice_keeps_both_counts(tmp_path):
    """Two capture files merged by hand list a key twice: adding to the file kept only the last entry's count."""
    path = tmp_path / "graphs.json"
    a = attention(512)
    entry = {"graph_key": a.graph_key, "name": a.name, "spec": a.to_json()}
    path.write_text(json.dumps({"format": "plancache-capture", "version": 1,
                                "graphs": [{**entry, "count": 2}, {**entry, "count": 3}]}))
    Recorder(path).add(a)
    assert counts(path) == {a.graph_key: 6}


def test_a_capture_file_nested_too_deeply_is_a_spec_error_and_never_breaks_the_build(tmp_path, caplog):
    path = tmp_path / "graphs.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="not a capture file"):
        read_capture(path)                        # a warm start: warms nothing in normal mode
    with pytest.raises(SpecError, match="nested too deeply"):
        Recorder(path).add(attention(512))
    hook._start_capture(path)
    try:
        hook._count(Graph(), attention(512))      # the program's build goes on; the failure is logged
    finally:
        hook._stop_capture()
    assert "could not write the capture file" in caplog.text


@pytest.mark.parametrize("sizes", [{"s": 1024, "s_q": 128}, {"s_q": 128, "s": 1024}, {"s_kv": 64, "s": 32}])
def test_two_axes_that_set_one_dim_are_refused(sizes):
    """s is s_q and s_kv together: with s_q too, whichever came last set s_q, and every variant was labelled with a
    size it did not have."""
    with pytest.raises(SpecError, match="both set"):
        vary(attention(512), sizes)
    assert [c for c, _ in variants(attention(512), {"s_q": [128], "s_kv": [64]})] == [{"s_q": 128, "s_kv": 64}]


def test_merging_into_a_large_file_does_not_parse_its_specs_again(tmp_path, monkeypatch):
    """Before: each first build of a new graph parsed and hashed every spec already in the file, under its lock (with
    10,000 graphs: 5.7 s per new graph, quadratic over a run). Now the file's entries are carried over as they are;
    whoever reads the file (enqueue) still checks each spec against its key."""
    from plancache.client import capture

    path = tmp_path / "graphs.json"
    first = Recorder(path)
    for s in range(64, 64 + 40):
        first.add(attention(s))
    parsed: list[object] = []
    real = capture.parse_spec
    monkeypatch.setattr(capture, "parse_spec", lambda doc: (parsed.append(doc), real(doc))[1])
    second = Recorder(path)
    second.add(attention(8))
    second.add(attention(64))
    second.flush()
    assert parsed == []
    merged = counts(path)  # every spec still checks against its key here
    assert len(merged) == 41 and merged[attention(64).graph_key] == 2 and merged[attention(8).graph_key] == 1


def _read_within(path, seconds: float = 10.0):
    """read_capture(path) in a thread: what it raised, or a failure when it hangs."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            read_capture(path)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"reading {path} hung"
    return raised[0] if raised else None


def test_a_capture_file_over_the_limit_or_endless_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    """Before: a capture file (PLANCACHE_WARM, enqueue) was read whole: /dev/zero or a 10 GB file given by mistake
    took all memory, a FIFO without a writer hung. Now a file over MAX_CAPTURE_BYTES is refused naming its size and
    the limit, at most the limit + 1 bytes are read, and a FIFO is opened without waiting for a writer."""
    from plancache.client import capture

    monkeypatch.setattr(capture, "MAX_CAPTURE_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2000)
    with pytest.raises(SpecError, match=r"big\.json: cannot read the capture file \(2000 bytes, over the limit of "
                                        r"1000 bytes\)"):
        read_capture(big)
    exc = _read_within("/dev/zero")
    assert isinstance(exc, SpecError) and "more than 1000 bytes, over the limit of 1000 bytes" in exc.message
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    exc = _read_within(fifo)                      # no writer: read as empty
    assert isinstance(exc, SpecError) and "fifo.json: not a capture file (not JSON" in exc.message


def test_a_cut_off_capture_file_says_it_is_a_capture_file(tmp_path):
    """Before: a capture file cut off (a copy interrupted) read as "not a capture file (not JSON ...)"."""
    path = tmp_path / "graphs.json"
    recorder = Recorder(path)
    recorder.add(attention(512))
    recorder.add(attention(256))
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(SpecError, match=r"graphs\.json: the capture file is cut off or damaged \(not valid JSON: "
                                        r".*\); copy it again, or capture again \(plancache capture\)"):
        read_capture(path)


def test_a_recorder_never_writes_a_capture_file_no_reader_takes(tmp_path, monkeypatch):
    """The reader refuses a file over MAX_CAPTURED graphs or MAX_CAPTURE_BYTES, but the recorder wrote one: every
    later merge (and PLANCACHE_WARM, enqueue) then failed on it. It keeps the most built graphs up to the count, and
    leaves the file as it was rather than write one over the size."""
    from plancache.client import capture

    monkeypatch.setattr(capture, "MAX_CAPTURED", 2)
    path = tmp_path / "graphs.json"
    recorder = Recorder(path)
    for seq, times in ((128, 1), (256, 3), (512, 2)):
        for _ in range(times):
            recorder.add(attention(seq))
    recorder.flush()
    kept = read_capture(path)  # 256 built 3 times; 128 and 512 counted 1 each when last merged, a tie by key
    assert len(kept) == 2 and (kept[0][0].graph_key, kept[0][1]) == (attention(256).graph_key, 3)
    monkeypatch.setattr(capture, "MAX_CAPTURED", 100)
    monkeypatch.setattr(capture, "MAX_CAPTURE_BYTES", path.stat().st_size + 10)
    before = path.read_bytes()
    with pytest.raises(SpecError, match=r"graphs\.json: the capture file would be \d+ bytes, over the limit of "):
        Recorder(path).add(attention(1024))
    assert path.read_bytes() == before
