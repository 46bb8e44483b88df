"""The plancache client: verified, tuned cuDNN plans for this GPU at process start, with a local fallback.

::

    from plancache.client import PlanCache

    cache = PlanCache("http://plancache:8787", token=..., trusted_keys="/etc/plancache/keys")
    cache.prefetch(specs)                 # one round trip at start-up
    plan = cache.plan(spec)
    plan.execute(X=x, W=w, B=b, Y=y)      # on torch's current stream

Importing the client costs next to nothing: each name below is imported from its module when it is first read,
and those modules leave the HTTP client, the wire protocol's models, signature checks and settings to the first
:class:`PlanCache` made (tests/unit/test_client_import.py names what stays out). The default GPU backend imports
torch and nvidia-cudnn-frontend when a :class:`PlanCache` is created without a backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import Backend, GpuBackend
    from .context import MODES, Builds, ClientStats, LoadContext, Pending, StepName
    from .core import ClientConfig, PlanCache
    from .ladder import LADDER
    from .plan import Plan
    from .steps import Step, StoreStep

#: What users of the client write code against: the cache and its configuration, plans, GPU backends, and what a
#: custom ladder step is made of. Internals (the disk cache, the server calls, verification) stay in their modules.
__all__ = [
    "Backend", "Builds", "ClientConfig", "ClientStats", "GpuBackend", "LADDER", "LoadContext", "MODES", "Pending",
    "Plan", "PlanCache", "Step", "StepName", "StoreStep",
]

#: The module each exported name is defined in, imported when the name is first read.
_HOMES = {
    "Backend": ".backend", "GpuBackend": ".backend", "Plan": ".plan",
    **dict.fromkeys(("MODES", "Builds", "ClientStats", "LoadContext", "Pending", "StepName"), ".context"),
    "ClientConfig": ".core", "PlanCache": ".core", "LADDER": ".ladder", "Step": ".steps", "StoreStep": ".steps",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # read once: the next read is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
