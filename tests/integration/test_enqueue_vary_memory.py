"""``enqueue --vary`` in bounded memory (issue 37, finding 5): the variants are built, registered and queued one
request's worth at a time, with a progress bar and a final count.

Figure (this test: 4 captured graphs × 250 sequence lengths, 1,000 variants, the server calls counted in place
of a server; peak of Python allocations, tracemalloc), on main 4d1a308: every variant was built before the first
was sent, peak 13.3 MiB, growing with the count (2.46 GB for 200 × 1,000 in the issue), no progress, no count;
with the fix 2.4 MiB, one request's keys at most, a progress bar and "queued N jobs for 1000 variants".
"""

from __future__ import annotations

import tracemalloc

from typer.testing import CliRunner

from plancache.cli import make_app
from plancache.client.capture import Recorder
from plancache.client.remote import Remote
from plancache.worker.jobs_api import JobsApi
from tests.integration.test_capture_enqueue import attention

GRAPHS, SIZES = 4, 250
PEAK_LIMIT = 6 * 1024 * 1024


def test_vary_streams_its_variants_in_bounded_memory(tmp_path, monkeypatch):
    path = tmp_path / "graphs.json"
    recorder = Recorder(path)
    for b in range(1, GRAPHS + 1):
        recorder.add(attention(512, 512, b))
    recorder.flush()
    registered: list[int] = []
    queued: list[int] = []
    monkeypatch.setattr(Remote, "register_spec", lambda self, spec, **_: registered.append(1) or spec.graph_key)
    monkeypatch.setattr(JobsApi, "enqueue", lambda self, req: queued.append(len(req.graph_keys)) or [])
    sizes = ",".join(str(64 + 8 * i) for i in range(SIZES))
    tracemalloc.start()
    try:
        result = CliRunner().invoke(make_app(), ["enqueue", str(path), "--vary", f"s={sizes}", "--server",
                                                 "http://127.0.0.1:9", "--token", "t" * 20, "--wait", "0"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0, result.output[-2000:]
    assert len(registered) == GRAPHS * SIZES and sum(queued) == GRAPHS * SIZES
    assert f"for {GRAPHS * SIZES} variants" in result.output
    print(f"enqueue --vary: {GRAPHS * SIZES} variants, peak {peak / 2**20:.1f} MiB of Python allocations")
    assert peak < PEAK_LIMIT, peak
