"""The CLI's conventions (plancache/cli/failures.py, docs/CLI.md): every expected failure is an ``error:`` line and a
``hint:`` line with the exit code of its class, never a traceback; options take their defaults from the settings
of the command's role; every option has help. Each case below was found on a fresh clone."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from plancache import __version__
from plancache.cli import COMMAND_MODULES, make_app
from plancache.cli.failures import EXIT_CODE_MEANINGS, ExitCode, command
from plancache.settings import (
    AdminSettings,
    ClientSettings,
    ServerSettings,
    Settings,
    StoreSettings,
    WorkerSettings,
    env_name,
)
from plancache.signing import keygen
from plancache.store import open_store
from tests.gpu_util import gpu_skip_reason
from tests.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "conv_bias_relu.json"
SERVER_EXTRA = ["fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg", "prometheus_client"]
GPU_EXTRA = ["cudnn", "torch"]

#: Runs the CLI with some top-level modules made unimportable, as on an install without their extra.
_WITHOUT = """
import importlib.abc, sys
blocked = set({blocked!r})
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = ["plancache", *{args!r}]
from plancache.cli import main
main()
"""


def plancache(*args: str, cwd: Path, env: dict[str, str] | None = None, without: list[str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m plancache ARGS`` in a fresh process (``without``: those modules cannot be imported)."""
    cmd = [sys.executable, "-c", _WITHOUT.format(blocked=without, args=list(args))] if without else \
        [sys.executable, "-m", "plancache", *args]
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def expected_failure(proc: Any, code: ExitCode, *phrases: str) -> str:
    """The output of a run that failed as the convention says: ``code``, one ``error:`` line and at most one
    ``hint:`` line, no traceback, every phrase present."""
    out = proc.stderr if hasattr(proc, "stderr") and isinstance(proc, subprocess.CompletedProcess) else proc.output
    rc = proc.returncode if isinstance(proc, subprocess.CompletedProcess) else proc.exit_code
    assert rc == code, f"exit {rc}, not {code.value} ({code.name}):\n{out}"
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), out
    assert len(lines) == 1 or lines[1].startswith("hint: "), out
    for phrase in phrases:
        assert phrase in out, f"{phrase!r} not in:\n{out}"
    return out


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.db'}"


def _commands(group: Any, path: str = "") -> list[tuple[str, Any]]:
    found = []
    for name, cmd in getattr(group, "commands", {}).items():
        found.append((f"{path} {name}".strip(), cmd))
        found += _commands(cmd, f"{path} {name}")
    return found


# ------------------------------------------------------------------------------------------------ conventions


def test_exit_codes_are_documented_in_docs_cli_md():
    text = (ROOT / "docs" / "CLI.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.+?) \|$", text, flags=re.MULTILINE)
    assert {int(code): (name, meaning) for code, name, meaning in rows} == \
        {int(c): (c.name, EXIT_CODE_MEANINGS[c]) for c in ExitCode}
    assert set(EXIT_CODE_MEANINGS) == set(ExitCode)
    assert len({int(c) for c in ExitCode}) == len(ExitCode)


def test_every_command_runs_inside_the_failure_handler_and_every_parameter_has_help():
    root = typer.main.get_command(make_app())
    commands = _commands(root)
    assert {"serve", "db upgrade", "token create", "plans gc", "bundle export", "spec key", "tune", "worker",
            "enqueue", "keygen"} <= {name for name, _ in commands}
    for name, cmd in commands:
        if getattr(cmd, "commands", None):  # a group
            continue
        assert getattr(cmd.callback, "handles_failures", False), f"`plancache {name}` is not decorated with @command"
        for param in cmd.params:
            assert getattr(param, "help", None), f"`plancache {name}`: {param.name} has no help text"
            assert not getattr(param, "envvar", None), \
                f"`plancache {name}`: {param.name} reads {param.envvar} itself; take the default from the settings"


