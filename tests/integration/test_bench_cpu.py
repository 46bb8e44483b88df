"""The CPU benchmarks run as docs/BENCHMARKS.md gives them (few runs each) and report what it quotes:
``bench/startup_cpu.py`` every phase in order, ``bench/new_shape_fetch.py`` each way and part, ``bench/db_scale.py``
each read timed on each database."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _result(script: str, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """``script``'s ``--out`` JSON and its output, once it ran (its processes import torch, as the programs it
    models do)."""
    pytest.importorskip("torch", reason="the benchmark's processes import torch, as the programs it models do")
    done = _bench(script, *args, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_the_cpu_start_up_benchmark_runs_and_reports_each_phase(tmp_path):
    result, stdout = _result("startup_cpu.py", tmp_path / "startup_cpu.json", "--runs", "1")
    assert result["graphs"] == 49 and set(result["summary"]) == {"floor", "plancache", "floor_frozen",
                                                                  "plancache_frozen"}
    for case in ("plancache", "plancache_frozen"):
        phases = result["summary"][case]
        assert list(phases) == ["torch", "imports", "parse", "init", "prefetch", "ready"]
        assert all(a <= b for a, b in zip(list(phases.values()), list(phases.values())[1:], strict=False)), phases
    assert "x the floor" in stdout


def test_the_new_shape_fetch_benchmark_times_each_way_on_fresh_pairs(tmp_path):
    result, stdout = _result("new_shape_fetch.py", tmp_path / "new_shape_fetch.json", "--pairs", "3")
    assert result["pairs"] == 3 and result["blob_bytes"] == 64 * 1024
    assert list(result["median_ms"]) == ["answer", "resolve", "verified_blobs", "sibling"]
    assert all(len(times) == 3 and all(t > 0 for t in times) for times in result["all_ms"].values()), result["all_ms"]
    assert len(result["parts_ms"]) == 4 and "server's answer, received" in stdout


def test_the_new_shape_fetch_benchmark_runs_beside_a_busy_python_thread(tmp_path):
    result, stdout = _result("new_shape_fetch.py", tmp_path / "busy.json", "--pairs", "2", "--busy-thread",
                             "--switch-interval", "0.0005")
    assert result["busy_thread"] is True and result["switch_interval_s"] == 0.0005
    assert all(len(times) == 2 for times in result["all_ms"].values()), result["all_ms"]
    assert "(client: a busy Python thread, switch interval 0.5 ms)" in stdout


def test_the_new_shape_fetch_benchmark_refuses_a_count_below_one():
    done = _bench("new_shape_fetch.py", "--pairs", "0", timeout=60)
    assert done.returncode == 2 and "--pairs and --blob-kib take a positive number" in done.stderr


def test_the_new_shape_fetch_benchmark_refuses_a_switch_interval_of_zero():
    done = _bench("new_shape_fetch.py", "--switch-interval", "0", timeout=60)
    assert done.returncode == 2 and "--switch-interval takes a positive number of seconds" in done.stderr


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_store_scale_benchmark_times_a_new_pairs_reads_both_ways(tmp_path, database, request):
    if database == "postgres":
        request.getfixturevalue("postgres_admin_url")  # skipped (failed under CI) where Postgres is unreachable
    out = tmp_path / "db_scale.json"
    done = _bench("db_scale.py", "--sizes", "200:0", "--databases", database, "--runs", "3", "--claims", "3",
                  "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["database"] == database and row["plans"] == 200
    for name in ("resolve_ms", "versions_ms", "new_pair_ms", "new_pair_in_transactions_ms", "siblings_ms", "explain_ms",
                 "claim_ms"):
        assert row[name] > 0, (name, row)


@pytest.mark.parametrize("sizes", ["100:0", "1000", "1000:x", "1000:-1", ""])
def test_the_store_scale_benchmark_refuses_sizes_it_cannot_measure(sizes):
    done = _bench("db_scale.py", "--sizes", sizes, "--databases", "sqlite", timeout=60)
    assert done.returncode == 2 and "--sizes takes PLANS:JOBS pairs" in done.stderr, done.stderr[-2000:]
