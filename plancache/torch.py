"""One line for PyTorch code: FE's PyTorch ops and PyTorch's cuDNN attention get fleet-tuned plans.

::

    import plancache.torch
    cache = plancache.torch.install()      # or install(PlanCache(...)); uninstall() undoes it
    plancache.torch.install(warm="capture.json")  # warm start: every captured graph's plan fetched now, in one request

Installs :mod:`plancache.client.hook` (every ``cudnn.pygraph`` build of the process: ``cudnn.sdpa_torch`` and
``torch.ops.cudnn.sdpa_fwd``/``sdpa_bwd``, ``cudnn.ops.norm``, ``cudnn.Graph``, ``@cudnn.jit``, ``g.build()``) and,
where the installed torch has a way to take it, FE's SDPA provider, which serves the ``CUDNN_ATTENTION`` backend of
``F.scaled_dot_product_attention`` from ``torch.ops.cudnn.sdpa_fwd``/``sdpa_bwd`` (see :data:`SDPA_ROUTES`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .client import hook
from .client.core import PlanCache

log = logging.getLogger("plancache.client")

__all__ = ["SDPA_ROUTES", "install", "installed_route", "sdpa_route", "uninstall"]

#: How FE's SDPA provider reaches ``F.scaled_dot_product_attention``, by torch version.
SDPA_ROUTES = {
    "torch_switch": "torch.backends.cuda.enable_cudnn_sdp_python(True) (torch versions with the switch)",
    "flash_registry": ('torch.nn.attention.activate_flash_attention_impl("CUDNN") (torch with the flash-implementation '
                       "registry and no switch: 2.11 and 2.13)"),
    "overrides": "cudnn.torch.install_sdpa_overrides() (torch with neither)",
}

_lock = threading.Lock()
_route: str | None = None
_overrides: Any = None  # what uninstall undoes: the overrides' handle, or the flash implementation install replaced
_LEFT_ON = object()  # _overrides of a provider the program had turned on before install: uninstall leaves it on


def sdpa_route() -> str:
    """The :data:`SDPA_ROUTES` key the installed torch takes."""
    if _switch() is not None:
        return "torch_switch"
    import torch.nn.attention as attention

    if hasattr(attention, "activate_flash_attention_impl"):
        return "flash_registry"
    return "overrides"


def install(cache: PlanCache | None = None, *, sdpa_provider: bool = True, warm: hook.WarmSource | None = None,
            warm_vary: Mapping[str, Sequence[int]] | None = None) -> PlanCache:
    """Serve every cuDNN FE build of this process from ``cache`` (default ``PlanCache()`` from the
    ``PLANCACHE_*`` settings) and, with ``sdpa_provider``, route PyTorch's cuDNN SDPA backend through FE's ops.
    ``warm`` (default ``PLANCACHE_WARM``) and ``warm_vary``: a warm start (:func:`plancache.client.hook.install`):
    the plans of the graphs of a capture file (or of specs), and of their variants along shape axes, fetched and
    verified in the background now, so each graph is served with no further request when it is built. Returns the
    cache."""
    global _route, _overrides
    from .environment import require_fe_gpu  # pydantic: not at import (tests/unit/test_client_import.py)

    require_fe_gpu(0 if cache is None else None)  # GpuUnavailable saying why, before anything is installed
    cache = cache if cache is not None else PlanCache()
    import cudnn.sdpa.fwd.torch_op  # noqa: F401 - defines torch.ops.cudnn.sdpa_fwd / sdpa_bwd

    hook.install(cache, warm=warm, warm_vary=warm_vary)
    with _lock:
        if sdpa_provider and _route is None:
            _route, _overrides = _install_provider()
            log.info("plancache: F.scaled_dot_product_attention's cuDNN backend goes through FE's ops via %s",
                     SDPA_ROUTES[_route])
    return cache


def _install_provider() -> tuple[str, Any]:
    import torch

    route = sdpa_route()
    if route == "torch_switch":
        enabled = getattr(torch.backends.cuda, "cudnn_sdp_python_enabled", None)  # the switch's reading
        if enabled is not None and enabled():  # the program turned it on: it stays on
            return route, _LEFT_ON
        _switch()(True)
        return route, None
    import cudnn.torch

    if route == "flash_registry":
        import torch.nn.attention as attention

        current = getattr(attention, "current_flash_attention_impl", None)  # torch versions without it: no reading
        previous = current() if current is not None else None
        if previous == "CUDNN":  # the program turned it on: it stays on
            return route, _LEFT_ON
        attention.activate_flash_attention_impl("CUDNN")
        return route, previous  # the implementation the registry's one slot held: uninstall activates it again
    try:
        return route, cudnn.torch.install_sdpa_overrides()
    except (AttributeError, RuntimeError, ImportError) as exc:  # this torch has no varlen ops to override
        log.info("plancache: FE's varlen overrides do not apply to torch %s (%s); overriding SDPA alone",
                 torch.__version__, exc)
        lib = torch.library.Library("aten", "IMPL")
        from cudnn.torch import sdpa_provider

        lib.impl("_scaled_dot_product_cudnn_attention", sdpa_provider._fwd, "CUDA")
        lib.impl("_scaled_dot_product_cudnn_attention_backward", sdpa_provider._bwd, "CUDA")
        return route, cudnn.torch.SdpaOverrides(lib)


def _switch() -> Any:
    """torch's own switch for FE's provider (``torch.backends.cuda.enable_cudnn_sdp_python``)."""
    import torch

    return getattr(torch.backends.cuda, "enable_cudnn_sdp_python", None)


def installed_route() -> str | None:
    """The :data:`SDPA_ROUTES` key :func:`install` took, or None when the provider is not installed."""
    return _route


def uninstall() -> None:
    """Undo :func:`install`: the SDPA provider as the program had it before (FE's left on where the program had
    turned it on; the flash implementation install replaced activated again) and the hook removed."""
    global _route, _overrides
    with _lock:
        if _route is None or _overrides is _LEFT_ON:
            pass
        elif _route == "torch_switch":
            _switch()(False)
        elif _route == "flash_registry":
            import torch.nn.attention as attention

            if _overrides is None:
                attention.restore_flash_attention_impl()
            else:
                attention.activate_flash_attention_impl(_overrides)
        else:
            _overrides.remove()
        _route, _overrides = None, None
    hook.uninstall()
