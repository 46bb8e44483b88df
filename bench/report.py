"""What the benchmarks share to report: percentiles, and the plotting library when it is installed."""

from __future__ import annotations

from typing import Any


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 to 1) of ``xs``."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` drawing to files (the Agg backend); None, said once, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots")
        return None
    return plt
