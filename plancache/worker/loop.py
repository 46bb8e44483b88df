"""The worker's job loop: claim → heartbeat while tuning → tune → verify round trip → sign → spool → complete.

Only a plan that matched the reference during autotuning *and* again after a
deserialize round trip in this process is published; any failure is reported to the
server as a failed attempt with its reason. A finished result is written to the spool
before it is sent, so neither the server being down nor the worker restarting loses it.
On stop (SIGTERM), a tuning in progress gets ``shutdown_grace`` seconds to finish and be
published; otherwise the job is released for another worker. A tuning that runs past ``job_timeout`` seconds (a
hang the builders' own time limit does not catch) fails its job, which is released to be retried up to its attempts;
the tuning is told to stop, and the worker goes on with the next job once it has (or after
:data:`CANCEL_WAIT_SECONDS`: a thread cannot be killed).

When the tuner builds candidates in other processes (:meth:`Tuner.pipelines`), the worker claims the next job
before it tunes the current one, and heartbeats both: the next graph's candidates are built while the current
one is timed. A job claimed ahead and not started when the worker stops is released at once.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

from ..environment import Environment
from ..errors import (
    Conflict,
    EnvironmentMismatch,
    Forbidden,
    InsufficientGpuMemory,
    InvalidValue,
    LeaseLost,
    NotFound,
    NotLeaseHolder,
    PayloadTooLarge,
    PlanCacheError,
    ServerUnavailable,
    SpecError,
    TuningError,
    Unauthorized,
)
from ..protocol import (
    WORKER_ID_PATTERN,
    CandidateTable,
    ClaimResponse,
    CompleteRequest,
    FailRequest,
    Job,
    LeaseRequest,
    PlanMeta,
)
from ..settings import DEFAULT_JOB_TIMEOUT
from ..signing import MAX_REVISION_LEAD_MS, Signer
from ..spec import GraphSpec, parse_spec
from .jobs_api import JobsApi
from .spool import Spool, SpoolEntry
from .tuner import TunedResult, Tuner
from .upload import tuned_meta

log = logging.getLogger("plancache.worker")

#: Errors that would recur on any worker of the environment: the job is failed for good.
PERMANENT_ERRORS: tuple[type[PlanCacheError], ...] = (InsufficientGpuMemory, SpecError)
#: The server's answers that this worker no longer holds a job's lease (taken over after it expired; the job
#: finished or released; claimed with a token this worker no longer uses).
LEASE_GONE: tuple[type[PlanCacheError], ...] = (LeaseLost, NotLeaseHolder, Conflict, NotFound)
MAX_ERROR_CHARS = 8000
#: How long a worker waits for a tuning it gave up on (past the job's time limit, or its lease lost) to stop, so that
#: two tunings do not time candidates on the GPU at once, before it goes on regardless (a build in flight ends first).
CANCEL_WAIT_SECONDS = 30.0


@dataclass
class WorkerStats:
    """What one :meth:`Worker.run` did."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    released: int = 0
    dropped: int = 0


def lease_duration(claim: ClaimResponse) -> float:
    """How long a lease lasts, measured on the server's clock (expiry minus the claim's update time)
    when the server gives both, else against this machine's clock."""
    expires, claimed = claim.lease_expires_at, claim.job.updated_at
    if (expires.tzinfo is None) == (claimed.tzinfo is None) and expires > claimed:
        return (expires - claimed).total_seconds()
    now = datetime.now(UTC) if expires.tzinfo else datetime.now(UTC).replace(tzinfo=None)
    return max((expires - now).total_seconds(), 0.0)


