"""The attention route's steady path in C++ (``plancache/csrc/sdpa_route.cpp``): found, built and loaded.

The source is compiled by ``torch.utils.cpp_extension`` with the machine's C++ compiler, against the headers of
torch, cuDNN and FE's wheel (which ships them), and kept under ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``) with a name of its own per source, torch, FE and Python version: a later process
imports that build in milliseconds, and a process of another version has its own. The CUDA runtime's headers come
from a CUDA toolkit (``CUDA_HOME``, ``/usr/local/cuda``) or from NVIDIA's wheels where those hold them whole;
nothing is compiled for the GPU.
Building takes a minute or two, once per machine and version: ``python -m plancache.client.sdpa_ext`` does it ahead
(in an image, with ``TORCH_EXTENSIONS_DIR`` in it), and the route's default (``PLANCACHE_ATTENTION_CPP=auto``)
starts it in the background where it is missing (:func:`build_in_background`).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["SOURCE", "STALE_LOCK_SECONDS", "SYSTEM_CUDA_INCLUDE", "ExtensionUnavailable", "NotBuilt", "build_in_background",
           "build_options", "load", "module_name"]

#: The extension's one source file.
SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "sdpa_route.cpp"
_NAME = "plancache_sdpa_route"
#: A CUDA toolkit's headers where ``CUDA_HOME`` is not set.
SYSTEM_CUDA_INCLUDE = "/usr/local/cuda/include"
#: A build lock older than this is a killed build's: torch's builder would wait on it for ever. A build takes a
#: minute or two; a process finding a younger lock waits for that build to end (and loads what it made).
STALE_LOCK_SECONDS = 600.0

log = logging.getLogger("plancache.client")
_lock = threading.Lock()
_module: Any = None


class ExtensionUnavailable(RuntimeError):
    """The C++ steady path cannot be built or loaded here; the message says what is missing."""


class NotBuilt(ExtensionUnavailable):
    """No build of this version is on this machine yet (``load(build=False)``), or one is being made."""


def _search_roots() -> list[str]:
    return [p for p in dict.fromkeys(sys.path) if p and os.path.isdir(p)]


def _first(what: str, patterns: list[str]) -> str:
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise ExtensionUnavailable(f"{what} not found (looked for {', '.join(patterns[:4])}{', ...' if len(patterns) > 4 else ''})")


def module_name() -> str:
    """The extension's name: one per version of its source, of torch, of FE and of Python, so that a build of
    another version is never loaded (torch's builder trusts file times, which an upgrade may leave older)."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        fe = version("nvidia-cudnn-frontend")
    except PackageNotFoundError:
        fe = "unknown"
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"\0{torch.__version__}\0{torch.version.cuda}\0{fe}\0{sys.implementation.cache_tag}".encode())
    return f"{_NAME}_{digest.hexdigest()[:12]}"


def build_options() -> dict[str, Any]:
    """Include directories and linker flags: FE's headers, cuDNN's headers and library, the CUDA runtime's headers
    and library, torch's CUDA libraries (raises :class:`ExtensionUnavailable` naming what is missing)."""
    roots = _search_roots()
    cuda_roots = [c for c in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), _builder().CUDA_HOME) if c]
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


def _usual_directory(name: str) -> Path | None:
    """Where torch's builder keeps ``name`` by its rule as of torch 2.11, found without importing the builder (which
    imports setuptools: 70 ms); None where that rule does not apply. A miss here only costs that import."""
    try:
        import torch

        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        if root is None:
            if torch.version.cuda is None or torch.version.hip is not None:
                return None
            from torch import _appdirs

            folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
            root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                                f"{folder}_cu{torch.version.cuda.replace('.', '')}")
        return Path(root) / name
    except Exception:  # noqa: BLE001 - torch's private helper moved: the builder's own answer is asked instead
        return None


def _builder() -> Any:
    """torch's extension builder (``torch.utils.cpp_extension``)."""
    try:
        import torch.utils.cpp_extension as builder
    except ImportError as exc:
        raise ExtensionUnavailable(f"torch's extension builder cannot be imported ({exc}): pip install setuptools "
                                   f"ninja") from None
    return builder


def _build_directory(name: str) -> Path | None:
    """Where torch's builder keeps ``name`` (under ``TORCH_EXTENSIONS_DIR``); None where its helper fails."""
    builder = _builder()
    try:
        return Path(builder._get_build_directory(name, False))
    except Exception:  # noqa: BLE001 - torch's helper (private) changed or failed: only the checks below need it
        return None


def _lock_age(directory: Path) -> float | None:
    """Seconds since a build took ``directory``'s lock; None where none holds it."""
    try:
        return time.time() - (directory / "lock").stat().st_mtime
    except FileNotFoundError:
        return None


