"""The attention route's steady path in C++ (``plancache/csrc/sdpa_route.cpp``): found, built and loaded.

The source is compiled on first use by ``torch.utils.cpp_extension`` with the machine's C++ compiler, against the
headers of torch, cuDNN and FE's wheel (which ships them), and kept under ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``): a process later loads it in milliseconds, and a process of another torch build
compiles its own. The CUDA runtime's headers come from a CUDA toolkit (``CUDA_HOME``, ``/usr/local/cuda``) or from
NVIDIA's wheels where those hold them whole; nothing is compiled for the GPU.
Building takes a minute or two, once per machine and torch build: ``python -c "from plancache.client import
sdpa_ext; sdpa_ext.load()"`` does it ahead (in an image, with ``TORCH_EXTENSIONS_DIR`` in it).
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["SOURCE", "SYSTEM_CUDA_INCLUDE", "ExtensionUnavailable", "build_options", "load", "module_name"]

#: The extension's one source file.
SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "sdpa_route.cpp"
_NAME = "plancache_sdpa_route"
#: A CUDA toolkit's headers where ``CUDA_HOME`` is not set.
SYSTEM_CUDA_INCLUDE = "/usr/local/cuda/include"

log = logging.getLogger("plancache.client")
_lock = threading.Lock()
_module: Any = None


class ExtensionUnavailable(RuntimeError):
    """The C++ steady path cannot be built or loaded here; the message says what is missing."""


def _search_roots() -> list[str]:
    return [p for p in dict.fromkeys(sys.path) if p and os.path.isdir(p)]


def _first(what: str, patterns: list[str]) -> str:
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise ExtensionUnavailable(f"{what} not found (looked for {', '.join(patterns[:4])}{', ...' if len(patterns) > 4 else ''})")


def module_name() -> str:
    """The extension's name: one per version of its source, so that a build of another version is never loaded
    (torch's build step trusts file times, which an upgrade may leave older than the last build)."""
    import hashlib

    return f"{_NAME}_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"


def build_options() -> dict[str, Any]:
    """Include directories and linker flags: FE's headers, cuDNN's headers and library, the CUDA runtime's headers
    and library, torch's CUDA libraries (raises :class:`ExtensionUnavailable` naming what is missing)."""
    from torch.utils.cpp_extension import CUDA_HOME

    roots = _search_roots()
    cuda_roots = [c for c in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME) if c]
    fe = _first("cuDNN FE's C++ headers (pip install nvidia-cudnn-frontend)",
                [f"{r}/include/cudnn_frontend.h" for r in roots])
    cudnn_h = _first("cuDNN's headers (pip install nvidia-cudnn-cu13, or -cu12)",
                     [f"{r}/nvidia/cudnn/include/cudnn.h" for r in roots] + ["/usr/include/cudnn.h"])
    cudnn_so = _first("cuDNN's library", [f"{r}/nvidia/cudnn/lib/libcudnn.so.9" for r in roots]
                      + ["/usr/lib/x86_64-linux-gnu/libcudnn.so.9", "/usr/lib/aarch64-linux-gnu/libcudnn.so.9"])
    cuda_dirs = [f"{c}/include" for c in cuda_roots] + [SYSTEM_CUDA_INCLUDE] + [
        d for r in roots for d in sorted(glob.glob(f"{r}/nvidia/cu*/include")) + [f"{r}/nvidia/cuda_runtime/include"]]
    runtime_h = _first("the CUDA runtime's headers (set CUDA_HOME to a CUDA toolkit)",
                       [f"{d}/cuda_runtime_api.h" for d in cuda_dirs if os.path.exists(f"{d}/crt/host_defines.h")])
    nvrtc_h = _first("NVRTC's header, which FE's headers include (set CUDA_HOME to a CUDA toolkit)",
                     [f"{d}/nvrtc.h" for d in cuda_dirs] + [f"{r}/nvidia/cuda_nvrtc/include/nvrtc.h" for r in roots])
    includes = list(dict.fromkeys(os.path.dirname(p) for p in (fe, cudnn_h, runtime_h, nvrtc_h)))
    cudnn_lib = os.path.dirname(cudnn_so)
    return {"extra_include_paths": includes,
            "extra_ldflags": [f"-L{cudnn_lib}", "-l:libcudnn.so.9", f"-Wl,-rpath,{cudnn_lib}", "-lc10_cuda",
                              "-ltorch_cuda"]}


def _built(name: str) -> bool:
    """Whether a build of ``name`` is under ``TORCH_EXTENSIONS_DIR`` already (loading it then takes milliseconds)."""
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return (Path(_get_build_directory(name, False)) / f"{name}.so").exists()
    except Exception:  # noqa: BLE001 - torch's helper (private) changed or failed: only the warning depends on it
        return False


def load(*, verbose: bool = False) -> Any:
    """The compiled extension module, built on first use (see the module docstring); raises
    :class:`ExtensionUnavailable` when it cannot be built or loaded, saying why."""
    global _module
    with _lock:
        if _module is None:
            try:
                import cudnn  # noqa: F401 - FE's Python package: its wheel holds the headers
                import torch
                from torch.utils.cpp_extension import load as build
            except ImportError as exc:
                raise ExtensionUnavailable(f"{exc.name} is not installed: pip install 'plancache[gpu]'") from None
            if torch.version.cuda is None:
                raise ExtensionUnavailable(f"torch {torch.__version__} is a build without CUDA")
            name = module_name()
            try:
                options = build_options()
                if not _built(name):
                    log.warning("plancache: compiling the attention route's C++ steady path (once per machine and "
                                "torch build: a minute or two)")
                _module = build(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"], with_cuda=False,
                                verbose=verbose, **options)
            except ExtensionUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - a compiler missing or failing, a library not loading
                raise ExtensionUnavailable(f"could not build {SOURCE.name}: {str(exc).strip()[-400:]}") from exc
        return _module
