"""``bench/startup_cpu.py`` runs as docs/BENCHMARKS.md gives it (one run per case) and reports every phase in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_start_up_benchmark_runs_and_reports_each_phase(tmp_path):
    pytest.importorskip("torch", reason="the benchmark's processes import torch, as the programs it models do")
    out = tmp_path / "startup_cpu.json"
    done = subprocess.run([sys.executable, "bench/startup_cpu.py", "--runs", "1", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["graphs"] == 49 and set(result["summary"]) == {"floor", "plancache", "floor_frozen",
                                                                  "plancache_frozen"}
    for case in ("plancache", "plancache_frozen"):
        phases = result["summary"][case]
        assert list(phases) == ["torch", "imports", "parse", "init", "prefetch", "ready"]
        assert all(a <= b for a, b in zip(list(phases.values()), list(phases.values())[1:], strict=False)), phases
    assert "x the floor" in done.stdout
