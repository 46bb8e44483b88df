"""httpx, imported without its command-line module: the one place plancache imports httpx at run time.

httpx's package imports ``httpx._main`` (its CLI, pulling in click, rich and pygments: about two thirds of importing
httpx, ~70 ms of a client's start-up) whenever click and rich are installed, and skips it when that import fails.
It is made to fail here, then forgotten, so that a later ``import httpx._main`` still works.
"""

from __future__ import annotations

import sys

if "httpx" not in sys.modules:
    sys.modules["httpx._main"] = None  # type: ignore[assignment]
    try:
        import httpx
    finally:
        if "httpx._main" in sys.modules and sys.modules["httpx._main"] is None:
            del sys.modules["httpx._main"]
import httpx

__all__ = ["httpx"]
