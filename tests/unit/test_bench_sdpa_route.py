"""bench/sdpa_route.py's tables: a backend whose CUDA-graph capture failed keeps its eager figures and says why; the
block's first step shows the route's own share of it. Its steady timings take turns across the backends."""

from __future__ import annotations

from typing import Any

from bench import sdpa_route
from tests import gpu_util


def _row(eager: float, graphed: float | None, *, error: str = "") -> dict[str, Any]:
    got: dict[str, Any] = {"eager_ms": eager, "host_us": {"fwd": 10.0, "bwd": 20.0}}
    if graphed is None:
        got["graphed_error"] = error
    else:
        got["graphed_ms"] = graphed
    return got


def test_a_failed_capture_is_printed_with_its_reason_and_the_eager_figures_stay(capsys):
    plancache = _row(0.30, None, error="AcceleratorError: operation would make the legacy stream depend on ...")
    plancache["error"] = 1e-3
    results = {
        "kernels": {"kernels": {"2x16x1024x128": {"flash": _row(0.35, 0.34), "aten_cudnn": _row(0.26, 0.14),
                                                  "plancache": plancache}}},
        "block": {"block": {"2x512": {name: {"first_ms": 5.0, "steady_ms": 1.0}
                                      for name in ("flash", "aten_cudnn", "plancache")}}},
    }
    results["block"]["block"]["2x512"]["plancache"].update(first_ms=48.0, prepare_ms=12.5, served={"load:server": 2})
    plancache.update(first_ms=1234.5, first_prepare_ms=33.25)
    sdpa_route._tables(results)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("2x16x1024x128 |"))
    assert "0.300" in row and "1.15" in row and "nan" in row  # eager figures and ratio kept, graphed unknown
    assert "2x16x1024x128 plancache: CUDA-graph capture failed: AcceleratorError: operation would make" in out
    block = next(line for line in out.splitlines() if line.strip().startswith("2x512 |"))
    assert "48.0" in block and "12.5" in block and "'load:server': 2" in block
    first = [line for line in out.splitlines() if line.strip().startswith("2x16x1024x128 |")][1]
    assert "1234.5" in first and "33.2" in first and "nan" in first  # flash's and ATen's first calls not given


def test_the_block_table_shows_the_warm_starts_first_step_beside_the_cold_one(capsys):
    results = {
        "kernels": {"kernels": {}},
        "block": {"block": {"2x1024": {name: {"first_ms": 40.0, "prepare_ms": 29.5, "steady_ms": 1.0}
                                       for name in ("flash", "aten_cudnn", "plancache")}}},
        "block_warm": {"block": {"2x1024": {"plancache_cpp": {"first_ms": 13.25, "prepare_ms": 2.5, "steady_ms": 1.0}}}},
    }
    sdpa_route._tables(results)
    block = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("2x1024 |"))
    assert block.split("|")[2].split()[:4] == ["40.0", "29.5", "13.2", "2.5"]


def test_the_tables_put_the_cpp_steady_path_beside_the_python_route(capsys):
    cpp = _row(0.27, 0.141)
    cpp.update(error=2e-3, host_us={"fwd": 9.5, "bwd": 12.25, "step": 61.0})
    plancache = _row(0.30, 0.142)
    plancache["error"] = 1e-3
    results = {
        "kernels": {"kernels": {"2x16x1024x128": {"flash": _row(0.35, 0.34), "aten_cudnn": _row(0.25, 0.14),
                                                  "plancache": plancache, "plancache_cpp": cpp}}},
        "block": {"block": {"2x1024": {name: {"first_ms": 40.0, "prepare_ms": 29.5, "steady_ms": 1.0}
                                       for name in ("flash", "aten_cudnn", "plancache")}}},
        "block_cpp": {"block": {"2x1024": {"plancache_cpp": {"first_ms": 17.5, "steady_ms": 0.98}}}},
        "block_cold": {"block": {"2x1024": {"plancache_cpp": {"first_ms": 24.5, "steady_ms": 0.98}}}},
        "block_flash": {"block": {"2x1024": {"flash": {"first_ms": 6.25}}}},
    }
    results["block"]["block"]["2x1024"]["plancache_cpp"] = {"first_ms": 3.0, "steady_ms": 0.99}
    sdpa_route._tables(results)
    out = capsys.readouterr().out.splitlines()
    kern = next(line for line in out if line.strip().startswith("2x16x1024x128 |")).split("|")
    assert kern[1].split() == ["0.350", "0.250", "0.300", "1.20", "0.270", "1.08"]
    assert kern[2].split() == ["0.340", "0.140", "0.142", "1.01", "0.141", "1.01"]
    assert kern[3].split()[1] == "9.5/12.2" and kern[4].split()[-1] == "61.0" and kern[5].split()[-1] == "2.0e-03"
    block = next(line for line in out if line.strip().startswith("2x1024 |")).split("|")
    assert block[1].split()[-2:] == ["0.990", "0.99"], "the C++ path's steady step, against the best of torch's"
    assert block[2].split()[4] == "17.5", "its first step, from a fresh process of its own"
    assert block[2].split()[5] == "24.5", "the same with nothing fetched ahead (no siblings)"
    assert block[2].split()[7] == "6.2", "flash's first step, from a fresh process of its own"


def test_steady_timings_take_turns_across_backends_and_keep_each_ones_median(monkeypatch):
    """Round after round every backend is timed once, in order, with its own route (or none) switched on: a drift
    of the GPU over the run reaches every backend alike, and a backend's figure is the median of its rounds."""
    switched: list[str] = []
    monkeypatch.setattr(sdpa_route, "_route", lambda name, cache: switched.append(name))
    monkeypatch.setattr(sdpa_route, "ROUNDS", 3)
    times = iter([5.0, 1.0, 4.0, 2.0, 9.0, 3.0])
    monkeypatch.setattr(gpu_util, "median_ms", lambda step, n, warmup: next(times))
    got = sdpa_route._interleaved(None, ("plancache_cpp", "aten_cudnn"), lambda: None)
    assert switched == ["plancache_cpp", "aten_cudnn"] * 3
    assert got["plancache_cpp"][:2] == (5.0, [5.0, 4.0, 9.0])
    assert got["aten_cudnn"][:2] == (2.0, [1.0, 2.0, 3.0])