def test_help_shows_flags_as_flags():
    """A boolean flag takes no value (``--once true`` is an error), so ``--help`` shows no ``<bool>`` after it."""
    root = typer.main.get_command(make_app())
    runner = CliRunner()
    for name, cmd in _commands(root):
        if getattr(cmd, "commands", None):
            continue
        result = runner.invoke(make_app(), [*name.split(), "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (name, result.output)
        assert "<bool>" not in result.output, f"`plancache {name} --help` shows a flag as <bool>"


def test_the_fe_examples_say_they_need_a_gpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "examples/fe/run_gpu.py"], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == ExitCode.GPU and "Traceback" not in proc.stderr, proc.stderr
    assert "torch sees none here" in proc.stderr and "hint: " in proc.stderr


def test_commands_live_in_modules_named_after_them():
    for name, cmd in _commands(typer.main.get_command(make_app())):
        if getattr(cmd, "commands", None):
            continue
        module = cmd.callback.__wrapped__.__module__
        assert module == f"plancache.cli.{name.split()[0]}_cmds", f"`plancache {name}` is defined in {module}"
    assert len(COMMAND_MODULES) == len(set(COMMAND_MODULES))


def test_cli_modules_import_no_private_name_of_another():
    for path in (ROOT / "plancache" / "cli").glob("*.py"):
        for line in path.read_text().splitlines():
            m = re.match(r"\s*from \.(\w+) import (.+)", line)
            if m:
                assert not any(n.strip().startswith("_") for n in m.group(2).strip("()").split(",")), f"{path.name}: {line}"


def test_version():
    result = CliRunner().invoke(make_app(), ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"plancache {__version__}"


def test_an_unexpected_exception_is_an_internal_error_with_its_traceback():
    app = typer.Typer()

    @app.command()
    @command
    def broken() -> None:
        raise RuntimeError("boom")

    result = CliRunner().invoke(app, [])
    assert result.exit_code == ExitCode.INTERNAL
    assert "Traceback" in result.output and "RuntimeError: boom" in result.output and "bug" in result.output


def test_tests_write_only_to_temporary_folders():
    """tests/conftest.py points the settings that name a place into a scratch folder (the run used to leave
    ./plancache.db in the checkout: tests/integration/test_schemathesis.py's app on the default database URL)."""
    import tempfile

    settings = Settings()
    scratch = Path(tempfile.gettempdir())
    assert Path(settings.database_url.removeprefix("sqlite:///")).is_relative_to(scratch)
    assert settings.cache_dir.is_relative_to(scratch)


# ------------------------------------------------------------------------------------------------ settings


def test_settings_are_grouped_by_role_and_keep_every_variable():
    names = {env_name(f) for f in Settings.model_fields}
    assert {"PLANCACHE_DATABASE_URL", "PLANCACHE_BLOB_STORE", "PLANCACHE_ADMIN_TOKEN", "PLANCACHE_OPEN_READS",
            "PLANCACHE_MAX_BLOB_BYTES", "PLANCACHE_MAX_REQUEST_BYTES", "PLANCACHE_MAX_RESOLVE_KEYS",
            "PLANCACHE_LEASE_SECONDS", "PLANCACHE_JOB_MAX_ATTEMPTS", "PLANCACHE_SERVER_URL", "PLANCACHE_TOKEN",
            "PLANCACHE_SIGNING_KEY", "PLANCACHE_TRUSTED_KEYS", "PLANCACHE_CACHE_DIR", "PLANCACHE_CONNECT_TIMEOUT",
            "PLANCACHE_READ_TIMEOUT", "PLANCACHE_INSECURE_ALLOW_UNSIGNED", "PLANCACHE_REQUEST_DEADLINE",
            "PLANCACHE_RESOLVE_MAX_BYTES", "PLANCACHE_CACHE_MAX_BYTES", "PLANCACHE_CACHE_MAX_AGE_DAYS"} <= names
    roles = (ServerSettings, WorkerSettings, ClientSettings, AdminSettings)
    assert set(Settings.model_fields) == set().union(*(r.model_fields for r in roles))
    assert "signing_key" in WorkerSettings.model_fields and "signing_key" not in ClientSettings.model_fields
    assert "open_reads" in ServerSettings.model_fields and "server_url" not in ServerSettings.model_fields
    assert "trusted_keys" in ServerSettings.model_fields  # a withdrawal is stored only when they verify it
    assert "database_url" not in WorkerSettings.model_fields
    assert set(StoreSettings.model_fields) <= set(ServerSettings.model_fields)


def test_a_bad_variable_of_another_role_does_not_stop_a_command(sqlite_url, monkeypatch):
    monkeypatch.setenv("PLANCACHE_READ_TIMEOUT", "soon")  # a client setting
    monkeypatch.setenv("PLANCACHE_DATABASE_URL", sqlite_url)
    result = CliRunner().invoke(make_app(), ["db", "upgrade"])
    assert result.exit_code == 0, result.output


def test_a_bad_variable_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PLANCACHE_OPEN_READS", "maybe")
    result = CliRunner().invoke(make_app(), ["serve", "--port", str(free_port())])
    out = expected_failure(result, ExitCode.CONFIG, "PLANCACHE_OPEN_READS='maybe'", "valid boolean")
    assert "open_reads" not in out.replace("PLANCACHE_OPEN_READS", "")


def test_serve_with_a_bad_variable_in_a_fresh_process(tmp_path, sqlite_url):
    proc = plancache("serve", "--port", str(free_port()), cwd=tmp_path,
                     env={"PLANCACHE_OPEN_READS": "maybe", "PLANCACHE_DATABASE_URL": sqlite_url})
    expected_failure(proc, ExitCode.CONFIG, "PLANCACHE_OPEN_READS")


def test_the_signing_key_setting_is_the_workers_default(tmp_path, monkeypatch):
    """PLANCACHE_SIGNING_KEY is read through WorkerSettings: a key file that is not there is named."""
    monkeypatch.setenv("PLANCACHE_SIGNING_KEY", str(tmp_path / "absent.key"))
    result = CliRunner().invoke(make_app(), ["worker", "--server", "http://127.0.0.1:9", "--token", "t"])
    expected_failure(result, ExitCode.OS_ERROR, str(tmp_path / "absent.key"), "PLANCACHE_SIGNING_KEY")


# ------------------------------------------------------------------------------------------------ missing extras


def test_tune_without_a_gpu_says_so_in_two_lines(tmp_path):
    """torch is installed but sees no device: the GPU failure alone (no torch warning about numpy before it)."""
    pytest.importorskip("torch")
    proc = plancache("tune", str(EXAMPLE), "--out", str(tmp_path / "tuned"), cwd=tmp_path,
                     env={"CUDA_VISIBLE_DEVICES": ""})
    expected_failure(proc, ExitCode.GPU, "torch sees no CUDA device")


def test_tune_without_the_gpu_extra(tmp_path):
    proc = plancache("tune", str(EXAMPLE), "--out", str(tmp_path / "tuned"), cwd=tmp_path, without=GPU_EXTRA)
    expected_failure(proc, ExitCode.MISSING_EXTRA, "pip install 'plancache[gpu]'", "No module named")
    assert not (tmp_path / "tuned").exists()


def test_output_into_a_reader_that_stops_is_a_quiet_exit_141(tmp_path):
    """``plancache … | head -1``: the reader goes away; the command stops with 141, as a program SIGPIPE ends, not
    "error: Broken pipe" with a hint to check a path (exit 5)."""
    example = (ROOT / "examples" / "conv_bias_relu.json").read_text()
    for i in range(1500):  # ~130 kB of output: more than a pipe holds
        (tmp_path / f"g{i}.json").write_text(example)
    files = sorted(str(f) for f in tmp_path.glob("g*.json"))
    proc = subprocess.Popen([sys.executable, "-m", "plancache", "spec", "key", *files], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()  # the first line, as head -1 reads it
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == ExitCode.BROKEN_PIPE, err
    assert err == "", err


def test_worker_without_the_gpu_extra(tmp_path):
    """docs/CLI.md: a missing extra is exit 4 (MISSING_EXTRA), for the worker as for tune and --all-devices."""
    (tmp_path / "k").mkdir()
    assert plancache("keygen", "k", cwd=tmp_path).returncode == 0
    proc = plancache("worker", "--server", "http://127.0.0.1:9", "--token", "t", "--signing-key", "k/plancache.key",
                     "--spool-dir", str(tmp_path / "spool"), "--once", cwd=tmp_path, without=GPU_EXTRA)
    expected_failure(proc, ExitCode.MISSING_EXTRA, "pip install 'plancache[gpu]'", "No module named")


def test_serve_takes_the_database_url_as_an_option(tmp_path):
    db = tmp_path / "given.db"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "plancache", "serve", "--port", str(port), "--database-url",
                             f"sqlite:///{db}"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")})
    try:
        assert proc.stderr is not None
        line = ""
        while "listening on" not in line and proc.poll() is None:  # uvicorn's own INFO lines come first
            line = proc.stderr.readline()
        assert str(db) in line and f"listening on http://127.0.0.1:{port}" in line, line
    finally:
        proc.terminate()
        proc.wait(15)


def test_a_bad_blob_store_setting_is_named(tmp_path, sqlite_url):
    proc = plancache("token", "list", cwd=tmp_path,
                     env={"PLANCACHE_DATABASE_URL": sqlite_url, "PLANCACHE_BLOB_STORE": "bogus:/x"})
    out = expected_failure(proc, ExitCode.CONFIG, "PLANCACHE_BLOB_STORE", "file:///absolute/path")
    assert "PLANCACHE_DATABASE_URL" not in out


def test_a_short_admin_token_is_refused_before_serving(tmp_path, sqlite_url):
    proc = plancache("serve", "--port", str(free_port()), cwd=tmp_path,
                     env={"PLANCACHE_DATABASE_URL": sqlite_url, "PLANCACHE_ADMIN_TOKEN": "x"})
    expected_failure(proc, ExitCode.CONFIG, "PLANCACHE_ADMIN_TOKEN", "is 1 characters; use at least 16")


def test_the_example_files_placeholder_admin_token_is_refused_before_serving(tmp_path, sqlite_url):
    proc = plancache("serve", "--port", str(free_port()), cwd=tmp_path,
                     env={"PLANCACHE_DATABASE_URL": sqlite_url, "PLANCACHE_ADMIN_TOKEN": "REPLACE-WITH-A-LONG-RANDOM-TOKEN"})
    expected_failure(proc, ExitCode.CONFIG, "PLANCACHE_ADMIN_TOKEN", "placeholder of an example file")


def test_a_spec_file_that_is_not_there_is_an_os_error_with_a_hint(tmp_path):
    expected_failure(plancache("spec", "key", "missing.json", cwd=tmp_path), ExitCode.OS_ERROR, "missing.json",
                     "hint: check the path")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    expected_failure(plancache("spec", "key", "binary.json", cwd=tmp_path), ExitCode.USAGE, "not UTF-8", "hint: ")


def test_a_spec_file_over_the_limit_or_endless_is_refused_without_reading_it_all(tmp_path):
    """Before: a spec file was read whole: a 10 GB file given by mistake or /dev/zero took all memory, a FIFO without
    a writer hung. Now one over the server's default JSON body limit is refused naming its size and the limit."""
    from plancache.settings import DEFAULT_MAX_JSON_BYTES

    (tmp_path / "big.json").write_text(EXAMPLE.read_text() + " " * DEFAULT_MAX_JSON_BYTES)
    size = (tmp_path / "big.json").stat().st_size
    expected_failure(plancache("spec", "key", "big.json", cwd=tmp_path), ExitCode.OS_ERROR,
                     f"cannot read the spec file big.json: {size} bytes, over the limit of {DEFAULT_MAX_JSON_BYTES}")
    expected_failure(plancache("spec", "key", "/dev/zero", cwd=tmp_path, timeout=60), ExitCode.OS_ERROR,
                     f"/dev/zero: more than {DEFAULT_MAX_JSON_BYTES} bytes, over the limit")
    os.mkfifo(tmp_path / "fifo.json")                 # no writer: read as empty, not waited for
    expected_failure(plancache("spec", "key", "fifo.json", cwd=tmp_path, timeout=60), ExitCode.FAILED,
                     "fifo.json: spec is not valid JSON")
    proc = plancache("tune", "big.json", "--out", "x", cwd=tmp_path, without=GPU_EXTRA)
    expected_failure(proc, ExitCode.OS_ERROR, f"big.json: {size} bytes, over the limit")


def test_an_environment_file_over_the_limit_endless_or_not_utf8_is_a_usage_error(tmp_path):
    """``--environment FILE`` is read as a spec file is (at most the default JSON limit, a FIFO not waited on); a file
    that is not UTF-8 was a UnicodeDecodeError no handler caught."""
    from plancache.cli.failures import Failure
    from plancache.cli.inputs import load_environment
    from plancache.settings import DEFAULT_MAX_JSON_BYTES

    big = tmp_path / "env.json"
    big.write_bytes(b" " * (DEFAULT_MAX_JSON_BYTES + 1))
    (tmp_path / "latin1.json").write_bytes(b'{"gpu": "caf\xe9"}')
    os.mkfifo(tmp_path / "fifo.json")
    for path, said in ((big, f"{DEFAULT_MAX_JSON_BYTES + 1} bytes, over the limit of {DEFAULT_MAX_JSON_BYTES} bytes"),
                       ("/dev/zero", f"more than {DEFAULT_MAX_JSON_BYTES} bytes, over the limit"),
                       (tmp_path / "latin1.json", "can't decode byte 0xe9"),
                       (tmp_path / "fifo.json", "not an environment")):
        with pytest.raises(Failure) as failure:
            load_environment(str(path), "--environment")
        assert failure.value.code == ExitCode.USAGE and said in failure.value.problem, failure.value.problem


def test_tune_checks_its_arguments_before_it_needs_the_gpu_extra(tmp_path):
    proc = plancache("tune", str(EXAMPLE), cwd=tmp_path, without=GPU_EXTRA)
    expected_failure(proc, ExitCode.USAGE, "--out DIR, --server URL")
    proc = plancache("tune", str(tmp_path / "missing.json"), "--out", "x", cwd=tmp_path, without=GPU_EXTRA)
    expected_failure(proc, ExitCode.OS_ERROR, "missing.json")


@pytest.mark.parametrize("args", [["serve"], ["token", "list"], ["db", "upgrade"]], ids=" ".join)
def test_server_commands_without_the_server_extra(tmp_path, sqlite_url, args):
    proc = plancache(*args, cwd=tmp_path, without=SERVER_EXTRA, env={"PLANCACHE_DATABASE_URL": sqlite_url})
    expected_failure(proc, ExitCode.MISSING_EXTRA, "pip install 'plancache[server]'")


def test_client_commands_need_no_extra(tmp_path):
    proc = plancache("spec", "key", str(EXAMPLE), cwd=tmp_path, without=SERVER_EXTRA + GPU_EXTRA)
    assert proc.returncode == 0 and len(proc.stdout.split()[0]) == 64, proc.stderr
    proc = plancache("keygen", "keys", cwd=tmp_path, without=SERVER_EXTRA + GPU_EXTRA)
    assert proc.returncode == 0 and (tmp_path / "keys" / "plancache.key").exists(), proc.stderr


# ------------------------------------------------------------------------------------------------ files and database


def test_unwritable_spool_or_cache_folder(tmp_path):
    """In process, so without plancache.cli.main's filter of torch's warning when numpy is absent (the worker
    imports torch; run alone with ``-p no:warnings``, the warning reached stderr): filtered here as main does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        _unwritable_spool_or_cache_folder(tmp_path)


def _unwritable_spool_or_cache_folder(tmp_path: Path) -> None:
    key = tmp_path / "w.key"
    assert CliRunner().invoke(make_app(), ["keygen", str(tmp_path), "--name", "w"]).exit_code == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = ["worker", "--server", "http://127.0.0.1:9", "--token", "t", "--signing-key", str(key)]
    result = CliRunner().invoke(make_app(), [*args, "--spool-dir", str(blocker / "spool")])
    expected_failure(result, ExitCode.OS_ERROR, str(blocker / "spool"), "--spool-dir")
    result = CliRunner().invoke(make_app(), args, env={"PLANCACHE_CACHE_DIR": str(blocker / "cache")})
    expected_failure(result, ExitCode.OS_ERROR, str(blocker / "cache" / "worker-spool"), "PLANCACHE_CACHE_DIR")


def test_db_upgrade_when_the_folder_cannot_be_created(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    db = blocker / "sub" / "plancache.db"
    proc = plancache("db", "upgrade", cwd=tmp_path, env={"PLANCACHE_DATABASE_URL": f"sqlite:///{db}"})
    expected_failure(proc, ExitCode.DATABASE, str(db), "--database-url")


def test_unable_to_open_the_database_file_names_the_path(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for args in (["db", "upgrade"], ["token", "list"]):
        result = CliRunner().invoke(make_app(), [*args, "--database-url", f"sqlite:///{folder}"])
        expected_failure(result, ExitCode.DATABASE, f"{folder}: unable to open database file")


def test_an_unsupported_database_url_is_a_configuration_error(tmp_path):
    result = CliRunner().invoke(make_app(), ["token", "list", "--database-url", "mysql://h/db"])
    expected_failure(result, ExitCode.CONFIG, "unsupported database URL", "PLANCACHE_DATABASE_URL")


# ------------------------------------------------------------------------------------------------ serve


def test_serve_on_a_busy_port_says_so_and_never_that_it_listens(tmp_path, sqlite_url):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = plancache("serve", "--port", str(port), cwd=tmp_path, env={"PLANCACHE_DATABASE_URL": sqlite_url})
    out = expected_failure(proc, ExitCode.OS_ERROR, f"127.0.0.1:{port}", "already in use", "--port")
    assert "listening" not in out and "serving" not in out
    assert not (tmp_path / "cli.db").exists()  # nothing touched before the port was had


def test_serve_is_usable_the_moment_it_says_it_listens(tmp_path, sqlite_url):
    """``plancache serve &`` then ``plancache token create …`` at once failed 3/3 ("no SQLite database … run
    plancache db upgrade first"): the listening line now comes once the port is bound and the database migrated."""
    port = free_port()
    env = {**os.environ, "PLANCACHE_DATABASE_URL": sqlite_url, "PLANCACHE_ADMIN_TOKEN": "a" * 32}
    server = subprocess.Popen([sys.executable, "-m", "plancache", "serve", "--port", str(port)], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in server.stderr], daemon=True).start()  # type: ignore[union-attr]
    try:
        seen = []
        while not any("listening on" in ln for ln in seen):
            seen.append(lines.get(timeout=60))
        assert f"listening on http://127.0.0.1:{port}" in seen[-1] and "schema at revision" in seen[-1]
        proc = plancache("token", "create", "--role", "reader", "--name", "app", cwd=tmp_path, env=env)
        assert proc.returncode == 0 and proc.stdout.startswith("pct_"), proc.stderr
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        server.terminate()
        server.wait(timeout=30)


# ------------------------------------------------------------------------------------------------ the server's clients


def test_enqueue_without_a_token_says_it_needs_an_admin_token(tmp_path):
    result = CliRunner().invoke(make_app(), ["enqueue", str(EXAMPLE), "--server", "http://127.0.0.1:9"])
    expected_failure(result, ExitCode.AUTH, "admin token", "PLANCACHE_ADMIN_TOKEN")


def test_an_unreachable_server_is_one_line(tmp_path):
    port = free_port()  # nothing listens there
    result = CliRunner().invoke(make_app(), ["enqueue", str(EXAMPLE), "--server", f"http://127.0.0.1:{port}",
                                             "--token", "t", "--wait", "0"])
    out = expected_failure(result, ExitCode.SERVER_UNAVAILABLE, f"127.0.0.1:{port}", "--server")
    assert "retrying" not in out


def test_a_server_url_without_a_scheme(tmp_path):
    result = CliRunner().invoke(make_app(), ["enqueue", str(EXAMPLE), "--server", "localhost:8787", "--token", "t"])
    expected_failure(result, ExitCode.CONFIG, "http://")


# ------------------------------------------------------------------------------------------------ keygen


def test_keygen_as_the_docker_docs_say(tmp_path):
    """docker/env.example and docs/DEPLOYMENT.md tell the operator to run these, from the docker folder."""
    docs = (ROOT / "docker" / "env.example").read_text() + (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    commands = set(re.findall(r"plancache keygen[^`&\n]*?(?=`|\s*&&|\n)", docs))
    assert commands, "the docker docs no longer show `plancache keygen`"
    for i, line in enumerate(sorted(commands)):
        folder = tmp_path / str(i)
        folder.mkdir()
        result = plancache(*line.split()[1:], cwd=folder)
        assert result.returncode == 0, (line, result.stderr)
        assert (folder / "secrets" / "plancache.key").exists() and (folder / "secrets" / "plancache.pub").exists()


def test_keygen_refuses_two_different_folders(tmp_path):
    result = CliRunner().invoke(make_app(), ["keygen", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    expected_failure(result, ExitCode.USAGE, "two directories")


# ------------------------------------------------------------------------------------------------ plans


def test_plans_gc_takes_the_short_env_id_plans_list_prints(tmp_path, sqlite_url, make_spec, make_plan, gpu_env):
    with open_store(sqlite_url, create=True) as store:
        key, spec = make_spec(0)
        store.put_spec(key, spec)
        store.publish_plan(*make_plan(key, gpu_env))
    app = make_app()
    listed = CliRunner().invoke(app, ["plans", "list", "--database-url", sqlite_url]).stdout
    short = gpu_env.env_id[:12]
    assert short in listed
    result = CliRunner().invoke(app, ["plans", "gc", "--keep-environment", short, "--dry-run",
                                      "--database-url", sqlite_url])
    assert result.exit_code == 0 and "would delete 0 plan records" in result.output, result.output
    lines = CliRunner().invoke(app, ["plans", "list", "--json", "--env-id", short, "--database-url", sqlite_url]).stdout
    assert [json.loads(ln)["env_id"] for ln in lines.splitlines()] == [gpu_env.env_id]
    result = CliRunner().invoke(app, ["plans", "gc", "--keep-environment", "h200.json", "--database-url", sqlite_url])
    expected_failure(result, ExitCode.FAILED, "no such environment", "plans list")


def test_printable_shows_control_characters_and_keeps_the_rest():
    """What a worker sent (a job error, a device name, a worker id) is printed with its control characters as text:
    no escape sequence reaches the admin's terminal; markup-looking text and non-ASCII letters stay as they are."""
    from plancache.cli.output import printable

    assert printable("e\x1b]0;owned\x07\x1b[2J\nX\x9b") == "e\\x1b]0;owned\\x07\\x1b[2J\\x0aX\\x9b"
    assert printable("gpu [/bold] Ü — ok") == "gpu [/bold] Ü — ok"


@pytest.mark.skipif(gpu_skip_reason() is None, reason="a GPU is present: the worker would start")
def test_cli_worker_without_a_gpu_exits_with_a_message(tmp_path):
    """Exit 9 (no usable GPU) where the gpu extra is installed; on a ``.[server,dev]`` install, 4 naming the extra."""
    import importlib.util

    has_gpu_extra = all(importlib.util.find_spec(m) is not None for m in ("torch", "cudnn"))
    priv, _, _ = keygen(tmp_path, "w")
    proc = subprocess.run([sys.executable, "-m", "plancache", "worker", "--server", "http://127.0.0.1:9",
                           "--token", "t", "--signing-key", str(priv), "--spool-dir", str(tmp_path / "spool"), "--once"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if has_gpu_extra:
        assert proc.returncode == 9, proc.stderr
    else:
        assert proc.returncode == 4 and "plancache[gpu]" in proc.stderr, proc.stderr