def _await_lock(directory: Path, stale_after: float = STALE_LOCK_SECONDS, poll: float = 0.5) -> None:
    """Waits while another process builds in ``directory`` (its ``lock`` file); removes a lock older than
    ``stale_after`` seconds, which a killed build left (torch's builder would wait on it for ever)."""
    lock = directory / "lock"
    while True:
        age = _lock_age(directory)
        if age is None:
            return
        if age > stale_after:
            log.warning("plancache: removing %s, left %.0f s ago by a build that did not finish", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll)


def _finished(directory: Path | None, name: str) -> Path | None:
    """``name``'s build in ``directory``, where it is there and no build holds the folder's lock."""
    if directory is None:
        return None
    path = directory / f"{name}.so"
    return path if path.exists() and _lock_age(directory) is None else None


def _import(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExtensionUnavailable(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise ExtensionUnavailable(f"could not import {path}: {exc}") from exc
    return module


def _requirements() -> None:
    try:
        import cudnn  # noqa: F401 - FE's Python package: its wheel holds the headers
        import torch
    except ImportError as exc:
        raise ExtensionUnavailable(f"{exc.name} is not installed: pip install 'plancache[gpu]'") from None
    if torch.version.cuda is None:
        raise ExtensionUnavailable(f"torch {torch.__version__} is a build without CUDA")


def load(*, build: bool = True, verbose: bool = False) -> Any:
    """The compiled extension module: this version's build imported where it is on this machine, else built now
    with ``build`` (see the module docstring); raises :class:`NotBuilt` where it is not built and ``build`` is
    False, :class:`ExtensionUnavailable` where it cannot be built or loaded, saying why. A failed build is noted
    beside it (``failed``): without ``build`` it is not tried again."""
    global _module
    with _lock:
        if _module is None:
            _requirements()
            name = module_name()
            directory = None
            finished = _finished(_usual_directory(name), name)
            if finished is None:  # not where torch's rule puts it: asked of torch's builder
                directory = _build_directory(name)
                finished = _finished(directory, name)
            if finished is not None:
                _module = _import(name, finished)
                return _module
            built = directory is not None and (directory / f"{name}.so").exists()
            failed = directory / "failed" if directory is not None else None
            if not build:
                if failed is not None and failed.exists():
                    raise ExtensionUnavailable(
                        f"its build here failed ({failed.read_text(errors='replace').strip()[-300:]}); "
                        f"python -m plancache.client.sdpa_ext tries again")
                raise NotBuilt(f"{name} is not built here yet" if not built else f"{name} is being built")
            try:
                _module = _build(name, directory, built, verbose)
            except ExtensionUnavailable as exc:
                if failed is not None:  # the processes after this one do not start the same build again
                    failed.parent.mkdir(parents=True, exist_ok=True)
                    failed.write_text(f"{exc}\n")
                raise
            if failed is not None:
                failed.unlink(missing_ok=True)
        return _module


def _build(name: str, directory: Path | None, built: bool, verbose: bool) -> Any:
    """Compiles ``name`` (or waits for another process's build of it) and imports it."""
    compile_and_load = _builder().load
    options = build_options()
    if directory is not None:
        _await_lock(directory)
    if not built:
        log.warning("plancache: compiling the attention route's C++ steady path (once per machine and version: a "
                    "minute or two)")
    try:
        return compile_and_load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"], with_cuda=False,
                                verbose=verbose, **options)
    except Exception as exc:  # noqa: BLE001 - a compiler missing or failing, a library not loading
        raise ExtensionUnavailable(f"could not build {SOURCE.name}: {str(exc).strip()[-400:]}") from exc


def build_in_background() -> bool:
    """Start ``python -m plancache.client.sdpa_ext`` (a build of this version) in a process of its own, which
    outlives this one; False where a build is under way (a lock younger than :data:`STALE_LOCK_SECONDS`), or where
    this process's executable is not a Python interpreter (an application embedding one). It sees no GPU (a
    compile needs none, and takes no memory of the job's); its output goes to ``build.log`` beside it."""
    if not os.path.basename(sys.executable or "").startswith("python"):
        return False
    name = module_name()
    directory = _build_directory(name)
    if directory is None:
        return False
    age = _lock_age(directory)
    if age is not None and age <= STALE_LOCK_SECONDS:  # a stale one is the new build's to remove (_await_lock)
        return False
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.log", "ab") as out:
        subprocess.Popen([sys.executable, "-m", "plancache.client.sdpa_ext"], stdin=subprocess.DEVNULL, stdout=out,
                         stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # compiling needs no GPU: it takes none
    return True


def main() -> int:
    """``python -m plancache.client.sdpa_ext``: build this version here (or find it built) and say where."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module = load(verbose="-v" in sys.argv[1:])
    except ExtensionUnavailable as exc:
        print(f"plancache: the attention route's C++ steady path cannot be built here: {exc}", file=sys.stderr)
        return 1
    print(f"plancache: the attention route's C++ steady path is built: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
