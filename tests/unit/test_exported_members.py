"""Each public module's ``__all__`` is sorted and names exactly its public, module-defined members (as httpx pins its
surface): what is exported is a decision, not an accident of imports."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = ["plancache.client.hook", "plancache.torch"]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_and_complete(name):
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
    module = importlib.import_module(name)
    defined = sorted(n for n, v in vars(module).items() if not n.startswith("_") and not inspect.ismodule(v)
                     and getattr(v, "__module__", name) == name and n.upper() != n or n in _constants(module))
    assert module.__all__ == sorted(module.__all__) == defined


def _constants(module):
    """Module-level UPPER_CASE tables the module defines (not imported ones)."""
    source = inspect.getsource(module)
    return {n for n in vars(module) if n.isupper() and f"\n{n}" in source and not n.startswith("_")}


def test_the_spec_module_exports_its_public_surface():
    """``plancache.spec`` exports what users write graphs with and what the docs name; the document's parts,
    vocabulary tables and limits stay importable by plancache's own modules but are not its surface."""
    import plancache.spec as module

    assert module.__all__ == sorted(module.__all__) == [
        "GraphSpec", "SpecBuilder", "TensorRef", "TuningSpec", "channels_last_strides", "contiguous_strides",
        "from_pygraph", "graph_key", "parse_spec",
    ]
    assert all(getattr(module, n).__module__.startswith("plancache.spec.") for n in module.__all__)


@pytest.mark.parametrize("name", ["builder", "document", "keys", "limits", "nodes", "pygraph", "vocabulary"])
def test_each_module_of_the_spec_exports_only_what_it_defines(name):
    module = importlib.import_module(f"plancache.spec.{name}")
    assert module.__all__ == sorted(module.__all__)
    assert all(getattr(module, n).__module__ == module.__name__ for n in module.__all__
               if inspect.isclass(getattr(module, n)) or inspect.isfunction(getattr(module, n)))


def test_the_blob_layer_exports_exactly_what_it_defines():
    """``plancache.blobs`` gathers its sub-modules' public classes, functions and constants: every one is in
    ``__all__`` (sorted), and nothing imported from elsewhere is."""
    import plancache.blobs as module

    public = sorted(n for n, v in vars(module).items() if not n.startswith("_") and not inspect.ismodule(v) and (
        n.isupper() if not callable(v) else getattr(v, "__module__", "").startswith("plancache.blobs")))
    assert module.__all__ == sorted(module.__all__) == public


def test_the_client_exports_what_users_write_code_against():
    """``plancache.client`` exports the cache, its configuration and stats, plans, backends and what a custom ladder
    step is made of; the disk cache, the server calls and verification stay in their own modules."""
    import plancache.client as module

    assert module.__all__ == sorted(module.__all__) == [
        "Backend", "Builds", "ClientConfig", "ClientStats", "GpuBackend", "LADDER", "LoadContext", "MODES", "Pending",
        "Plan", "PlanCache", "Step", "StepName", "StoreStep",
    ]
    assert all(getattr(module, n).__module__.startswith("plancache.client.") for n in module.__all__
               if n not in ("LADDER", "MODES"))
    for internal in ("DiskCache", "Remote", "verify_blob", "REASONS", "family_key"):
        with pytest.raises(AttributeError):
            getattr(module, internal)