class _Heartbeat(threading.Thread):
    """Extends a job's lease every ``interval`` seconds (a third of the lease) until halted; sets :attr:`lost` when
    fenced. A beat waits at most half an interval for its answer, and one that fails is tried again a quarter of an
    interval later, so that a hung or refused beat leaves two more tries before the lease runs out.

    It keeps beating while the result is delivered (a long upload must not let the lease run out), so a
    beat may reach the server just after the worker's own completion or failure ended the lease:
    :meth:`finishing` is called first, and a refusal from then on is that, not a lost lease.
    """

    def __init__(self, client: JobsApi, job_id: int, lease: LeaseRequest, interval: float,
                 alive: Callable[[], None] = lambda: None) -> None:
        super().__init__(daemon=True, name=f"heartbeat-job-{job_id}")
        self.client, self.job_id, self.lease, self.interval, self.alive = client, job_id, lease, interval, alive
        self.lost = threading.Event()
        self._halt = threading.Event()
        self._finishing = threading.Event()

    def finishing(self) -> None:
        """The worker is about to complete or fail the job itself."""
        self._finishing.set()

    def run(self) -> None:
        delay = self.interval
        while not self._halt.wait(delay):
            self.alive()
            try:
                self.client.heartbeat(self.job_id, self.lease, timeout=self.interval / 2)
            except LEASE_GONE as exc:
                if self._finishing.is_set():  # this worker's own completion or failure got there first
                    log.debug("job %d: heartbeat after the job was finished (%s)", self.job_id, exc.message)
                else:
                    log.warning("job %d: lease lost (%s)", self.job_id, exc.message)
                    self.lost.set()
                return
            except PlanCacheError as exc:
                log.warning("job %d: heartbeat failed (%s); trying again", self.job_id, exc.message)
                delay = self.interval / 4
            else:
                delay = self.interval

    def halt(self) -> None:
        self._halt.set()
        self.join()


@dataclass
class _Held:
    """A claimed job: its lease, the heartbeat keeping it, and its checked spec or why it failed the checks."""

    claim: ClaimResponse
    lease: LeaseRequest
    beat: _Heartbeat
    spec: GraphSpec | None
    error: PlanCacheError | None = None

    def checked_spec(self) -> GraphSpec:
        """The spec; raises why the job failed its checks."""
        if self.spec is None:
            assert self.error is not None
            raise self.error
        return self.spec


@dataclass
class _Tuning:
    """The outcome of the tuning thread."""

    tuned: TunedResult | None = None
    meta: PlanMeta | None = None
    round_trip_error: float | None = None
    error: Exception | None = None
    cancel: threading.Event = field(default_factory=threading.Event)  # set: the result is no longer wanted


