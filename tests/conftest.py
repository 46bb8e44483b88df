"""Shared fixtures for store and server tests.

- ``db_url``: a fresh, migrated-nothing database URL, parametrized over ``sqlite`` (a file in
  ``tmp_path``) and ``postgres`` (a uniquely named database created through the admin URL in
  ``PLANCACHE_TEST_POSTGRES_URL`` and dropped afterwards). Without a reachable Postgres the
  postgres case is skipped, or fails when the environment variable ``CI`` is set.
- ``clock``: a :class:`FakeClock` (starts at the real current time, moves only when told).
- ``blob_store_url``: ``database``; in modules marked ``both_blob_stores`` also a ``file://`` folder
  under ``tmp_path`` and an ``s3://`` bucket of moto's S3 server (each test that uses it runs once per blob store).
- ``moto_s3``, ``s3_blob_url``: S3 through moto's standalone server (:mod:`tests.s3_util`).
- ``store``: ``open_store(db_url, create=True, clock=clock, blob_store=blob_store_url)``, closed afterwards.
- ``file_store``: a SQLite store under ``tmp_path`` whose blobs are files in ``tmp_path / "blobs"``, closed afterwards.
- ``gpu_env``: :data:`tests.factories.H200`.
- ``make_spec(i)``: a small valid spec dict, distinct for each ``i``, and its graph key.
- ``make_plan(graph_key, env, blob=…, worker_id=…)``: a :class:`~plancache.protocol.PlanMeta`
  consistent with ``blob`` (digest and size; :func:`tests.factories.make_meta`), and the blob.

Tests that need both databases take ``db_url`` or ``store``; ``-m "not postgres"`` runs SQLite only.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from .s3_util import moto_s3, s3_blob_url  # noqa: F401 (fixtures)

DEFAULT_POSTGRES_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

# Tests write only to temporary folders, whatever the shell exports: no PLANCACHE_* setting of the developer's
# leaks in (PLANCACHE_TEST_* excepted), and the two defaults that name a place, ./plancache.db in the working
# directory and ~/.cache/plancache, point into one scratch folder for the run (child processes inherit it).
for _name in [n for n in os.environ if n.upper().startswith("PLANCACHE_") and not n.upper().startswith("PLANCACHE_TEST_")]:
    del os.environ[_name]
SCRATCH = tempfile.mkdtemp(prefix="plancache-tests-")
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)
os.environ["PLANCACHE_DATABASE_URL"] = f"sqlite:///{os.path.join(SCRATCH, 'default.db')}"
os.environ["PLANCACHE_CACHE_DIR"] = os.path.join(SCRATCH, "cache")


def pytest_configure(config: pytest.Config) -> None:
    """pydantic's false alarm about FastAPI's model parameters, filtered as the server filters it
    (:data:`plancache.server.app.BODY_ALIAS_WARNING`): pytest resets the filters a module set at its import."""
    try:
        from plancache.server.app import BODY_ALIAS_WARNING
    except ImportError:  # the server extra is not installed: no server test runs
        return
    config.addinivalue_line("filterwarnings", f"ignore:{BODY_ALIAS_WARNING}:UserWarning")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``PLANCACHE_TEST_FAILURE_LOG`` set, each failure is appended to that file as it happens (its test id,
    phase and the end of its report): a run stopped by a time limit, as a lent GPU's calls are, still says why each
    test before the stop failed, where pytest's own summary comes only at the end."""
    path = os.environ.get("PLANCACHE_TEST_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")


class FakeClock:
    """A settable clock for the store: ``clock()`` is now; ``clock.advance(seconds)`` moves it."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    """The admin URL of a reachable Postgres (skip, or fail under CI, when there is none)."""
    import sqlalchemy as sa

    from plancache.store.db import normalize_url

    url = normalize_url(os.environ.get("PLANCACHE_TEST_POSTGRES_URL", DEFAULT_POSTGRES_ADMIN_URL))
    engine = sa.create_engine(url, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except sa.exc.OperationalError as exc:
        message = f"PostgreSQL at {url.render_as_string(hide_password=True)} is unreachable: {exc.orig}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: Postgres is required)")
        pytest.skip(message)
    finally:
        engine.dispose()
    return url.render_as_string(hide_password=False)


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty Postgres database, dropped (connections terminated) after the test."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = f"plancache_test_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield make_url(postgres_admin_url).set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """An empty database: a SQLite file under ``tmp_path``, or a fresh Postgres database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'plancache.db'}"
    return request.getfixturevalue("postgres_url")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "blob_store_url" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_blob_stores"):
        metafunc.parametrize("blob_store_url", ["database", "file", "s3"], indirect=True)


@pytest.fixture
def blob_store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A ``PLANCACHE_BLOB_STORE`` value: ``database``, or (parametrized) a folder under ``tmp_path`` (``file``) or a
    fresh bucket of moto's S3 server (``s3``)."""
    kind = getattr(request, "param", "database")
    if kind == "s3":
        return str(request.getfixturevalue("s3_blob_url"))
    return (tmp_path / "blobs").as_uri() if kind == "file" else "database"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db_url: str, clock: FakeClock, blob_store_url: str) -> Iterator[Any]:
    """A migrated :class:`plancache.store.Store` on ``db_url`` and ``blob_store_url`` whose time is ``clock``."""
    from plancache.store import open_store

    s = open_store(db_url, create=True, clock=clock, blob_store=blob_store_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def file_store(tmp_path: Any) -> Iterator[Any]:
    from plancache.store import open_store

    s = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}", create=True, blob_store=(tmp_path / "blobs").as_uri())
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def gpu_env() -> Any:
    from .factories import H200

    return H200


def _spec(i: int) -> dict[str, Any]:
    from plancache.spec import SpecBuilder

    b = SpecBuilder(io_data_type="bfloat16", name=f"matmul_relu_{i}")
    a = b.tensor("A", dim=[1, 16 + i, 64])
    w = b.tensor("B", dim=[1, 64, 32])
    b.relu(b.matmul(a, w)).set_output(True).set_name("Y")
    return b.build().to_json()


@pytest.fixture
def make_spec() -> Callable[[int], tuple[str, dict[str, Any]]]:
    """``make_spec(i) -> (graph_key, spec_dict)``: a valid matmul+relu spec, different for each ``i >= 0``."""
    from plancache.spec import graph_key

    def make(i: int = 0) -> tuple[str, dict[str, Any]]:
        spec = _spec(i)
        return graph_key(spec), spec

    return make


@pytest.fixture
def make_plan() -> Callable[..., tuple[Any, bytes]]:
    """``make_plan(graph_key, env, blob=b"…", worker_id="w1", **overrides) -> (PlanMeta, blob)``: an unsigned record
    whose revision is above that of every record made before in the test (so a later one may replace an earlier)."""
    from plancache.protocol import PlanMeta

    from .factories import make_meta

    revisions = itertools.count(1)

    def make(graph_key: str, env: Any, blob: bytes = b"serialized-plan", worker_id: str = "w1",
             **overrides: Any) -> tuple[PlanMeta, bytes]:
        fields = {"revision": next(revisions), "worker_id": worker_id, **overrides}
        return make_meta(graph_key, env, blob, **fields), blob

    return make
