"""One worker process per GPU of a host (``plancache worker --all-devices``): start them, label their output,
forward stop signals, and exit with the first failure.

The supervisor runs no CUDA itself. Each child is a whole worker with its own device, spool folder and worker id
(the command line builds them); every line a child writes comes out on the supervisor's stderr behind its label
(``[gpu3] ...``). SIGTERM and SIGINT are passed on to every child still running, each of which drains as a lone
worker does (a tuning in progress gets its shutdown grace, then its job is released). A child that exits non-zero
while the others run makes the supervisor stop them the same way and exit with that child's code: a service
manager sees the failure and restarts the set, instead of a host running short of a GPU unnoticed.
"""

from __future__ import annotations

import logging
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import IO

log = logging.getLogger("plancache.worker")

#: The signals passed on to the children.
FORWARDED = (signal.SIGTERM, signal.SIGINT)
#: How long the output of a child that exited is still copied.
PUMP_GRACE_SECONDS = 5.0
#: The longest line of a child's output copied as one line (a longer one is copied in pieces of this many characters).
MAX_LINE_CHARS = 64 * 1024


@dataclass(frozen=True)
class Child:
    """One process to supervise: its ``label`` (the prefix of its output lines), command line and whole
    environment."""

    label: str
    argv: Sequence[str]
    env: Mapping[str, str]


def exit_status(returncode: int) -> int:
    """A child's return code as a process exit status (killed by signal N: 128 + N, as a shell says)."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Runs ``children`` until all have exited (see the module docstring); their output goes to ``out``.
    ``poll``: seconds between looks at the children and at the signals received."""

    def __init__(self, children: Sequence[Child], *, out: IO[str] | None = None, poll: float = 0.1,
                 kill_after: float = 60.0) -> None:
        if not children:
            raise ValueError("a supervisor needs at least one child")
        if len({c.label for c in children}) != len(children):
            raise ValueError(f"children need distinct labels, got {[c.label for c in children]}")
        self.children = list(children)
        self.out = out if out is not None else sys.stderr
        self.poll = poll
        self.kill_after = kill_after  # a child still running this long after it was told to stop is killed
        self._stopping_since: float | None = None
        self._signals: list[int] = []  # received, not yet forwarded (appended by the signal handler)
        self._out_lock = threading.Lock()

    def install_signal_handlers(self) -> None:
        """Forward SIGTERM and SIGINT to the children from now on (call from the main thread)."""
        for signum in FORWARDED:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.deliver(signum)

    def deliver(self, signum: int) -> None:
        """Pass ``signum`` on to every running child at the next look (what the signal handler does)."""
        self._signals.append(signum)

    def run(self) -> int:
        """Start every child, wait for all of them; 0, or the exit status of the first that failed."""
        procs, pumps = self._start()
        failed: int | None = None
        running = {child.label: proc for child, proc in zip(self.children, procs)}
        while running:
            while self._signals:
                signum = self._signals.pop(0)
                log.warning("received %s; passing it on to %d worker(s)", signal.Signals(signum).name, len(running))
                self._signal(running.values(), signum)
            for label, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[label]
                if code == 0:
                    log.info("%s: worker exited", label)
                    continue
                log.error("%s: worker exited with status %d", label, exit_status(code))
                if failed is None:
                    failed = exit_status(code)
                    if running:
                        log.error("stopping the other %d worker(s)", len(running))
                        self._signal(running.values(), signal.SIGTERM)
            if running and self._stopping_since is not None and \
                    time.monotonic() - self._stopping_since > self.kill_after:
                log.error("%d worker(s) still running %.0f s after they were told to stop; killing them",
                          len(running), self.kill_after)
                self._signal(running.values(), signal.SIGKILL)
                self._stopping_since = math.inf  # killed once
            if running:
                time.sleep(self.poll)
        for pump in pumps:  # a builder process outliving its worker may hold the pipe a little longer
            pump.join(PUMP_GRACE_SECONDS)
        return failed or 0

    def _start(self) -> tuple[list[subprocess.Popen[str]], list[threading.Thread]]:
        """Every child started, and the threads copying their output; none left running when one cannot start."""
        procs: list[subprocess.Popen[str]] = []
        pumps: list[threading.Thread] = []
        try:
            for child in self.children:
                proc = subprocess.Popen(list(child.argv), env=dict(child.env), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
                procs.append(proc)
                log.info("%s: started worker process %d", child.label, proc.pid)
                pump = threading.Thread(target=self._pump, args=(child.label, proc), daemon=True,
                                        name=f"supervisor-{child.label}")
                pump.start()
                pumps.append(pump)
        except OSError:
            self._signal(procs, signal.SIGTERM)
            for proc in procs:
                proc.wait()
            raise
        return procs, pumps

    def _signal(self, procs: Iterable[subprocess.Popen[str]], signum: int) -> None:
        if self._stopping_since is None:
            self._stopping_since = time.monotonic()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def _pump(self, label: str, proc: subprocess.Popen[str]) -> None:
        """Copy the child's output to :attr:`out`, each line behind ``[label]``."""
        assert proc.stdout is not None
        with proc.stdout:
            for line in iter(partial(proc.stdout.readline, MAX_LINE_CHARS), ""):
                text = line.removesuffix("\n")
                with self._out_lock:
                    self.out.write(f"[{label}] {text}\n")
                    self.out.flush()
