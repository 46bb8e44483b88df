"""``plancache worker --all-devices``'s supervisor with stand-in children (small Python programs, no GPU): every
child starts with its own command line and environment, its lines come out behind its label, SIGTERM and SIGINT
reach every child, and the exit status is 0 or the first failure's, the others being stopped."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plancache.worker.supervisor import Child, Supervisor, exit_status

ROOT = Path(__file__).resolve().parents[2]

#: A stand-in worker: says it is ready, then waits for a signal; on SIGTERM or SIGINT it says which and exits with
#: DRAIN_EXIT (default 0). With EXIT it exits with that status instead (once the file WHEN exists, if given), with
#: KILL it kills itself (SIGKILL) the same way.
FAKE_WORKER = """
import os, signal, sys, time
def drain(signum, frame):
    print(f"draining on {signal.Signals(signum).name}", flush=True)
    sys.exit(int(os.environ.get("DRAIN_EXIT", "0")))
signal.signal(signal.SIGTERM, drain)
signal.signal(signal.SIGINT, drain)
print(f"ready {os.environ['LABEL']} {' '.join(sys.argv[1:])}", flush=True)
when = os.environ.get("WHEN")
while when and not os.path.exists(when):
    time.sleep(0.02)
if os.environ.get("EXIT") is not None:
    sys.exit(int(os.environ["EXIT"]))
if os.environ.get("KILL"):
    os.kill(os.getpid(), signal.SIGKILL)
while True:
    time.sleep(0.05)
"""


def fake(label: str, *args: str, **env: str) -> Child:
    return Child(label, [sys.executable, "-c", FAKE_WORKER, *args], {**os.environ, "LABEL": label, **env})


def run_in_thread(sup: Supervisor) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    thread.start()
    return thread, result


def wait_for(out: io.StringIO, text: str, count: int = 1, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while out.getvalue().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} x{count} not seen in:\n{out.getvalue()}"
        time.sleep(0.02)


def test_children_start_with_their_own_arguments_and_environment_and_their_lines_are_labelled():
    out = io.StringIO()
    sup = Supervisor([fake("gpu0", "--device", "0", EXIT="0"), fake("gpu1", "--device", "0", EXIT="0")], out=out,
                     poll=0.02)
    assert sup.run() == 0
    assert sorted(out.getvalue().splitlines()) == ["[gpu0] ready gpu0 --device 0", "[gpu1] ready gpu1 --device 0"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_passed_on_to_every_child_which_drains(signum):
    out = io.StringIO()
    sup = Supervisor([fake(f"gpu{n}") for n in range(3)], out=out, poll=0.02)
    thread, result = run_in_thread(sup)
    wait_for(out, "ready", 3)
    sup.deliver(signum)
    thread.join(20)
    assert result == [0]
    for n in range(3):
        assert f"[gpu{n}] draining on {signal.Signals(signum).name}" in out.getvalue()


def test_a_failing_child_stops_the_others_and_its_status_is_the_supervisors(tmp_path):
    out = io.StringIO()
    go = tmp_path / "go"
    sup = Supervisor([fake("gpu0"), fake("gpu1", EXIT="3", WHEN=str(go)), fake("gpu2")], out=out, poll=0.02)
    thread, result = run_in_thread(sup)
    wait_for(out, "ready", 3)
    go.touch()  # gpu1 fails now
    thread.join(20)
    assert result == [3]
    assert "[gpu0] draining on SIGTERM" in out.getvalue() and "[gpu2] draining on SIGTERM" in out.getvalue()


def test_a_child_failing_its_drain_fails_the_supervisor():
    out = io.StringIO()
    sup = Supervisor([fake("gpu0"), fake("gpu1", DRAIN_EXIT="7")], out=out, poll=0.02)
    thread, result = run_in_thread(sup)
    wait_for(out, "ready", 2)
    sup.deliver(signal.SIGTERM)
    thread.join(20)
    assert result == [7]


def test_a_child_killed_by_a_signal_exits_128_plus_it(tmp_path):
    assert exit_status(-signal.SIGKILL) == 128 + signal.SIGKILL and exit_status(0) == 0 and exit_status(4) == 4
    out = io.StringIO()
    go = tmp_path / "go"
    sup = Supervisor([fake("gpu0"), fake("gpu1", KILL="1", WHEN=str(go))], out=out, poll=0.02)
    thread, result = run_in_thread(sup)
    wait_for(out, "ready", 2)
    go.touch()
    thread.join(20)
    assert result == [128 + signal.SIGKILL]
    assert "[gpu0] draining on SIGTERM" in out.getvalue()


def test_sigterm_to_the_supervisor_process_reaches_the_children(tmp_path):
    script = tmp_path / "supervise.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from plancache.worker.supervisor import Supervisor
from tests.unit.test_supervisor import fake
sup = Supervisor([fake("gpu0"), fake("gpu1")], out=sys.stdout, poll=0.02)
sup.install_signal_handlers()
sys.exit(sup.run())
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    assert all("ready" in line for line in lines), lines
    proc.send_signal(signal.SIGTERM)  # to the supervisor alone: its children are in its process group, not signalled
    rest, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert sorted(rest.splitlines()) == ["[gpu0] draining on SIGTERM", "[gpu1] draining on SIGTERM"]


def test_a_supervisor_needs_children_with_distinct_labels():
    with pytest.raises(ValueError, match="at least one child"):
        Supervisor([])
    with pytest.raises(ValueError, match="distinct labels"):
        Supervisor([fake("gpu0"), fake("gpu0")])


def test_a_child_that_cannot_start_stops_those_started():
    sup = Supervisor([fake("gpu0"), Child("gpu1", [str(ROOT / "no-such-program")], dict(os.environ))],
                     out=io.StringIO())
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        sup.run()  # returns once gpu0, which would wait for a signal forever, was stopped and reaped
    assert time.monotonic() - t0 < 10
