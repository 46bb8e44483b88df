"""A worker told to stop: what becomes of its jobs, and `--once` against a server that stays down."""

import threading
import time

from tests.integration.test_worker_loop import enqueue, job, keys, make_worker, srv  # noqa: F401 - keys, srv: fixtures
from tests.worker_fakes import FakeTuner


def test_a_job_claimed_as_the_worker_is_told_to_stop_is_released_at_once(srv, tmp_path, keys):
    """Before: a job whose claim was on the wire when the signal came was tuned, holding the shutdown for its grace."""
    (j,) = enqueue(srv, ["conv_bias_relu"])
    tuner = FakeTuner(tune_seconds=30)
    w = make_worker(srv, tmp_path, keys[0], tuner, shutdown_grace=20)
    stop = threading.Event()
    real_claim = w.client.claim

    def claim(*a, **kw):  # SIGTERM arrives while the claim is on the wire
        got = real_claim(*a, **kw)
        stop.set()
        return got

    w.client.claim = claim
    started = time.monotonic()
    stats = w.run(stop)
    took = time.monotonic() - started
    assert took < 5, f"a job claimed as the worker stopped held the shutdown for {took:.1f}s"
    assert stats.released == 1 and job(srv, j.id).status == "queued"


def test_once_with_the_server_down_exits_saying_so(tmp_path, keys):
    """Before: --once retried an unreachable server for ever (a GPU allocation held until its time limit)."""
    import pytest

    from plancache.errors import ServerUnavailable
    from plancache.http import Backoff, Retry
    from plancache.signing import Signer
    from plancache.worker import JobsApi, Spool, Worker
    w = Worker(JobsApi.open("http://127.0.0.1:9", "t", retry=Retry(Backoff(initial=0.05, cap=0.2), within=1)),
               FakeTuner(), Signer.from_file(keys[0]), Spool(tmp_path / "sp"), worker_id="w", once=True)
    with pytest.raises(ServerUnavailable):
        w.run(threading.Event())


def test_worker_once_cli_exits_7_when_the_server_stays_down(tmp_path, keys, monkeypatch):
    """The CLI turns it into exit 7 (SERVER_UNAVAILABLE, worth retrying), an error line and a hint."""
    from typer.testing import CliRunner

    import plancache.cli.worker_cmds as wc
    import plancache.gpu  # noqa: F401 - torch's import: seconds, 20 on a loaded machine, before any retrying
    import plancache.worker
    from plancache.cli import make_app

    class CliFake(FakeTuner):
        def __init__(self, *a, **kw):
            super().__init__()

        def close(self):
            pass

    monkeypatch.setattr(plancache.worker, "GpuTuner", CliFake)
    monkeypatch.setattr(plancache.worker, "stop_on_signals", lambda stop: None)  # the CLI runs in a thread here
    monkeypatch.setattr(wc, "ONCE_RETRY_SECONDS", 1.0, raising=False)
    box = {}
    args = ["worker", "--once", "--server", "http://127.0.0.1:9", "--token", "t", "--signing-key", str(keys[0]),
            "--spool-dir", str(tmp_path / "sp")]
    t = threading.Thread(target=lambda: box.update(r=CliRunner().invoke(make_app(), args)), daemon=True)
    t.start()
    t.join(60)  # it retries for 1 s (the default: 120 s)
    assert not t.is_alive(), "plancache worker --once still retrying a dead server after 60 s"
    assert box["r"].exit_code == 7, box["r"].output
