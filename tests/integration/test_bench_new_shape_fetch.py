"""``bench/new_shape_fetch.py`` runs as docs/BENCHMARKS.md gives it (few rounds) and reports each way and part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_new_shape_fetch_benchmark_times_each_way_on_fresh_pairs(tmp_path):
    pytest.importorskip("torch", reason="the benchmark's client imports torch, as the programs it models do")
    out = tmp_path / "new_shape_fetch.json"
    done = subprocess.run([sys.executable, "bench/new_shape_fetch.py", "--pairs", "3", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["pairs"] == 3 and result["blob_bytes"] == 64 * 1024
    assert list(result["median_ms"]) == ["answer", "resolve", "verified_blobs"]
    assert all(len(times) == 3 and all(t > 0 for t in times) for times in result["all_ms"].values()), result["all_ms"]
    assert len(result["parts_ms"]) == 3 and "server's answer, received" in done.stdout


def test_the_new_shape_fetch_benchmark_refuses_a_count_below_one():
    done = subprocess.run([sys.executable, "bench/new_shape_fetch.py", "--pairs", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--pairs and --blob-kib take a positive number" in done.stderr
