"""Worker pieces that need no server: the job calls, the spool, lease arithmetic, CLI keygen (the HTTP layer under
the job calls: tests/unit/test_http.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import typer
from typer.testing import CliRunner

from plancache.errors import IntegrityError, InvalidValue, LeaseLost, ServerUnavailable
from plancache.http import Backoff, HttpClient, Retry
from plancache.protocol import ClaimResponse, FailRequest, Job, LeaseRequest, TargetEnvironment
from plancache.signing import Signer, TrustedKeys, keygen
from plancache.spec import parse_spec
from plancache.validation import INT64_MAX
from plancache.worker import JobsApi, Spool, SpoolEntry, Worker
from plancache.worker.loop import lease_duration
from plancache.worker.spool import ORPHAN_SECONDS
from tests.worker_fakes import FAKE_ENV, FakeTuner

ROOT = Path(__file__).resolve().parents[2]


def worker_cli() -> typer.Typer:
    """A fresh app with every command (``worker``, ``keygen`` …)."""
    from plancache.cli import make_app

    return make_app()


def example_spec(name: str = "conv_bias_relu"):
    return parse_spec((ROOT / "examples" / f"{name}.json").read_text())


def _jobs(handler) -> JobsApi:
    retry = Retry(Backoff(initial=0.01, cap=0.02), within=5)
    return JobsApi(HttpClient("http://plancache.test", "tok", policies=[retry], transport=httpx.MockTransport(handler)))


def test_claim_204_is_none():
    assert _jobs(lambda r: httpx.Response(204)).claim(FAKE_ENV, "w1") is None


def test_a_lease_lost_answer_is_raised_as_lease_lost():
    answer = httpx.Response(409, json={"error": {"code": "lease_lost", "message": "fenced by token 2"}})
    with pytest.raises(LeaseLost, match="fenced by token 2"):
        _jobs(lambda r: answer).fail(1, FailRequest(worker_id="w1", lease_token="tok", error="x", retryable=True))


def test_a_blob_put_always_carries_its_content_length_also_when_retried():
    """The server refuses a blob sent without Content-Length (411, chunked): the worker's PUT sends its length on
    every attempt, and the same bytes again after a 503."""
    data = b"plan bytes" * 1000
    puts: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "HEAD":
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "no blob"}})
        puts.append(request)
        return httpx.Response(503 if len(puts) == 1 else 201, json={"error": {"code": "server_busy", "message": "x"}})

    _jobs(handler).put_blob("ab" * 32, data, job_id=7, lease=LeaseRequest(worker_id="w1", lease_token="t" * 8))
    assert len(puts) == 2
    for request in puts:
        assert request.headers["content-length"] == str(len(data)) and "transfer-encoding" not in request.headers
        assert request.read() == data and request.headers["content-type"] == "application/octet-stream"


def test_a_heartbeat_is_one_attempt():
    calls = []

    def down(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        raise httpx.ConnectError("connection refused")

    with pytest.raises(ServerUnavailable, match="connection refused"):
        _jobs(down).heartbeat(3, LeaseRequest(worker_id="w1", lease_token="tok"), timeout=0.5)
    assert len(calls) == 1 and calls[0].url.path == "/v1/jobs/3/heartbeat"


def _entry(tmp_path: Path, job_id: int = 3) -> SpoolEntry:
    spec = example_spec()
    tuned = FakeTuner().tune(spec)
    priv, _, _ = keygen(tmp_path / "keys", "w")
    meta = Signer.from_file(priv).sign(tuned.to_meta(spec.graph_key, "w1"))
    return SpoolEntry(job_id, "secret-lease-token", "w1", meta, spec.to_json(), tuned.blob)


def spool_files(spool: Spool) -> list[str]:
    """The files of a spool, by path under its directory (empty folders left out)."""
    return sorted(str(p.relative_to(spool.directory)) for p in spool.directory.rglob("*") if p.is_file())


def test_spool_round_trip_and_remove(tmp_path):
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    spool.save(entry)
    sha = entry.meta.blob_sha256
    assert spool_files(spool) == [f"blobs/{sha[:2]}/{sha[2:4]}/{sha}", f"{entry.name}.json"]
    assert entry.name.startswith("job-3-") and "secret" not in entry.name and "secret" not in repr(entry)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in spool.directory.rglob("*") if p.is_file())  # a lease token
    (loaded,) = spool.pending()
    assert loaded == entry
    up = loaded.upload()
    assert loaded.blob == entry.blob and "blob_b64" not in up.model_dump_json()  # the blob goes raw, before the record
    assert up.blob_sha256 == entry.meta.blob_sha256 and up.spec == entry.spec and up.envelope == entry.meta.envelope
    TrustedKeys.from_files([tmp_path / "keys" / "w.pub"]).verify(up)
    spool.remove(loaded)
    assert spool.pending() == [] and spool_files(spool) == []


def test_a_spool_or_blob_folder_given_as_a_relative_path_works(tmp_path, monkeypatch):
    """``--spool-dir worker-spool`` (the README's walkthrough): the folder is taken from the current directory."""
    from plancache.blobs import FolderBlobs

    monkeypatch.chdir(tmp_path)
    spool = Spool(Path("worker-spool"))
    entry = _entry(tmp_path)
    spool.save(entry)
    assert spool.pending() == [entry]
    blobs = FolderBlobs(Path("blobs"))
    assert blobs.root == tmp_path / "blobs" and blobs.url == (tmp_path / "blobs").as_uri()


def test_spool_sets_aside_a_corrupt_entry(tmp_path, caplog):
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    spool.save(entry)
    blob = spool.blobs.path(entry.meta.blob_sha256)
    blob.write_bytes(b"x" + blob.read_bytes()[1:])
    (spool.directory / "job-4-1.json").write_text("{not json")
    assert spool.pending() == []
    assert [f for f in spool_files(spool) if not f.startswith("blobs/")] == [
        f"{entry.name}.json.corrupt", "job-4-1.json.corrupt"]
    assert "is missing or damaged" in caplog.text and "is damaged, treated as missing" in caplog.text


def test_spool_refuses_a_blob_that_does_not_hash_to_its_record(tmp_path):
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    with pytest.raises(IntegrityError):
        spool.save(dataclasses.replace(entry, blob=entry.blob[:-1]))
    assert spool_files(spool) == []


def test_spool_entries_of_one_blob_share_it_until_the_last_is_removed(tmp_path):
    """A job tuned again under a new lease may spool the same bytes: removing one entry keeps the other's blob."""
    spool = Spool(tmp_path / "spool")
    first = _entry(tmp_path, 3)
    second = dataclasses.replace(first, lease_token="another-lease")
    spool.save(first)
    spool.save(second)
    spool.remove(first)
    assert spool.pending() == [second]
    spool.remove(second)
    assert spool_files(spool) == []


def test_spool_drops_blobs_no_entry_names_once_an_hour_old(tmp_path):
    """A crash between the blob and its JSON leaves a blob no entry names: kept while young (a writer may be
    about to write its JSON), deleted by a later ``pending`` once old, with crashed writers' temporary files."""
    spool = Spool(tmp_path / "spool")
    young, old = b"young orphan", b"old orphan"
    for data in (young, old):
        spool.blobs.put(hashlib.sha256(data).hexdigest(), data)
    old_path = spool.blobs.path(hashlib.sha256(old).hexdigest())
    temporary = old_path.with_name(f".{old_path.name}.crashed.tmp")
    temporary.write_bytes(b"half")
    stale = time.time() - 2 * ORPHAN_SECONDS
    for path in (old_path, temporary):
        os.utime(path, (stale, stale))
    entry = _entry(tmp_path)
    spool.save(entry)
    os.utime(spool.blobs.path(entry.meta.blob_sha256), (stale, stale))  # an old entry's blob is named: kept
    assert spool.pending() == [entry]
    assert sorted(f.sha256 for f in spool.blobs.files()) == sorted(
        [hashlib.sha256(young).hexdigest(), entry.meta.blob_sha256])


def test_spool_moves_an_entry_of_the_earlier_layout_into_its_blob_store(tmp_path):
    """Before: an entry's blob was ``job-<id>-<lease>.blob`` beside its JSON."""
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path, 3)
    damaged = dataclasses.replace(entry, job_id=4)  # the same bytes, damaged in its own file
    for e, data in ((entry, entry.blob), (damaged, damaged.blob[:-1])):
        spool.save(e)
        spool.blobs.delete(e.meta.blob_sha256)
        (spool.directory / f"{e.name}.blob").write_bytes(data)
    assert spool.pending() == [entry]
    assert spool.blobs.get(entry.meta.blob_sha256) == entry.blob
    assert sorted(p.name for p in spool.directory.iterdir() if p.is_file()) == sorted([
        f"{entry.name}.json", f"{damaged.name}.json.corrupt", f"{damaged.name}.blob.corrupt"])


