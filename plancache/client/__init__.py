"""The plancache client: verified, tuned cuDNN plans for this GPU at process start, with a local fallback.

::

    from plancache.client import PlanCache

    cache = PlanCache("http://plancache:8787", token=..., trusted_keys="/etc/plancache/keys")
    cache.prefetch(specs)                 # one round trip at start-up
    plan = cache.plan(spec)
    plan.execute(X=x, W=w, B=b, Y=y)      # on torch's current stream

Importing the client costs next to nothing: each name below is imported from its module when it is first read,
and those modules leave the HTTP client, the wire protocol's models, signature checks and settings to the first
:class:`PlanCache` made (tests/unit/test_client_import.py names what stays out); reading :class:`DiskCache` or
:class:`Remote` imports them too, as their modules are the first PlanCache's. The default GPU backend imports
torch and nvidia-cudnn-frontend when a :class:`PlanCache` is created without a backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..verify import REASONS, verify_blob
    from .backend import Backend, GpuBackend
    from .cache import DiskCache
    from .core import LADDER, MODES, Builds, ClientConfig, ClientStats, Pending, PlanCache, Step, StepName, family_key
    from .plan import Plan
    from .remote import Remote

__all__ = [
    "LADDER", "MODES", "REASONS", "Backend", "Builds", "ClientConfig", "ClientStats", "DiskCache", "GpuBackend",
    "Pending", "Plan", "PlanCache", "Remote", "Step", "StepName",
    "family_key", "verify_blob",
]

#: The module each exported name is defined in, imported when the name is first read.
_HOMES = {
    "REASONS": "plancache.verify", "verify_blob": "plancache.verify",
    "Backend": ".backend", "GpuBackend": ".backend", "DiskCache": ".cache", "Plan": ".plan", "Remote": ".remote",
    **dict.fromkeys(("LADDER", "MODES", "Builds", "ClientConfig", "ClientStats", "Pending", "PlanCache", "Step",
                     "StepName", "family_key"), ".core"),
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
