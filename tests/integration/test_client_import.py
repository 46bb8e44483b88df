"""Importing the client costs next to nothing: a fresh interpreter that imports it (and reads its names, and imports
the hook and ``plancache.torch``) loads none of the heavy modules the first :class:`PlanCache` made brings in, nor any
of the server's or the GPU's. A module that appears here grew the client's import (issue 27: it was 0.4 s on a GPU
host, against 15-20 ms for ``import cudnn``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Top-level packages that must stay out of ``sys.modules`` until a PlanCache is made (or forever, for the client).
DEFERRED = ("httpx", "httpcore", "h2", "anyio", "click", "rich", "pygments", "cryptography", "pydantic",
            "pydantic_core", "pydantic_settings", "annotated_types", "sqlalchemy", "fastapi", "starlette",
            "uvicorn", "torch", "cudnn", "numpy", "yaml", "asyncio", "email", "ssl")
#: plancache's own modules that must stay out: the wire protocol's models, the signature checks, the settings,
#: the HTTP client, the spec's models and the disk cache all come with the first PlanCache.
DEFERRED_OWN = ("plancache.protocol", "plancache.signing", "plancache.settings", "plancache.http",
                "plancache.spec", "plancache.environment", "plancache.validation", "plancache.client.cache",
                "plancache.client.remote", "plancache.client.revalidate", "plancache.client.server_step",
                "plancache.client.records", "plancache.server", "plancache.store",
                "plancache.gpu", "plancache.worker")

STATEMENTS = [
    "import plancache.client",
    "from plancache.client import PlanCache, Plan, ClientConfig, LoadContext, StoreStep",
    "import plancache.client as c; [getattr(c, n) for n in c.__all__]",
    "import plancache.client.hook",
    "import plancache.torch",
]


def _loaded_after(statement: str) -> list[str]:
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("statement", STATEMENTS)
def test_importing_the_client_loads_none_of_what_the_first_plan_cache_needs(statement):
    loaded = _loaded_after(statement)
    heavy = sorted(m for m in loaded if m.split(".")[0] in DEFERRED or m.startswith(DEFERRED_OWN))
    assert not heavy, f"{statement!r} imported {heavy}"


def test_every_exported_name_is_read_from_its_module():
    """The lazy names are the modules' own objects, listed once, and ``dir`` shows them."""
    import plancache.client as client
    from plancache.client import backend, core, plan, steps

    assert client.PlanCache is core.PlanCache and client.Plan is plan.Plan and client.StoreStep is steps.StoreStep
    assert client.GpuBackend is backend.GpuBackend
    assert set(client.__all__) <= set(dir(client))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = client.nothing  # type: ignore[attr-defined]


def test_the_first_plan_cache_brings_in_what_it_needs(tmp_path):
    """The deferred imports happen, and work, when a PlanCache is made (a server URL: the HTTP client too)."""
    code = (
        "import sys\n"
        "from plancache.client import PlanCache\n"
        "from tests.client_fakes import RecordingBackend\n"
        f"PlanCache('http://127.0.0.1:9', backend=RecordingBackend(), cache_dir={str(tmp_path)!r}, trusted_keys=[]).close()\n"
        "print(' '.join(m for m in ('httpx', 'pydantic', 'cryptography', 'plancache.protocol') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["httpx", "pydantic", "cryptography", "plancache.protocol"]


def test_the_http_client_comes_without_httpx_s_command_line():
    """httpx's CLI module (click, rich, pygments) is skipped when plancache imports httpx, and can still be imported
    later by whoever wants it."""
    code = (
        "import sys\n"
        "import plancache.http\n"
        "print(' '.join(m for m in ('httpx', 'httpx._main', 'click', 'rich', 'pygments') if m in sys.modules))\n"
        "import httpx._main\n"
        "print(callable(httpx._main.main))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.splitlines()
    assert out == ["httpx", "True"]


def test_a_process_that_imported_httpx_first_keeps_it_whole():
    code = ("import httpx, sys\nimport plancache.http\n"
            "print('httpx._main' in sys.modules, httpx.main is sys.modules['httpx._main'].main)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["True", "True"]


def test_the_gpu_backend_s_imports_leave_the_tuning_modules_out():
    """A client loads plans through :mod:`plancache.gpu` (handle, deserialize, builds); the autotuner, its builder
    processes and timing load on first use of ``gpu.autotune`` (they were 27 ms and 6,700 objects of the client's
    start-up on the 2-core development machine; the deserialize path alone is 4 ms)."""
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (pip install -e '.[gpu]')")
    code = (
        "import sys\n"
        "from plancache import gpu\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('plancache.gpu.', 'plancache.procpool', "
        "'plancache.settings', 'plancache.protocol')))))\n"
        "from plancache.gpu import tune\n"
        "print(gpu.autotune is tune.autotune, gpu.TunedPlan is tune.TunedPlan, 'autotune' in dir(gpu))\n"
    )
    first, second = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                   text=True).stdout.splitlines()[-2:]
    assert first.split() == ["plancache.gpu.families", "plancache.gpu.fegraph", "plancache.gpu.reference",
                             "plancache.gpu.runtime"]
    assert second == "True True True"
    from plancache import gpu

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = gpu.nothing  # type: ignore[attr-defined]


def test_the_first_plan_cache_builds_the_client_s_settings_alone(tmp_path):
    """Settings classes are built when first instantiated: a PlanCache builds ClientSettings (which still reads the
    environment), none of the other roles' classes."""
    code = (
        "import sys\n"
        "from plancache.client import PlanCache\n"
        "from tests.client_fakes import RecordingBackend\n"
        f"c = PlanCache(backend=RecordingBackend(), cache_dir={str(tmp_path)!r}, trusted_keys=[])\n"
        "from plancache import settings\n"
        "built = [n for n, v in vars(settings).items() if isinstance(v, type) and issubclass(v, settings.BaseSettings)\n"
        "         and v is not settings.BaseSettings and v.__dict__.get('__pydantic_complete__')]\n"
        "print(c.request_deadline, ' '.join(sorted(built)))\n"
        "c.close()\n"
    )
    env = {**os.environ, "PLANCACHE_REQUEST_DEADLINE": "2.5", "PLANCACHE_SERVER_URL": ""}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    assert out.split() == ["2.5", "ClientSettings"]