def _oversized(path: Path) -> None:
    with path.open("wb") as fh:
        fh.truncate(2 << 30)  # sparse, 2 GiB


#: What a spool's file can be replaced with that read whole would exhaust the worker, or block it for good; what the
#: log says of it in an entry's JSON (or a blob of the earlier layout), and in the blob folder.
PLANTED = {
    "symlink to /dev/zero": (lambda path: path.symlink_to("/dev/zero"), "Too many levels of symbolic links",
                             "is a symlink, treated as missing"),
    "FIFO": (os.mkfifo, "not a regular file", "is not a regular file, treated as missing"),
    "oversized file": (_oversized, "over the limit of", "of its record (not read)"),
}
#: ``Spool(argv[1]).pending()``, its memory (512 MiB) and the bytes it may write (64 MiB) bounded.
_PENDING = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
from plancache.worker import Spool
print(len(Spool(sys.argv[1]).pending()))
"""


@pytest.mark.parametrize("where", ["entry", "blob", "earlier layout's blob"])
@pytest.mark.parametrize("planted", PLANTED)
def test_a_spool_file_that_is_a_symlink_fifo_or_oversized_is_set_aside_unread(tmp_path, planted, where):
    """Before: an entry's JSON (and a blob of the earlier layout) was read whole through symlinks, a blob whole
    whatever its record's size: /dev/zero or a huge file took all memory (or, moved into the blob folder, all the
    disk), a FIFO blocked the worker's next flush for good. Now none is followed, waited on or read past its bound;
    the entry is set aside as a corrupt one is, and the worker goes on."""
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    spool.save(entry)
    json_path = spool.directory / f"{entry.name}.json"
    target = {"entry": json_path, "blob": spool.blobs.path(entry.meta.blob_sha256),
              "earlier layout's blob": json_path.with_suffix(".blob")}[where]
    if where != "entry":
        spool.blobs.delete(entry.meta.blob_sha256)
    target.unlink(missing_ok=True)
    plant, said, said_in_blob_folder = PLANTED[planted]
    plant(target)
    done = subprocess.run([sys.executable, "-c", _PENDING, str(spool.directory)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout) == (0, "0\n"), done.stderr[-2000:]
    assert f"spool entry {json_path} is unreadable" in done.stderr
    assert (said_in_blob_folder if where == "blob" else said) in done.stderr, done.stderr[-2000:]
    assert (json_path.with_name(json_path.name + ".corrupt")).exists() and not json_path.exists()
    if where == "earlier layout's blob":
        assert target.with_name(target.name + ".corrupt").exists()


def running_claim(graph_key: str, spec: dict, *, job_id: int = 1, owner: str = "w1", lease_seconds: float = 30,
                  now: datetime | None = None, **claim: object) -> ClaimResponse:
    """A claim of a running job (attempt 1 of 3) whose lease ends ``lease_seconds`` after ``now``."""
    now = now or datetime.now(UTC)
    job = Job(id=job_id, graph_key=graph_key, target=TargetEnvironment(), status="running", priority=0, attempts=1,
              max_attempts=3, lease_owner=owner, lease_expires_at=now + timedelta(seconds=lease_seconds),
              created_at=now, updated_at=now)
    return ClaimResponse(job=job, spec=spec, lease_token="tok", lease_expires_at=job.lease_expires_at,
                         **claim)  # type: ignore[arg-type]


def test_lease_duration_uses_the_servers_clock():
    now = datetime.now(UTC) - timedelta(hours=3)  # a skewed server clock does not matter
    claim = running_claim("a" * 64, {}, owner="w", lease_seconds=90, now=now)
    assert lease_duration(claim) == pytest.approx(90)


class _CompletionRacesHeartbeat:
    """A fake :class:`JobsApi` whose completion commits while a heartbeat is on its way: the completion's answer
    comes only after a heartbeat reached the server and was refused, as it is then (409, the job succeeded)."""

    def __init__(self, claim: ClaimResponse) -> None:
        self.http = SimpleNamespace(stop=None)
        self._claim = claim
        self.completed = threading.Event()
        self.refused_beat = threading.Event()

    def claim(self, env, worker_id: str) -> ClaimResponse:
        return self._claim

    def heartbeat(self, job_id: int, lease: LeaseRequest, *, timeout: float | None = None) -> None:
        if self.completed.is_set():
            self.refused_beat.set()
            raise LeaseLost(f"job {job_id} is succeeded, not running")

    def put_blob(self, sha256: str, data: bytes, *, job_id: int, lease: LeaseRequest) -> None:
        pass

    def complete(self, job_id: int, req) -> None:
        self.completed.set()
        assert self.refused_beat.wait(5), "no heartbeat raced the completion"

    def fail(self, job_id: int, req) -> None:
        raise AssertionError(f"job {job_id} failed: {req.error}")


def test_a_heartbeat_racing_the_workers_own_completion_is_not_a_lost_lease(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="plancache.worker")
    spec = example_spec()
    priv, _, _ = keygen(tmp_path / "keys", "w")
    claim = running_claim(spec.graph_key, spec.to_json(), lease_seconds=0.3)
    jobs = _CompletionRacesHeartbeat(claim)
    worker = Worker(jobs, FakeTuner(), Signer.from_file(priv), Spool(tmp_path / "spool"), worker_id="w1")  # type: ignore[arg-type]
    worker.environment = FAKE_ENV
    held = worker._claim()
    assert held is not None
    worker.process(held, threading.Event())
    assert jobs.refused_beat.is_set() and (worker.stats.succeeded, worker.stats.dropped) == (1, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("lease lost" in m for m in warnings), warnings
    assert "heartbeat after the job was finished" in caplog.text


class _OneJob:
    """A fake :class:`JobsApi` handing out one claim, then none; it records failures."""

    def __init__(self, claim: ClaimResponse) -> None:
        self.http = SimpleNamespace(stop=None)
        self._claims = [claim]
        self.failed: list[tuple[int, FailRequest]] = []

    def claim(self, env, worker_id: str) -> ClaimResponse | None:
        return self._claims.pop() if self._claims else None

    def heartbeat(self, job_id: int, lease: LeaseRequest, *, timeout: float | None = None) -> None:
        pass

    def fail(self, job_id: int, req: FailRequest) -> None:
        self.failed.append((job_id, req))


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_job_whose_spec_is_not_its_graph_key_is_failed_for_good_and_never_tuned(tmp_path, pipelined):
    spec, other = example_spec(), example_spec("sdpa_causal")
    priv, _, _ = keygen(tmp_path / "keys", "w")
    jobs = _OneJob(running_claim(other.graph_key, spec.to_json(), job_id=7))
    tuner = FakeTuner(pipelined=pipelined)
    worker = Worker(jobs, tuner, Signer.from_file(priv), Spool(tmp_path / "spool"), worker_id="w1",  # type: ignore[arg-type]
                    once=True)
    stats = worker.run(threading.Event())
    assert (stats.claimed, stats.failed, tuner.tuned) == (1, 1, [])
    ((job_id, req),) = jobs.failed
    assert job_id == 7 and not req.retryable and "hashes to" in req.error


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
    assert res.exit_code == 3 and "signing" in res.output  # ExitCode.CONFIG


# ---------------------------------------------------------------- worker ids, heartbeats, the spool's edge cases


@pytest.mark.parametrize("bad", ["w1 ", " w1", "gpu-é", "w\t1", "a" * 257, ""])
def test_a_worker_id_that_cannot_travel_in_a_header_is_refused_up_front(tmp_path, bad):
    """Before: a worker id with a trailing space or a non-ASCII character claimed jobs, then could not send their
    blobs (the X-Plancache-Worker header) and retried for ever. After: refused when the worker is made."""
    from plancache.errors import InvalidValue
    from plancache.worker import check_worker_id

    with pytest.raises(InvalidValue, match="printable ASCII"):
        check_worker_id(bad)
    priv, _, _ = keygen(tmp_path / "keys", "w")
    with pytest.raises(InvalidValue):
        Worker(_OneJob(None), FakeTuner(), Signer.from_file(priv), Spool(tmp_path / "spool"),  # type: ignore[arg-type]
               worker_id=bad)
    res = CliRunner().invoke(worker_cli(), ["worker", "--server", "http://127.0.0.1:9", "--worker-id", bad or "x "])
    assert res.exit_code == 2 and "printable ASCII" in res.output and "Traceback" not in res.output  # USAGE


def test_the_default_worker_id_is_usable_whatever_the_host_name(monkeypatch):
    from plancache.worker import check_worker_id, default_worker_id, loop

    monkeypatch.setattr(loop.socket, "gethostname", lambda: "hôte de calcul " + "x" * 300)
    wid = default_worker_id()
    assert check_worker_id(wid) == wid and wid.startswith("h-te-de-calcul-") and wid.endswith(f"-{os.getpid()}")


class _Beats:
    """A fake :class:`JobsApi` whose heartbeats fail ``failures`` times (a hung or refused beat), then succeed; it
    records when each was sent and with what timeout."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[tuple[float, float | None]] = []

    def heartbeat(self, job_id: int, lease: LeaseRequest, *, timeout: float | None = None) -> None:
        self.sent.append((time.monotonic(), timeout))
        if len(self.sent) <= self.failures:
            raise ServerUnavailable("the beat timed out")


