"""Test doubles for the worker's GPU step, so the job loop runs on machines without a GPU.

:class:`FakeTuner` is NOT a tuner: it sleeps for ``tune_seconds``, returns a deterministic
pseudo-random "blob" derived from the graph key, and can be told to fail the numerics check,
to claim the device is too small, to hang on some graphs, or to finish only once a test opens its gate.
Run as a script (``python -m tests.worker_fakes …``) it runs a real :class:`~plancache.worker.Worker` with a
FakeTuner, for the subprocess tests (SIGKILL, SIGSTOP, SIGTERM); it prints the run's stats as one JSON line on exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from plancache.environment import Environment
from plancache.errors import InsufficientGpuMemory, TuningError
from plancache.protocol import Candidate, PlanMeta
from plancache.spec import GraphSpec

from .factories import H200, make_meta

#: :data:`~tests.factories.H200`'s validity fields, named as the test double it is.
FAKE_ENV = H200.model_copy(update={"device_name": "FakeTuner test double (no GPU)", "cuda_runtime": "",
                                   "torch_version": ""})
DTYPE_BYTES = {"HALF": 2, "BFLOAT16": 2, "FLOAT": 4, "INT32": 4, "INT64": 8, "FP8_E4M3": 1, "FP8_E5M2": 1}


@dataclass
class FakeTunedPlan:
    """A :class:`plancache.gpu.TunedPlan`-shaped result made by :class:`FakeTuner`."""

    blob: bytes
    sha256: str
    environment: Environment
    engine_id: int = 7
    knobs: dict[str, int] = field(default_factory=lambda: {"TILE_SIZE": 2})
    max_abs_err: float = 0.001
    tuning_seconds: float = 0.0
    winner_median_ms: float = 0.05
    heuristic_median_ms: float | None = 0.08
    candidates: list[Candidate] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.candidates:
            self.candidates = [Candidate(index=0, engine_id=self.engine_id, knobs=self.knobs,
                                         median_ms=self.winner_median_ms, status="ok")]

    def to_meta(self, graph_key: str, worker_id: str) -> PlanMeta:
        return make_meta(
            graph_key, self.environment, self.blob, blob_sha256=self.sha256, engine_id=self.engine_id,
            knobs=self.knobs, plan_name="fake_engine7", workspace_bytes=0, winner_median_ms=self.winner_median_ms,
            heuristic_median_ms=self.heuristic_median_ms, worst_median_ms=0.5,
            tuning_seconds=self.tuning_seconds, worker_id=worker_id,
        )


class FakeTuner:
    """Test double of :class:`plancache.worker.Tuner` (no GPU, no cuDNN)."""

    def __init__(self, environment: Environment = FAKE_ENV, *, tune_seconds: float = 0.0, fail_numerics: bool = False,
                 memory_bytes: int = 1 << 40, corrupt_digest: bool = False, blob_size: int = 4096,
                 pipelined: bool = False, hang: tuple[str, ...] = (), gate: threading.Event | None = None) -> None:
        self.env = environment
        self.tune_seconds = tune_seconds
        self.fail_numerics = fail_numerics
        self.memory_bytes = memory_bytes
        self.corrupt_digest = corrupt_digest
        self.blob_size = blob_size
        self.pipelined = pipelined
        self.hang = hang  # graph keys whose tuning hangs until cancelled or ``unhang`` is set (then fails)
        self.unhang = threading.Event()
        self.gate = gate  # when given, a tuning ends only once it is set (a test's step comes first, e.g. a server stop)
        self.cancelled: list[str] = []  # graph keys whose tuning stopped on being cancelled
        self.followings: list[str | None] = []  # per tuning, the graph key it was told comes next
        self.tuned: list[str] = []
        self.verified: list[str] = []

    def environment(self) -> Environment:
        return self.env

    def check_memory(self, spec: GraphSpec) -> int:
        need = sum(math.prod(t.dim) * DTYPE_BYTES[spec.data_type_of(t)] for t in spec.tensors if t.dim)
        if need > self.memory_bytes:
            raise InsufficientGpuMemory(f"FakeTuner: spec needs {need} bytes, the fake device has {self.memory_bytes}")
        return need

    def pipelines(self) -> bool:
        return self.pipelined

    def tune(self, spec: GraphSpec, *, following: GraphSpec | None = None,
             cancel: threading.Event | None = None) -> FakeTunedPlan:
        self.followings.append(following.graph_key if following else None)
        if spec.graph_key in self.hang:
            while not self.unhang.wait(0.02):
                if cancel is not None and cancel.is_set():
                    self.cancelled.append(spec.graph_key)
                    raise TuningError("FakeTuner: a hung tuning was cancelled")
            raise TuningError("FakeTuner: a hung tuning was let go")
        time.sleep(self.tune_seconds)
        if self.gate is not None and not self.gate.wait(60):
            raise TuningError("FakeTuner: the gate was not opened within 60 s")
        self.tuned.append(spec.graph_key)
        blob = fake_blob(spec.graph_key, self.blob_size)
        digest = "0" * 64 if self.corrupt_digest else hashlib.sha256(blob).hexdigest()
        return FakeTunedPlan(blob=blob, sha256=digest, environment=self.env, tuning_seconds=self.tune_seconds)

    def verify(self, spec: GraphSpec, blob: bytes) -> float:
        self.verified.append(spec.graph_key)
        if self.fail_numerics:
            raise TuningError("FakeTuner: the deserialized plan's output differs from the reference (told to fail)")
        return 0.001


def fake_blob(graph_key: str, size: int = 4096) -> bytes:
    return random.Random(graph_key).randbytes(size)


def main() -> None:
    from plancache.signing import Signer
    from plancache.worker import JobsApi, Spool, Worker, stop_on_signals

    p = argparse.ArgumentParser(description="run a real Worker whose GPU step is the FakeTuner test double")
    p.add_argument("--server", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--spool-dir", type=Path, required=True)
    p.add_argument("--signing-key", type=Path, required=True)
    p.add_argument("--tune-seconds", type=float, default=0.0)
    p.add_argument("--poll-interval", type=float, default=0.1)
    p.add_argument("--shutdown-grace", type=float, default=25.0)
    p.add_argument("--once", action="store_true")
    p.add_argument("--pipelined", action="store_true", help="claim the next job ahead, as with builder processes")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    stop_on_signals(stop)
    with JobsApi.open(args.server, args.token) as client:
        tuner = FakeTuner(tune_seconds=args.tune_seconds, pipelined=args.pipelined)
        worker = Worker(client, tuner, Signer.from_file(args.signing_key),
                        Spool(args.spool_dir), worker_id=args.worker_id, poll_interval=args.poll_interval,
                        once=args.once, shutdown_grace=args.shutdown_grace)
        stats = worker.run(stop)
    print(json.dumps(dataclasses.asdict(stats)), flush=True)


if __name__ == "__main__":
    main()
