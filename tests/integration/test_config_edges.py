"""Bad configuration, key files, revisions at their end and blob migrations, as an operator meets them through the
CLI (found by an audit of configuration, blob migration and signing keys): each is an ``error:``/``hint:`` pair with
its documented exit code, never an internal error or a silent wrong result."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plancache.cli import make_app
from plancache.cli.failures import ExitCode
from plancache.signing import Signer, keygen
from plancache.spec import graph_key
from plancache.store import open_store
from plancache.validation import INT64_MAX
from tests.factories import CONV_SPEC, H200, OTHER_GPU, make_meta

GK = graph_key(CONV_SPEC)


def cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(make_app(), list(args), env={"COLUMNS": "200", **(env or {})})


def seeded(tmp_path: Path, n: int = 3, *, revision: int | None = None) -> tuple[str, Path, list[str]]:
    """A SQLite database of ``n`` signed records (one spec, ``n`` environments), its signing key, their blobs."""
    key, _, _ = keygen(tmp_path / "keys", "old")
    signer = Signer.from_file(key)
    url = f"sqlite:///{tmp_path / 'p.db'}"
    store = open_store(url, create=True, blob_store="database")
    store.put_spec(GK, CONV_SPEC)
    digests = []
    for i in range(n):
        blob = f"plan-blob-{i}".encode() * 10
        meta = make_meta(GK, H200.model_copy(update={"sm_count": 1 + i}), blob)
        if revision is not None:
            meta = meta.model_copy(update={"revision": revision - 1})
        store.publish_plan(signer.sign(meta), blob)
        digests.append(hashlib.sha256(blob).hexdigest())
    store.close()
    return url, key, digests


# ------------------------------------------------------------------------------------------------ key files


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.mark.parametrize("kind", ["encrypted", "unsupported_curve"])
def test_a_signing_key_cryptography_cannot_load_is_a_bad_key_not_an_internal_error(tmp_path: Path, kind: str) -> None:
    key = tmp_path / "k.key"
    try:
        if kind == "encrypted":
            _openssl("genpkey", "-algorithm", "ed25519", "-aes256", "-pass", "pass:x", "-out", str(key))
        else:
            _openssl("ecparam", "-name", "secp112r1", "-genkey", "-noout", "-out", str(key))
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl cannot make the key: {exc}")
    url, _, _ = seeded(tmp_path, 1)
    result = cli("plans", "withdraw", GK, "--environment", H200.model_copy(update={"sm_count": 1}).env_id,
                 "--reason", "r", "--signing-key", str(key), "--database-url", url)
    assert result.exit_code == ExitCode.FAILED, result.output
    assert "internal error" not in result.output and "error: " in result.output


def test_a_trusted_key_on_an_unsupported_curve_is_a_bad_key_not_an_internal_error(tmp_path: Path) -> None:
    key, pub = tmp_path / "w.key", tmp_path / "w.pub"
    try:
        _openssl("ecparam", "-name", "secp112r1", "-genkey", "-noout", "-out", str(key))
        _openssl("ec", "-in", str(key), "-pubout", "-out", str(pub))
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl cannot make the key: {exc}")
    url, signing, _ = seeded(tmp_path, 1)
    result = cli("plans", "resign", "--signing-key", str(signing), "--trusted-keys", str(pub), "--database-url", url)
    assert result.exit_code == ExitCode.FAILED, result.output
    assert "internal error" not in result.output and "not ed25519" not in result.output


# ------------------------------------------------------------------------------------------------ revisions


def test_a_record_at_the_highest_revision_is_refused_by_resign_and_withdraw_not_an_overflow(tmp_path: Path) -> None:
    url, old, _ = seeded(tmp_path, 1, revision=INT64_MAX)
    new, _, _ = keygen(tmp_path / "keys", "new")
    resign = cli("plans", "resign", "--signing-key", str(new), "--trusted-keys", str(old.with_suffix(".pub")),
                 "--database-url", url)
    assert resign.exit_code == ExitCode.FAILED, resign.output
    assert "1 refused" in resign.output and "revisions end at" in resign.output
    withdraw = cli("plans", "withdraw", GK, "--environment", H200.model_copy(update={"sm_count": 1}).env_id,
                   "--reason", "r", "--signing-key", str(old), "--database-url", url)
    assert withdraw.exit_code == ExitCode.FAILED, withdraw.output
    assert "revisions end at" in withdraw.output and "internal error" not in withdraw.output


def test_a_refused_revision_leaves_the_process_revision_clock_usable() -> None:
    from plancache.errors import InvalidValue
    from plancache.signing import next_revision

    assert next_revision(INT64_MAX - 1) == INT64_MAX  # a record just below the end (a signer's clock far ahead)
    with pytest.raises(InvalidValue):
        next_revision(INT64_MAX)
    assert 0 < next_revision() < INT64_MAX  # the records signed after it still get revisions


# ------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(("variable", "value"), [
    ("PLANCACHE_CONNECT_TIMEOUT", "nan"), ("PLANCACHE_CONNECT_TIMEOUT", "inf"), ("PLANCACHE_READ_TIMEOUT", "-inf"),
])
def test_a_timeout_that_is_no_number_of_seconds_is_a_config_error(variable: str, value: str) -> None:
    result = cli("jobs", "list", env={"PLANCACHE_SERVER_URL": "http://127.0.0.1:1", variable: value,
                                      "PLANCACHE_ADMIN_TOKEN": "admin-token-0123456789"})
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert variable in result.output


@pytest.mark.parametrize("url", ["http://[::1", "http://[fe80::1%x"])
def test_a_server_url_httpx_cannot_parse_is_a_config_error(url: str) -> None:
    result = cli("jobs", "list", env={"PLANCACHE_SERVER_URL": url, "PLANCACHE_ADMIN_TOKEN": "admin-token-0123456789"})
    assert result.exit_code == ExitCode.CONFIG, result.output


def test_a_token_no_http_header_can_carry_is_named_as_the_token_not_the_server_url() -> None:
    result = cli("explain", GK, "--environment", H200.model_dump_json(),
                 env={"PLANCACHE_SERVER_URL": "http://127.0.0.1:1", "PLANCACHE_TOKEN": "t\u00e9"})
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "token" in result.output and "--server" not in result.output


@pytest.mark.parametrize(("variable", "value"), [
    ("PLANCACHE_LEASE_SECONDS", "inf"), ("PLANCACHE_LEASE_SECONDS", "1e300"), ("PLANCACHE_JOB_MAX_ATTEMPTS", "0"),
    ("PLANCACHE_SPEC_WRITES_PER_MINUTE", "nan"), ("PLANCACHE_HEADER_TIMEOUT", "inf"),
    ("PLANCACHE_INFLIGHT_WAIT_SECONDS", "-1"),
])
def test_serve_refuses_a_limit_no_request_could_use_or_that_switches_itself_off(tmp_path: Path, variable: str,
                                                                              value: str) -> None:
    with socket.socket() as busy:  # were the value taken, serve would run: this port makes it end at once instead
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = cli("serve", "--port", str(busy.getsockname()[1]), "--database-url", f"sqlite:///{tmp_path / 's.db'}",
                     env={variable: value})
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert variable in result.output


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_cache_age_is_refused_not_a_deletion_of_every_other_environments_cache(tmp_path: Path,
                                                                                       value: str,
                                                                                       monkeypatch) -> None:
    from pydantic import ValidationError

    from plancache.client import PlanCache
    from tests.client_fakes import RecordingBackend

    other = tmp_path / OTHER_GPU.env_id
    other.mkdir()
    (other / "x.record").write_text("x")
    monkeypatch.setenv("PLANCACHE_CACHE_MAX_AGE_DAYS", value)
    with pytest.raises(ValidationError, match="cache_max_age_days"):
        PlanCache(backend=RecordingBackend(H200), environment=H200, cache_dir=tmp_path, server_url="")
    assert other.is_dir()


# ------------------------------------------------------------------------------------------------ blob stores


def test_a_blob_folder_that_cannot_be_created_names_the_blob_store_not_the_database(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    url, _, _ = seeded(tmp_path, 1)
    result = cli("plans", "list", "--database-url", url,
                 env={"PLANCACHE_BLOB_STORE": (blocker / "blobs").as_uri()})
    assert result.exit_code == ExitCode.OS_ERROR, result.output
    assert "PLANCACHE_BLOB_STORE" in result.output and "SQLite database" not in result.output


def test_after_a_migration_into_the_database_with_missing_bytes_the_database_opens_as_told(tmp_path: Path) -> None:
    url, _, digests = seeded(tmp_path, 3)
    folder = (tmp_path / "blobs").as_uri()
    assert cli("db", "migrate-blobs", folder, "--database-url", url).exit_code == 0
    first = digests[0]  # the catalog's first row: its bytes are lost from the folder
    os.unlink(tmp_path / "blobs" / first[:2] / first[2:4] / first)
    back = cli("db", "migrate-blobs", "database", "--database-url", url, env={"PLANCACHE_BLOB_STORE": folder})
    assert back.exit_code == 0 and "set PLANCACHE_BLOB_STORE=database" in back.output, back.output
    listed = cli("plans", "list", "--json", "--database-url", url, env={"PLANCACHE_BLOB_STORE": "database"})
    assert listed.exit_code == 0, listed.output
    assert len(listed.output.splitlines()) == 3


def test_a_signing_key_others_can_read_is_used_with_a_warning(tmp_path: Path, caplog) -> None:
    """Before: a world-readable private key (0644: copied with the wrong umask) signed without a word."""
    key, _, _ = keygen(tmp_path / "keys", "w")
    Signer.from_file(key)
    assert "can be read by users other than its owner" not in caplog.text  # keygen writes it owner-only
    key.chmod(0o440)  # a Kubernetes secret with fsGroup (this process's group) and defaultMode 0440
    Signer.from_file(key)
    assert "can be read by users other than its owner" not in caplog.text
    key.chmod(0o644)
    signer = Signer.from_file(key)
    assert signer.key_id and "can be read by users other than its owner (mode 644)" in caplog.text
    assert "chmod 600" in caplog.text