def test_a_failed_heartbeat_is_tried_again_soon_not_a_whole_interval_later():
    """Before: a beat that hung for its timeout (an interval) was followed by the next an interval later, at the end
    of the lease: one slow answer lost the job. After: a beat waits half an interval, and a failed one is tried
    again a quarter interval later."""
    from plancache.worker.loop import _Heartbeat

    client = _Beats(failures=1)
    beat = _Heartbeat(client, 1, LeaseRequest(worker_id="w1", lease_token="tok"), interval=0.4)  # type: ignore[arg-type]
    start = time.monotonic()
    beat.start()
    deadline = time.monotonic() + 5
    while len(client.sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.halt()
    (t1, timeout), (t2, _), (t3, _) = client.sent[:3]
    assert timeout == pytest.approx(0.2) and not beat.lost.is_set()
    assert 0.35 <= t1 - start < 0.6
    assert 0.08 <= t2 - t1 < 0.25  # the retry, a quarter interval on
    assert 0.35 <= t3 - t2 < 0.6  # then the interval again


def test_a_spool_that_cannot_delete_a_delivered_entry_skips_it_from_then_on(tmp_path, monkeypatch, caplog):
    """Before: on a read-only spool folder, removing a delivered entry raised EROFS out of the worker's loop.
    After: it is logged and the entry is not delivered again by this worker."""
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    spool.save(entry)

    def read_only(self, missing_ok=False):
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    spool.remove(entry)
    assert "could not delete the delivered spool entry" in caplog.text
    assert spool.pending() == []
    monkeypatch.undo()
    assert [e.name for e in Spool(tmp_path / "spool").pending()] == [entry.name]  # still on disk, for a restart


def test_a_spool_entry_removed_by_another_worker_meanwhile_is_left_out(tmp_path, monkeypatch, caplog):
    """Before: two workers sharing a spool folder raced: one's pending() stat'ed an entry the other had just
    delivered and removed, and FileNotFoundError ended its loop. After: the entry is left out, quietly."""
    spool = Spool(tmp_path / "spool")
    entry = _entry(tmp_path)
    spool.save(entry)
    gone = spool.directory / "job-9-00000000000000ff.json"
    listed = [spool.directory / f"{entry.name}.json", gone]
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(listed))
    assert [e.name for e in spool.pending()] == [entry.name]
    assert "unreadable" not in caplog.text


