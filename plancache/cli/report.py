"""Readable tables of tuning results (rich)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def summary_table(results: list[tuple[Path, Any, Any]]) -> Table:
    """One row per tuned spec: candidates, winner vs heuristic vs worst, tuning time."""
    t = Table(title="autotune summary")
    for col in ("spec", "graph key", "candidates", "ok", "winner ms", "heuristic ms", "worst ms", "speedup", "workspace",
                "tune s"):
        t.add_column(col, justify="right" if col not in ("spec", "graph key") else "left")
    for path, spec, tuned in results:
        ok = sum(c.status == "ok" for c in tuned.candidates)
        sp = tuned.speedup_vs_heuristic
        t.add_row(path.name, spec.graph_key[:12], str(len(tuned.candidates)), str(ok), _ms(tuned.winner_median_ms),
                  _ms(tuned.heuristic_median_ms), _ms(tuned.worst_median_ms), "-" if sp is None else f"{sp:.2f}x",
                  str(tuned.workspace_bytes), f"{tuned.tuning_seconds:.2f}")
    return t


def candidate_table(title: str, tuned: Any) -> Table:
    """Every candidate of one tuning run, the winner and heuristic choice marked."""
    t = Table(title=f"candidates: {title}")
    for col in ("#", "engine", "knobs", "status", "median ms", "err", "workspace", "note"):
        t.add_column(col)
    for c in tuned.candidates:
        mark = ("W" if c.index == tuned.winner_index else "") + ("H" if c.index == tuned.heuristic_index else "")
        knobs = ",".join(f"{k}={v}" for k, v in c.knobs.items())
        t.add_row(str(c.index), str(c.engine_id), knobs[:40], c.status, _ms(c.median_ms),
                  "-" if c.max_abs_err is None else f"{c.max_abs_err:.2e}", str(c.workspace_bytes or 0),
                  mark + (f" {c.error[:50]}" if c.error else ""))
    return t
