"""One line for PyTorch code: FE's PyTorch ops and PyTorch's cuDNN attention get fleet-tuned plans.

::

    import plancache.torch
    cache = plancache.torch.install()      # or install(PlanCache(...)); uninstall() undoes it
    plancache.torch.install(warm="capture.json")  # warm start: every captured graph's plan fetched now, in one request

Installs :mod:`plancache.client.hook` (every ``cudnn.pygraph`` build of the process: ``cudnn.sdpa_torch`` and
``torch.ops.cudnn.sdpa_fwd``/``sdpa_bwd``, ``cudnn.ops.norm``, ``cudnn.Graph``, ``@cudnn.jit``, ``g.build()``) and
plancache's route for ``F.scaled_dot_product_attention``'s cuDNN kernels (:mod:`plancache.client.sdpa`), which runs
them from served plans with no graph work per call.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from .client import hook, sdpa
from .client.core import PlanCache

__all__ = ["install", "sdpa_stats", "uninstall"]

_lock = threading.Lock()


def install(cache: PlanCache | None = None, *, sdpa_route: bool = True, warm: hook.WarmSource | None = None,
            warm_vary: Mapping[str, Sequence[int]] | None = None, attention: str | None = None,
            attention_cpp: bool | str | None = None) -> PlanCache:
    """Serve every cuDNN FE build of this process from ``cache`` (default ``PlanCache()`` from the
    ``PLANCACHE_*`` settings) and, with ``sdpa_route``, torch's cuDNN attention kernels from its plans.
    ``warm`` (default ``PLANCACHE_WARM``) and ``warm_vary``: a warm start (:func:`plancache.client.hook.install`):
    the plans of the graphs of a capture file (or of specs), and of their variants along shape axes, fetched and
    verified in the background now, so each graph is served with no further request when it is built; with
    ``sdpa_route``, the route's attention plans are deserialized there too, so a known shape's first call loads
    nothing.
    ``attention`` (default ``PLANCACHE_ATTENTION``, else ``fastest``): what runs each attention configuration, one
    of :data:`plancache.client.sdpa.CHOICES`. ``attention_cpp`` (default ``PLANCACHE_ATTENTION_CPP``, else ``"auto"``):
    the route's steady path in C++ (:func:`plancache.client.sdpa.install`), replaying captured launches unless
    ``PLANCACHE_ATTENTION_REPLAY`` is false. Returns the cache."""
    from .environment import require_fe_gpu  # pydantic: not at import (tests/unit/test_client_import.py)
    from .settings import ClientSettings

    settings = ClientSettings()
    attention = settings.attention if attention is None else attention
    attention_cpp = settings.attention_cpp if attention_cpp is None else attention_cpp
    sdpa.check_choice(attention)  # before anything is installed
    require_fe_gpu(0 if cache is None else None)  # GpuUnavailable saying why, before anything is installed
    cache = cache if cache is not None else PlanCache()
    import cudnn.sdpa.fwd.torch_op  # noqa: F401 - defines torch.ops.cudnn.sdpa_fwd / sdpa_bwd

    with _lock:
        if sdpa_route:  # first: a warm start loads the route's plans into its C++ steady path, where it has one
            sdpa.install(cache, attention=attention, cpp=attention_cpp, replay=settings.attention_replay)
        try:
            hook.install(cache, warm=warm, warm_vary=warm_vary,
                         warm_load=sdpa.SPEC_NAMES.values() if sdpa_route else (),
                         warm_loader=sdpa.preload if sdpa_route and attention_cpp else None)
        except BaseException:
            sdpa.uninstall()  # nothing is installed (a strict process's unusable capture file)
            raise
    return cache


def sdpa_stats() -> dict[str, float]:
    """What the attention route did (:func:`plancache.client.sdpa.stats`)."""
    return sdpa.stats()


def uninstall() -> None:
    """Undo :func:`install`: torch's own attention kernels back, and the hook removed."""
    with _lock:
        sdpa.uninstall()
        hook.uninstall()
