"""``PLANCACHE_TEST_FAILURE_LOG`` (tests/conftest.py): each failure is written to the file as it happens, so a run
killed before pytest's summary still tells why its failed tests failed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_failure_is_in_the_log_before_the_run_ends(tmp_path):
    suite = tmp_path / "test_probe.py"
    suite.write_text("import time\n\n"
                     "def test_fails():\n    assert 1 + 1 == 3, 'the probe failed on purpose'\n\n"
                     "def test_hangs():\n    time.sleep(60)\n")
    log = tmp_path / "failures.txt"
    env = {**os.environ, "PLANCACHE_TEST_FAILURE_LOG": str(log)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                             "--rootdir", str(tmp_path), str(suite)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (log.exists() and "probe failed" in log.read_text()):
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended: the log was not written while it was under way"
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert "FAILED test_probe.py::test_fails (call)" in text and "probe failed on purpose" in text
    assert "test_hangs" not in text