@pytest.mark.parametrize("ahead", ["the last revision there is", "two days"])
def test_a_claim_whose_min_revision_is_far_ahead_fails_the_job_for_good_before_tuning(tmp_path, ahead):
    """A claim may name a revision far ahead of the worker's clock (a withdrawal signed on a clock days ahead, or a
    server asking for the last revision there is). Signed above it, the plan would be kept by clients over every
    later plan of its key for as long (for good, at INT64_MAX - 1); before, a worker signed it, or at INT64_MAX its
    InvalidValue ended the worker's loop after the tuning. Now the job fails for good, untuned, saying why, and the
    worker goes on; a lead of an hour (clock skew) is signed above as before."""
    from plancache.signing import MAX_REVISION_LEAD_MS
    from plancache.worker.loop import _check_revision_lead

    now_ms = time.time_ns() // 1_000_000
    min_revision = INT64_MAX if ahead == "the last revision there is" else now_ms + 2 * 24 * 3600 * 1000
    spec = example_spec()
    priv, _, _ = keygen(tmp_path / "keys", "w")
    jobs = _OneJob(running_claim(spec.graph_key, spec.to_json(), job_id=9, min_revision=min_revision))
    tuner = FakeTuner()
    worker = Worker(jobs, tuner, Signer.from_file(priv), Spool(tmp_path / "spool"), worker_id="w1",  # type: ignore[arg-type]
                    once=True)
    stats = worker.run(threading.Event())
    assert (stats.claimed, stats.failed, stats.succeeded, tuner.tuned) == (1, 1, 0, [])
    ((job_id, req),) = jobs.failed
    assert job_id == 9 and not req.retryable and str(min_revision) in req.error
    assert "ahead of this worker's clock" in req.error and "check the clocks" in req.error
    assert not list(Spool(tmp_path / "spool").pending())
    _check_revision_lead(now_ms + 3600 * 1000)  # an hour ahead: allowed
    with pytest.raises(InvalidValue, match="25 h ahead"):
        _check_revision_lead(now_ms + MAX_REVISION_LEAD_MS + 3600 * 1000)
