"""``plancache worker --all-devices`` on the CPU: refused with ``--device``, a clear GPU error where none is visible,
and, with the device count and the supervisor stood in, one child per GPU: each pinned to its GPU through
``CUDA_VISIBLE_DEVICES`` (the parent's own entries followed), with its spool folder, worker id and builder count,
the token in its environment and not on its command line; the supervisor's status is the command's."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from plancache.cli import make_app
from plancache.cli.failures import ExitCode
from tests.integration.test_cli import expected_failure


@pytest.fixture
def args(tmp_path):
    assert CliRunner().invoke(make_app(), ["keygen", str(tmp_path / "keys"), "--name", "w"]).exit_code == 0
    return ["worker", "--server", "http://127.0.0.1:9", "--token", "secret-token", "--signing-key",
            str(tmp_path / "keys" / "w.key"), "--spool-dir", str(tmp_path / "spool")]


def test_all_devices_with_device_is_refused(args):
    result = CliRunner().invoke(make_app(), [*args, "--all-devices", "--device", "1"])
    expected_failure(result, ExitCode.USAGE, "--all-devices", "--device", "CUDA_VISIBLE_DEVICES")


def test_all_devices_without_a_gpu_says_so(args, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    result = CliRunner().invoke(make_app(), [*args, "--all-devices"])
    expected_failure(result, ExitCode.GPU, "--all-devices found no GPU", "torch sees no CUDA device",
                     "CUDA_VISIBLE_DEVICES")
    assert not (tmp_path / "spool").exists()  # nothing started, nothing written


def test_all_devices_starts_one_pinned_worker_per_gpu(args, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
    from plancache import environment
    from plancache.worker.supervisor import Supervisor

    started = []

    def run(self):
        started.extend(self.children)
        return 3  # a child failed

    monkeypatch.setattr(environment, "require_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(Supervisor, "install_signal_handlers", lambda self: None)
    monkeypatch.setattr(Supervisor, "run", run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,GPU-7a")
    result = CliRunner().invoke(make_app(), [*args, "--all-devices", "--worker-id", "host-a", "--once",
                                             "--build-processes", "3"])
    assert result.exit_code == 3, result.output
    assert [c.label for c in started] == ["gpu0", "gpu1"]
    for n, (child, visible) in enumerate(zip(started, ["5", "GPU-7a"])):
        argv = list(child.argv)
        assert argv[argv.index("worker") - 2:argv.index("worker")] == ["-m", "plancache"]
        option = {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--") and a != "--once"}
        assert option["--device"] == "0" and option["--worker-id"] == f"host-a-gpu{n}"
        assert option["--spool-dir"] == str(tmp_path / "spool" / f"gpu{n}") and (tmp_path / "spool" / f"gpu{n}").is_dir()
        assert option["--build-processes"] == "3" and "--once" in argv and option["--server"] == "http://127.0.0.1:9"
        assert "secret-token" not in argv and child.env["PLANCACHE_TOKEN"] == "secret-token"
        assert child.env["CUDA_VISIBLE_DEVICES"] == visible


def test_all_devices_shares_the_cores_between_the_workers(args, monkeypatch):
    torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
    import os

    from plancache import environment
    from plancache.worker.supervisor import Supervisor

    started = []
    monkeypatch.setattr(environment, "require_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)))
    monkeypatch.setattr(Supervisor, "install_signal_handlers", lambda self: None)
    monkeypatch.setattr(Supervisor, "run", lambda self: started.extend(self.children) or 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PLANCACHE_BUILD_PROCESSES", raising=False)
    result = CliRunner().invoke(make_app(), [*args, "--all-devices"])
    assert result.exit_code == 0, result.output
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in started] == [str(n) for n in range(8)]
    for child in started:  # 16 cores per GPU: 12 builders each, as a lone worker on a 16-core host
        argv = list(child.argv)
        assert argv[argv.index("--build-processes") + 1] == "12"
