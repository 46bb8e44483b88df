"""Worker pieces that need no server: backoff, error mapping and retries, the spool, lease arithmetic, CLI keygen."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from plancache.errors import Conflict, LeaseLost, SpecError, Unauthorized
from plancache.protocol import ClaimResponse, Job, TargetEnvironment
from plancache.signing import Signer, TrustedKeys, keygen
from plancache.spec import parse_spec
from plancache.worker import Backoff, JobClient, RequestRefused, ServerUnavailable, Spool, SpoolEntry
from plancache.worker.loop import lease_duration
from tests.gpu_util import gpu_skip_reason
from tests.worker_fakes import FAKE_ENV, FakeTuner

ROOT = Path(__file__).resolve().parents[1]


def worker_cli() -> typer.Typer:
    """A fresh app with only the worker module's commands."""
    from plancache.cli import worker_cmds

    app = typer.Typer()
    worker_cmds.register(app)
    return app


def example_spec(name: str = "conv_bias_relu"):
    return parse_spec((ROOT / "examples" / f"{name}.json").read_text())


def test_backoff_grows_exponentially_with_jitter_and_is_capped():
    b = Backoff(initial=0.1, factor=2.0, cap=1.0)
    for attempt, ceiling in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (50, 1.0), (10_000, 1.0)]:
        delays = [b.delay(attempt) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, min(delays), max(delays))
        assert len(set(delays)) > 1, "no jitter"


def _client(handler, **kw) -> JobClient:
    return JobClient("http://plancache.test", "tok", transport=httpx.MockTransport(handler),
                     backoff=Backoff(initial=0.01, cap=0.02), **kw)


def _error(status: int, code: str, message: str = "nope") -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


@pytest.mark.parametrize("status,code,cls", [(409, "lease_lost", LeaseLost), (409, "conflict", Conflict),
                                             (401, "unauthorized", Unauthorized), (422, "invalid_spec", SpecError)])
def test_error_bodies_map_to_domain_errors_without_retrying(status, code, cls):
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        return _error(status, code, "detail here")

    with pytest.raises(cls, match="detail here"):
        _client(handler).request("POST", "/v1/x", body={}, retry_for=5)
    assert len(calls) == 1
    assert calls[0].headers["authorization"] == "Bearer tok"


def test_unknown_error_code_and_non_json_body_are_kept():
    with pytest.raises(RequestRefused) as exc:
        _client(lambda r: _error(418, "teapot")).request("GET", "/x")
    assert exc.value.code == "teapot" and exc.value.http_status == 418
    with pytest.raises(RequestRefused, match="http_400"):
        _client(lambda r: httpx.Response(400, text="plain")).request("GET", "/x")


def test_transient_failures_are_retried_until_success():
    answers = iter([httpx.ConnectError("refused"), httpx.Response(503), httpx.ReadTimeout("slow"),
                    httpx.Response(200, json={"ok": True})])

    def handler(req: httpx.Request) -> httpx.Response:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert _client(handler).request("GET", "/x", retry_for=10).json() == {"ok": True}


def test_retrying_stops_at_the_deadline_and_on_stop():
    def down(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="connection refused"):
        _client(down).request("GET", "/x", retry_for=0.3)
    assert 0.25 <= time.monotonic() - t0 < 2
    client = _client(down)
    client.stop.set()
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable):
        client.request("GET", "/x")  # retry_for=None would retry forever, but stop is set
    assert time.monotonic() - t0 < 0.5


def test_claim_204_is_none():
    assert _client(lambda r: httpx.Response(204)).claim(FAKE_ENV, "w1") is None


def test_bad_server_url_is_refused():
    with pytest.raises(ValueError, match="http"):
        JobClient("localhost:8000", None)


def _entry(tmp_path: Path, job_id: int = 3) -> SpoolEntry:
    spec = example_spec()
    tuned = FakeTuner().tune(spec)
    priv, _, _ = keygen(tmp_path / "keys", "w")
    meta = Signer.from_file(priv).sign(tuned.to_meta(spec.graph_key, "w1"))
    return SpoolEntry(job_id, 5, "w1", meta, spec.to_json(), tuned.blob)


def test_spool_round_trip_and_remove(tmp_path):
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    spool.save(entry)
    assert sorted(p.name for p in spool.directory.iterdir()) == ["job-3-5.blob", "job-3-5.json"]
    (loaded,) = spool.pending()
    assert loaded == entry
    up = loaded.upload()
    assert up.blob_bytes() == entry.blob and up.spec == entry.spec and up.signature == entry.meta.signature
    TrustedKeys.from_files([tmp_path / "keys" / "w.pub"]).verify(up)
    spool.remove(loaded)
    assert spool.pending() == [] and list(spool.directory.iterdir()) == []


def test_spool_sets_aside_a_corrupt_entry(tmp_path, caplog):
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    spool.save(entry)
    blob = spool.directory / "job-3-5.blob"
    blob.write_bytes(b"x" + blob.read_bytes()[1:])
    (spool.directory / "job-4-1.json").write_text("{not json")
    assert spool.pending() == []
    assert sorted(p.name for p in spool.directory.iterdir()) == [
        "job-3-5.blob.corrupt", "job-3-5.json.corrupt", "job-4-1.json.corrupt"]
    assert "does not match" in caplog.text


def test_lease_duration_uses_the_servers_clock():
    now = datetime.now(timezone.utc) - timedelta(hours=3)  # a skewed server clock does not matter
    job = Job(id=1, graph_key="a" * 64, target=TargetEnvironment(), status="running", priority=0, attempts=1,
              max_attempts=3, lease_owner="w", lease_expires_at=now + timedelta(seconds=90), fencing_token=1,
              created_at=now, updated_at=now)
    claim = ClaimResponse(job=job, spec={}, lease_token=1, lease_expires_at=now + timedelta(seconds=90))
    assert lease_duration(claim) == pytest.approx(90)


def test_cli_keygen_writes_a_usable_pair_and_never_overwrites(tmp_path):
    app = worker_cli()
    runner = CliRunner()
    res = runner.invoke(app, ["keygen", "--out", str(tmp_path), "--name", "fleet"])
    assert res.exit_code == 0, res.output
    signer = Signer.from_file(tmp_path / "fleet.key")
    assert signer.key_id in res.output
    assert TrustedKeys.from_files([tmp_path / "fleet.pub"]).key_ids == [signer.key_id]
    assert (tmp_path / "fleet.key").stat().st_mode & 0o777 == 0o600
    again = runner.invoke(app, ["keygen", "--out", str(tmp_path), "--name", "fleet"])
    assert again.exit_code == 1 and "refusing to overwrite" in again.output
    assert Signer.from_file(tmp_path / "fleet.key").key_id == signer.key_id
    bad = runner.invoke(app, ["keygen", "--out", str(tmp_path), "--name", "../x"])
    assert bad.exit_code == 2


def test_cli_worker_requires_a_signing_key(tmp_path, monkeypatch):
    monkeypatch.delenv("PLANCACHE_SIGNING_KEY", raising=False)
    res = CliRunner().invoke(worker_cli(), ["worker", "--server", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "signing" in res.output


@pytest.mark.skipif(gpu_skip_reason() is None, reason="a GPU is present: the worker would start")
def test_cli_worker_without_a_gpu_exits_with_a_message(tmp_path):
    priv, _, _ = keygen(tmp_path, "w")
    proc = subprocess.run([sys.executable, "-m", "plancache", "worker", "--server", "http://127.0.0.1:9",
                           "--signing-key", str(priv), "--spool-dir", str(tmp_path / "spool"), "--once"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "error:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
