"""The start-up of a program run by ``plancache capture``: its ``sitecustomize`` installs the capturing hook
(:mod:`plancache.client.hook`, writing a capture file: :mod:`plancache.client.capture`) once it imports ``cudnn``."""

from __future__ import annotations

import os
from typing import Any

#: The ``sitecustomize`` that ``plancache capture`` puts first on the program's ``PYTHONPATH``.
BOOT_SOURCE = """\
try:
    from plancache.client.boot import boot
except ImportError as exc:  # this interpreter has no plancache: nothing is captured in it
    import sys
    print(f"plancache capture: {exc}; graphs built by {sys.executable} are not captured", file=sys.stderr)
else:
    boot(__file__)
"""


def boot(boot_file: str) -> None:
    """Run in a program started by ``plancache capture`` (its ``sitecustomize``): import the program's own
    ``sitecustomize``, if any, then install the capturing hook when (and if) the program imports ``cudnn``."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(boot_file))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    own = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if own is not None and own.loader is not None:
        own.loader.exec_module(importlib.util.module_from_spec(own))

    def install(module: Any) -> None:
        from . import hook

        hook.install(None, graph_class=module.pygraph)

    if "cudnn" in sys.modules:
        install(sys.modules["cudnn"])
        return

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "cudnn":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def run(module: Any) -> None:
                    exec_module(module)
                    install(module)

                spec.loader.exec_module = run  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, AfterImport())
