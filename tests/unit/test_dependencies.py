"""The dependencies ``pyproject.toml`` declares match what ``plancache/`` imports (read with ``ast``; nothing is imported).

- Every third-party module ``plancache/`` imports belongs to a distribution declared for the part that imports it:
  the base install (``[project.dependencies]``) for everything, plus the ``server`` extra in ``plancache.server``
  and ``plancache.store``, the ``gpu`` extra in ``plancache.gpu``; elsewhere (client, worker, spec, CLI, ...) an
  extra's module may only be imported where it is used -- inside a function or under ``TYPE_CHECKING``.
- Importing any module outside server/store/gpu (the client, the worker, the CLI's command modules) needs the base
  install only: the modules it imports at import time, transitively, import nothing else third-party.
- Every declared runtime dependency is imported somewhere (or is a driver loaded by name, listed below).
- Imports inside the package flow one way, through the layers of docs/DESIGN.md ("Package map").
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "plancache"

#: Import name -> distribution name, where they differ (or where a name's distribution is not obvious).
DISTRIBUTIONS = {
    "cudnn": "nvidia-cudnn-frontend",
    "yaml": "pyyaml",
    "psycopg": "psycopg",
    "prometheus_client": "prometheus-client",
    "pydantic_settings": "pydantic-settings",
    "sqlalchemy": "sqlalchemy",
    "google.protobuf": "protobuf",
    "PIL": "pillow",
    "dateutil": "python-dateutil",
    "jwt": "pyjwt",
    "nacl": "pynacl",
}

#: Declared dependencies no module imports, each with the text in ``plancache/`` that loads it by name.
LOADED_BY_NAME = {
    "psycopg": ("store/db.py", "postgresql+psycopg"),  # SQLAlchemy's PostgreSQL dialect driver
}

#: What each part of the package may import beyond the base install: (at import time, inside functions).
SERVER_PARTS = ("plancache.server", "plancache.store")
GPU_PARTS = ("plancache.gpu",)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


@cache
def _declared() -> dict[str, frozenset[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"base": frozenset(_requirement_name(r) for r in project["dependencies"])}
    for extra, requirements in project.get("optional-dependencies", {}).items():
        groups[extra] = frozenset(_requirement_name(r) for r in requirements)
    return groups


def _distribution(module: str) -> str:
    for name in (module, module.split(".")[0]):
        if name in DISTRIBUTIONS:
            return DISTRIBUTIONS[name]
    return _normalize(module.split(".")[0])


@dataclass(frozen=True)
class Import:
    file: str           # relative to plancache/
    line: int
    module: str         # absolute dotted name (internal imports resolved)
    at_import: bool     # runs when the importing module is imported (not in a function, TYPE_CHECKING or try/ImportError)
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: never runs

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    @property
    def third_party(self) -> bool:
        return self.top not in sys.stdlib_module_names and self.top not in ("plancache", "__future__")

    def __str__(self) -> str:
        return f"plancache/{self.file}:{self.line} imports {self.module}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


class _Imports(ast.NodeVisitor):
    def __init__(self, file: str, name: str, is_package: bool) -> None:
        self.file = file
        self.name = name
        self.package = name if is_package else name.rpartition(".")[0]
        self.deferred = 0
        self.typing = 0
        self.found: list[Import] = []

    def _add(self, node: ast.stmt, module: str) -> None:
        self.found.append(Import(self.file, node.lineno, module, self.deferred == 0, self.typing > 0))

    def _deferred(self, node: ast.AST) -> None:
        self.deferred += 1
        self.visit(node)
        self.deferred -= 1

    def _body_deferred(self, node: ast.AST) -> None:
        self.deferred += 1
        self.generic_visit(node)
        self.deferred -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _body_deferred

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.typing += 1
            for child in node.body:
                self._deferred(child)
            self.typing -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        guarded = any(_catches_import_error(h) for h in node.handlers if h.type is not None)
        for child in node.body:
            self._deferred(child) if guarded else self.visit(child)
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0:
            self._add(node, node.module or "")
            return
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
        self._add(node, target)
        for alias in node.names:  # ``from . import spec``: a sub-module, when there is one
            sub = f"{target}.{alias.name}"
            if _source(sub) is not None:
                self._add(node, sub)


def _source(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _modules() -> dict[str, tuple[Import, ...]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found[_module_name(path)] = _scan(path.read_text(), str(path.relative_to(PACKAGE)), _module_name(path),
                                          path.name == "__init__.py")
    return found


def _scan(source: str, file: str, name: str, is_package: bool = False) -> tuple[Import, ...]:
    visitor = _Imports(file, name, is_package)
    visitor.visit(ast.parse(source, filename=file))
    return tuple(visitor.found)


def _part(module: str) -> str:
    if module.startswith(tuple(p + "." for p in SERVER_PARTS)) or module in SERVER_PARTS:
        return "server"
    if module.startswith(tuple(p + "." for p in GPU_PARTS)) or module in GPU_PARTS:
        return "gpu"
    return "base"


def _allowed(part: str, at_import: bool) -> frozenset[str]:
    groups = _declared()
    if part != "base":
        return groups["base"] | groups[part]
    return groups["base"] if at_import else groups["base"] | groups["server"] | groups["gpu"]


def _import_time_closure(module: str) -> set[str]:
    """The ``plancache`` modules that importing ``module`` runs (its packages' ``__init__`` included)."""
    modules, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in modules or name not in _modules():
            continue
        modules.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(i.module for i in _modules()[name] if i.at_import and i.top == "plancache")
    return modules


#: The layers of docs/DESIGN.md, "Package map": a module may import from earlier layers and its own part only.
LAYERS = (
    ("plancache", "errors", "settings", "canonical", "files", "validation", "procpool", "_httpx", "digest", "logs"),
    ("spec", "environment", "http"),
    ("protocol",),
    ("signing", "blobs"),
    ("verify",),
    ("bundle", "index", "store", "gpu"),
    ("server", "worker", "client"),
    ("cli", "torch"),
)
#: Modules that belong to another part (__main__ runs cli).
SAME_PART = {"__main__": "cli"}


def _layer_part(module: str) -> tuple[int, str]:
    part = module.split(".")[1] if "." in module else module
    part = SAME_PART.get(part, part)
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i, part
    raise AssertionError(f"{module} is in no layer of LAYERS (docs/DESIGN.md, Package map): add it to both")


def test_internal_imports_flow_one_way():
    problems = []
    for module, imports in _modules().items():
        layer, part = _layer_part(module)
        for imp in imports:
            if imp.top != "plancache" or imp.typing_only:
                continue
            target_layer, target_part = _layer_part(imp.module)
            if target_part != part and target_layer >= layer:
                problems.append(f"{imp}: layer {layer} ({part}) may not import layer {target_layer} ({target_part})")
    assert not problems, "\n".join(problems)


#: The client's modules from the ground up (docs/CLIENT.md, "How the client is built"): each imports only modules of
#: earlier floors, at import time, in a function or for typing alike, so the client has no import cycle.
CLIENT_FLOORS = (
    ("backend", "background", "cache", "capture", "fe_ops", "index_files", "received", "records", "sdpa_ext"),
    ("plan",),
    ("context",),
    ("remote", "revalidate", "siblings", "steps"),
    ("index", "server_step"),
    ("ladder",),
    ("core",),
    ("startup",),
    ("hook",),
    ("boot", "sdpa"),
)


def test_the_client_s_modules_import_down_its_floors_only():
    floor = {f"plancache.client.{name}": i for i, names in enumerate(CLIENT_FLOORS) for name in names}
    client = {m for m in _modules() if m.startswith("plancache.client.")}
    assert client == set(floor), f"list each client module on a floor of CLIENT_FLOORS: {sorted(client ^ set(floor))}"
    problems = [f"{module} (floor {floor[module]}) imports {imp.module} (floor {floor[imp.module]})"
                for module in client for imp in _modules()[module]
                if imp.module in floor and floor[imp.module] >= floor[module]]
    assert not problems, "\n".join(problems)


_SAMPLE = """
from __future__ import annotations
import json
from typing import TYPE_CHECKING
import httpx.auth
from .. import spec
from ..store import Store
from .cache import DiskCache
if TYPE_CHECKING:
    from ..server import app
try:
    import yaml
except ImportError:
    yaml = None
def f():
    import torch
class C:
    import rich
"""


def test_the_scan_resolves_imports_and_tells_when_they_run():
    found = {(i.module, i.at_import, i.typing_only) for i in _scan(_SAMPLE, "client/sample.py", "plancache.client.sample")}
    assert found == {
        ("__future__", True, False), ("json", True, False), ("typing", True, False), ("httpx.auth", True, False),
        ("plancache", True, False), ("plancache.spec", True, False), ("plancache.store", True, False),
        ("plancache.client.cache", True, False),
        ("plancache.server", False, True), ("plancache.server.app", False, True),  # TYPE_CHECKING: never runs
        ("yaml", False, False),  # guarded by ImportError: optional
        ("torch", False, False),  # in a function: when called
        ("rich", True, False),  # a class body runs at import
    }
    imports = {i.module: i for i in _scan(_SAMPLE, "client/sample.py", "plancache.client.sample")}
    assert imports["httpx.auth"].third_party and not imports["json"].third_party and not imports["plancache"].third_party
    assert _distribution("cudnn.graph_types") == "nvidia-cudnn-frontend" and _distribution("yaml") == "pyyaml"
    assert _requirement_name("psycopg[binary]>=3.1") == "psycopg" and _requirement_name("Prometheus_Client>=0.2") == \
        "prometheus-client"
    modules = _modules()
    assert {"plancache.client.core", "plancache.server.app", "plancache.gpu.fegraph", "plancache.cli"} <= set(modules)
    assert any(i.module == "prometheus_client" and i.at_import for i in modules["plancache.server.metrics"])


def test_every_third_party_import_is_declared_for_its_part():
    groups = _declared()
    runtime = groups["base"] | groups.get("server", frozenset()) | groups.get("gpu", frozenset())
    problems = []
    for module, imports in _modules().items():
        for imp in imports:
            if not imp.third_party:
                continue
            dist = _distribution(imp.module)
            allowed = _allowed(_part(module), imp.at_import)
            if dist not in allowed:
                where = [g for g, names in groups.items() if dist in names]
                when = "at import time" if imp.at_import else "deferred"
                problems.append(f"{imp} ({when}): distribution {dist!r} is declared in {', '.join(where)} only, "
                                f"not for this part of the package" if dist in runtime else
                                f"{imp} ({when}): distribution {dist!r} is not declared (declare it in "
                                f"pyproject.toml, or drop the import)")
    assert not problems, "\n".join(problems)


def test_modules_outside_server_store_and_gpu_import_with_the_base_install():
    base = _declared()["base"]
    problems = []
    for root in (m for m in _modules() if _part(m) == "base"):
        for module in sorted(_import_time_closure(root)):
            if _part(module) != "base":
                problems.append(f"importing {root} imports {module}")
                continue
            problems += [f"importing {root} runs {imp}, of {_distribution(imp.module)!r} (not in the base install)"
                         for imp in _modules()[module]
                         if imp.at_import and imp.third_party and _distribution(imp.module) not in base]
    assert not problems, "\n".join(sorted(set(problems)))


def test_every_declared_runtime_dependency_is_imported():
    groups = _declared()
    imported = {_distribution(i.module) for imports in _modules().values() for i in imports if i.third_party}
    for extra in ("base", "server", "gpu"):
        unused = groups[extra] - imported - set(LOADED_BY_NAME)
        assert not unused, f"declared in {extra} but imported nowhere in plancache/: {sorted(unused)}"
    for dist, (file, text) in LOADED_BY_NAME.items():
        assert dist in groups["base"] | groups["server"] | groups["gpu"], dist
        assert text in (PACKAGE / file).read_text(), f"{dist} is said to be loaded as {text!r} by plancache/{file}"


def test_the_dev_extra_is_not_a_runtime_dependency():
    groups = _declared()
    imported = {_distribution(i.module) for imports in _modules().values() for i in imports if i.third_party}
    assert not (imported & (groups["dev"] - groups["base"] - groups["server"] - groups["gpu"]))


@pytest.mark.parametrize("name", sorted({i.top for imports in _modules().values() for i in imports if i.third_party}))
def test_import_names_map_to_the_installed_distribution(name):
    """Where the module is installed here, its distribution per the installed metadata is the one assumed above."""
    installed = importlib.metadata.packages_distributions().get(name)
    if not installed:
        pytest.skip(f"{name} is not installed here")
    assert _distribution(name) in {_normalize(d) for d in installed}


def test_the_blob_layer_has_no_sql_json_or_base64_and_imports_no_store_server_or_client():
    """plancache.blobs is bytes by digest only: the records, the catalog and their encodings are elsewhere."""
    imported = {i.module for name, imports in _modules().items() if name.startswith("plancache.blobs") for i in imports}
    assert imported, "plancache.blobs was not scanned"
    forbidden = {m for m in imported if m.split(".")[0] in ("sqlalchemy", "json", "base64")
                 or m.startswith(("plancache.store", "plancache.server", "plancache.client"))}
    assert not forbidden, sorted(forbidden)