class Worker:
    """Tunes the jobs a plancache server hands out for this machine's GPU environment. ``job_timeout``: seconds
    one job's tuning and verification may take (``PLANCACHE_JOB_TIMEOUT``); ``alive_file``
    (``PLANCACHE_ALIVE_FILE``): touched at every turn of the loop and every heartbeat of a held job, so that a
    liveness probe can tell a stuck worker by its age."""

    def __init__(self, client: JobsApi, tuner: Tuner, signer: Signer, spool: Spool, *, worker_id: str,
                 poll_interval: float = 5.0, once: bool = False, shutdown_grace: float = 25.0,
                 job_timeout: float = DEFAULT_JOB_TIMEOUT, alive_file: Path | None = None) -> None:
        self.alive_file = alive_file
        self.client = client
        self.tuner = tuner
        self.signer = signer
        self.spool = spool
        self.worker_id = check_worker_id(worker_id)
        self.poll_interval = poll_interval
        self.once = once
        self.shutdown_grace = shutdown_grace
        self.job_timeout = job_timeout
        self.stats = WorkerStats()
        self.environment: Environment | None = None

    def run(self, stop: threading.Event) -> WorkerStats:
        """Work until ``stop`` is set (or, with ``once``, until no job is left for this environment).

        Spooled results from earlier runs are delivered first. Unreachable servers are
        retried with backoff; only a revoked or wrong token (401/403) ends the loop early.
        """
        self.client.http.stop = stop
        env = self.environment = self.tuner.environment()
        log.info("worker %s: environment %s (env_id %s), signing key %s, spool %s",
                 self.worker_id, env.describe(), env.env_id, self.signer.key_id, self.spool.directory)
        ahead = self.tuner.pipelines()
        following: _Held | None = None
        try:
            while not stop.is_set():
                self.alive()
                if not self.flush_spool():
                    if self.once and not stop.is_set():  # --once retries for a while only: it exits, saying why
                        raise ServerUnavailable(f"the server could not be reached; results wait in {self.spool.directory}")
                    break
                current, following = following, None
                if current is None:
                    try:
                        current = self._claim()
                    except ServerUnavailable:
                        if self.once and not stop.is_set():
                            raise
                        break  # only raised once stopping (--once: after its client's retries too)
                if current is None:
                    if self.once:
                        log.info("worker %s: no job for this environment; exiting (--once)", self.worker_id)
                        break
                    stop.wait(self.poll_interval)
                    continue
                if ahead:
                    try:
                        following = self._claim()
                    except ServerUnavailable:
                        following = None
                if stop.is_set():  # told to stop while claiming: never started, another worker may take it now
                    self._release(current)
                    break
                self.process(current, stop, following=following.spec if following else None)
        finally:
            if following is not None:  # claimed ahead, never started: another worker may take it now
                self._release(following)
        log.info("worker %s: stopped (%s)", self.worker_id, self.stats)
        return self.stats

    def alive(self) -> None:
        """Touch :attr:`alive_file` (a failure is logged: a probe then sees its age and restarts the worker)."""
        if self.alive_file is not None:
            try:
                self.alive_file.touch()
            except OSError as exc:
                log.warning("worker %s: cannot touch the alive file %s: %s", self.worker_id, self.alive_file, exc)

    def _release(self, held: _Held) -> None:
        """Give back a claimed job whose attempt does not count: never started, or its tuning cut off at a stop."""
        held.beat.finishing()
        held.beat.halt()
        self._fail(held.claim.job.id, held.lease, "worker shutting down", retryable=True, released=True)
        self.stats.released += 1

    def _claim(self) -> _Held | None:
        """The next job for this environment, its lease heartbeating from now on; None when there is none."""
        assert self.environment is not None
        claim = self.client.claim(self.environment, self.worker_id)
        if claim is None:
            return None
        job = claim.job
        lease = LeaseRequest(worker_id=self.worker_id, lease_token=claim.lease_token)
        duration = lease_duration(claim)
        self.stats.claimed += 1
        log.info("job %d: claimed graph %s (attempt %d of %d, lease %.1fs)",
                 job.id, job.graph_key[:12], job.attempts, job.max_attempts, duration)
        beat = _Heartbeat(self.client, job.id, lease, interval=max(duration / 3, 0.1), alive=self.alive)
        beat.start()
        try:
            return _Held(claim, lease, beat, self._check_job(claim))
        except PlanCacheError as exc:  # the job is failed with this reason when it is processed
            return _Held(claim, lease, beat, None, exc)

    def flush_spool(self) -> bool:
        """Deliver every spooled result; False when stopped before all were delivered."""
        return all(self._deliver(entry) for entry in self.spool.pending())

    # ------------------------------------------------------------ one job

    def process(self, held: _Held, stop: threading.Event, *, following: GraphSpec | None = None) -> None:
        """Tune one claimed job (``following``: the one to tune next) and publish or fail it; its heartbeat, started
        by the claim, stops here."""
        assert self.environment is not None, "run() sets the environment"
        beat, job = held.beat, held.claim.job
        try:
            entry = self._tune_job(held, stop, following)
            beat.finishing()  # the job was failed or released, or is delivered now
            if entry is not None:
                try:
                    log.info("job %d: result spooled at %s", job.id, self.spool.save(entry))
                except OSError as exc:
                    log.error("job %d: could not spool the result (%s); delivering it unspooled", job.id, exc)
                self._deliver(entry)
        finally:
            beat.halt()

    def _tune_job(self, held: _Held, stop: threading.Event, following: GraphSpec | None) -> SpoolEntry | None:
        """Run the GPU step in a thread; the signed result, or None when the job was failed, released or lost."""
        claim, lease, beat, job = held.claim, held.lease, held.beat, held.claim.job
        try:
            spec = held.checked_spec()
            _check_revision_lead(claim.min_revision)
            need = self.tuner.check_memory(spec)
        except PlanCacheError as exc:
            beat.finishing()
            self._report_failure(job, lease, exc, permanent=isinstance(exc, InvalidValue))
            return None
        log.info("job %d: tuning (needs ~%.1f MiB of device memory)", job.id, need / 2**20)
        outcome = _Tuning()
        done = threading.Event()
        thread = threading.Thread(target=self._tune_and_verify, args=(spec, following, outcome, done), daemon=True,
                                  name=f"tune-job-{job.id}")
        thread.start()
        deadline = time.monotonic() + self.job_timeout
        while not done.wait(0.05):
            if time.monotonic() > deadline:
                log.error("job %d: tuning still running after %gs; cancelling it", job.id, self.job_timeout)
                outcome.cancel.set()  # whatever the thread still returns is never published
                beat.finishing()
                self._report_failure(job, lease, TuningError(
                    f"the job ran past its wall-clock limit of {self.job_timeout:g} s on worker {self.worker_id} "
                    "(PLANCACHE_JOB_TIMEOUT); its tuning was cancelled"))
                _wait_for_cancelled(job.id, done)
                return None
            if beat.lost.is_set():  # another worker has the job now: this tuning's result would be dropped
                log.warning("job %d: lease was taken over while tuning; cancelling the tuning", job.id)
                outcome.cancel.set()
                _wait_for_cancelled(job.id, done)
                break
            if stop.is_set():
                log.warning("job %d: stop requested; giving tuning %.1fs to finish", job.id, self.shutdown_grace)
                if not done.wait(self.shutdown_grace):
                    outcome.cancel.set()
                    self._release(held)
                    return None
        if beat.lost.is_set():
            log.warning("job %d: lease was taken over while tuning; dropping the result", job.id)
            self.stats.dropped += 1
            return None
        if outcome.error is not None:
            beat.finishing()
            self._report_failure(job, lease, outcome.error)
            return None
        tuned = outcome.tuned
        assert tuned is not None and outcome.meta is not None
        # above the revision the claim names (a withdrawal's, signed on a clock that may run ahead of this one)
        floor = max(outcome.meta.revision, claim.min_revision)
        meta = self.signer.sign(outcome.meta.model_copy(update={"revision": floor}))
        log.info("job %d: winner %.4f ms (heuristic %s ms), error %.3g, round trip error %.3g, tuned in %.2fs",
                 job.id, tuned.winner_median_ms, tuned.heuristic_median_ms, tuned.max_abs_err,
                 outcome.round_trip_error, tuned.tuning_seconds)
        return SpoolEntry(job.id, claim.lease_token, self.worker_id, meta, spec.to_json(), tuned.blob,
                          CandidateTable.best_of(tuned.candidates))

    def _check_job(self, claim: ClaimResponse) -> GraphSpec:
        spec = parse_spec(claim.spec)
        if spec.graph_key != claim.job.graph_key:
            raise SpecError(f"the job's spec hashes to {spec.graph_key}, not to its graph key {claim.job.graph_key}")
        assert self.environment is not None
        if not claim.job.target.matches(self.environment):
            raise EnvironmentMismatch(f"job {claim.job.id} targets {claim.job.target.model_dump(exclude_none=True)}, "
                                      f"not this worker's environment {self.environment.env_id}")
        return spec

    def _tune_and_verify(self, spec: GraphSpec, following: GraphSpec | None, outcome: _Tuning,
                         done: threading.Event) -> None:
        """Thread body: autotune, then check the blob (:func:`tuned_meta`) and its numerics after a round trip."""
        try:
            tuned = self.tuner.tune(spec, following=following, cancel=outcome.cancel)
            assert self.environment is not None
            meta = tuned_meta(tuned, spec.graph_key, self.worker_id, self.environment)
            outcome.round_trip_error = self.tuner.verify(spec, tuned.blob)
            outcome.tuned, outcome.meta = tuned, meta
        except Exception as exc:  # reported to the server as the attempt's failure reason
            outcome.error = exc
        finally:
            done.set()

    # ------------------------------------------------------------ talking to the server

    def _deliver(self, entry: SpoolEntry) -> bool:
        """Send a spooled result as its job's completion, retrying while the server is down: the blob first (raw
        bytes, ``PUT /v1/blobs``, skipped when the server has it), then the signed record alone.
        False when stopped first (the entry stays spooled); the entry is removed otherwise."""
        lease = LeaseRequest(worker_id=entry.worker_id, lease_token=entry.lease_token)
        try:
            req = CompleteRequest(**lease.model_dump(), plan=entry.upload())  # the signed record alone
            for again in (False, True):
                self.client.put_blob(entry.meta.blob_sha256, entry.blob, job_id=entry.job_id, lease=lease)
                try:
                    self.client.complete(entry.job_id, req)
                    break
                except NotFound:  # the blob was collected between its upload and the record: once more
                    if again:
                        raise
        except ServerUnavailable as exc:
            log.warning("job %d: not delivered (%s); the result stays in %s", entry.job_id, exc.message,
                        self.spool.directory)
            return False
        except (LeaseLost, NotLeaseHolder) as exc:
            log.warning("job %d: lease lost (%s); dropping the spooled result", entry.job_id, exc.message)
            self.stats.dropped += 1
        except (Unauthorized, Forbidden):
            raise
        except PlanCacheError as exc:
            log.error("job %d: the server refused the plan: %s", entry.job_id, exc.message)
            permanent = isinstance(exc, (Conflict, PayloadTooLarge))  # the same plan would be refused again
            self._fail(entry.job_id, lease, f"server refused the plan: {exc.message}", retryable=not permanent)
            self.stats.failed += 1
        else:
            log.info("job %d: published plan %s (%d bytes, key %s)", entry.job_id, entry.meta.blob_sha256[:12],
                     entry.meta.blob_size, entry.meta.signer_key_id)
            self.stats.succeeded += 1
        self.spool.remove(entry)
        return True

    def _report_failure(self, job: Job, lease: LeaseRequest, exc: Exception, *, permanent: bool = False) -> None:
        """Fail the job's attempt with ``exc``'s reason, for good when ``permanent`` or of a :data:`PERMANENT_ERRORS`
        class (retried otherwise)."""
        if isinstance(exc, PlanCacheError):
            reason = f"{exc.code}: {exc.message}"
        else:
            log.error("job %d: unexpected error while tuning", job.id, exc_info=exc)
            reason = f"{type(exc).__name__}: {exc}"
        retryable = not (permanent or isinstance(exc, PERMANENT_ERRORS))
        log.error("job %d: failed (%s): %s", job.id, "will be retried" if retryable else "permanent", reason)
        self._fail(job.id, lease, reason, retryable=retryable)
        self.stats.failed += 1

    def _fail(self, job_id: int, lease: LeaseRequest, reason: str, *, retryable: bool, released: bool = False) -> None:
        """Report a failed attempt (``retryable``: the job goes back to the queue; ``released``: the worker is
        stopping, and the attempt is given back)."""
        # as the wire takes text: an undecodable byte of a path (a lone surrogate) escaped, NUL spelled out
        wire = reason.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
        req = FailRequest(worker_id=lease.worker_id, lease_token=lease.lease_token, error=wire[:MAX_ERROR_CHARS],
                          retryable=retryable, released=released)
        try:
            self.client.fail(job_id, req)
        except ServerUnavailable as exc:
            log.warning("job %d: could not report the failure (%s); its lease will expire", job_id, exc.message)
        except LEASE_GONE as exc:
            log.warning("job %d: failure not recorded: %s", job_id, exc.message)
        else:
            log.info("job %d: failure reported (%s)", job_id, "retryable" if retryable else "permanent")


