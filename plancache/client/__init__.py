"""The plancache client: verified, tuned cuDNN plans for this GPU at process start, with a local fallback.

::

    from plancache.client import PlanCache

    cache = PlanCache("http://plancache:8787", token=..., trusted_keys="/etc/plancache/keys")
    cache.prefetch(specs)                 # one round trip at start-up
    plan = cache.plan(spec)
    plan.execute(X=x, W=w, B=b, Y=y)      # on torch's current stream

Importing this package needs neither torch, cudnn nor the server stack; the default GPU backend
imports torch and nvidia-cudnn-frontend when a :class:`PlanCache` is created without a backend.
"""

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