def _check_revision_lead(min_revision: int) -> None:
    """:class:`InvalidValue` when ``min_revision`` is more than :data:`~plancache.signing.MAX_REVISION_LEAD_MS` ahead
    of this clock: a plan signed further ahead would be kept by clients over every later plan of its key for as long,
    so such a job fails for good, saying so, before it is tuned."""
    lead = min_revision - time.time_ns() // 1_000_000
    if lead > MAX_REVISION_LEAD_MS:
        raise InvalidValue(f"the claim asks for a plan above revision {min_revision}, {lead / 3_600_000:.0f} h ahead of "
                           "this worker's clock: a plan signed that far ahead would hold off every later plan of its "
                           "key for as long; check the clocks of the server's admins and workers (revisions are "
                           "milliseconds since the epoch), then enqueue the graph again")


def _wait_for_cancelled(job_id: int, done: threading.Event) -> None:
    """Wait up to :data:`CANCEL_WAIT_SECONDS` for a tuning told to stop to end (``done``)."""
    if not done.wait(CANCEL_WAIT_SECONDS):
        log.error("job %d: the cancelled tuning is still running; going on without it", job_id)


def stop_on_signals(stop: threading.Event) -> None:
    """Set ``stop`` on SIGTERM or SIGINT (call from the main thread)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        log.warning("received %s; finishing or releasing the current job", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def check_worker_id(worker_id: str) -> str:
    """``worker_id`` if it can name a worker (:data:`~plancache.protocol.WORKER_ID_PATTERN`: it is sent in a header of
    blob uploads), else :class:`~plancache.errors.InvalidValue` saying what it may hold."""
    if not re.fullmatch(WORKER_ID_PATTERN, worker_id):
        raise InvalidValue(f"worker id {worker_id!r} cannot be used: a worker id is 1 to 256 printable ASCII "
                           "characters with no space at either end")
    return worker_id


def default_worker_id() -> str:
    """``<hostname>-<pid>``, each character of the host name a worker id cannot hold (:func:`check_worker_id`) as
    ``-``."""
    host = re.sub(r"[^!-~]", "-", socket.gethostname())
    return f"{host[:240]}-{os.getpid()}"
