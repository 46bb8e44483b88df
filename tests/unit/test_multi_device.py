"""Several GPUs on one host, without a GPU: which device a process, a builder process or a worker child means
(``CUDA_VISIBLE_DEVICES`` renumbering followed), an ``OrderedPool`` environment set before its processes import
anything, builder sizing per GPU, and a plan's launches made on its own device."""

from __future__ import annotations

import os
import threading

import pytest

from plancache.environment import device_selector, visible_devices
from plancache.errors import GpuUnavailable
from plancache.procpool import OrderedPool


@pytest.mark.parametrize(("value", "entries"), [
    (None, None),
    ("", []),
    ("2,3", ["2", "3"]),
    (" 02 , 5", ["2", "5"]),
    ("GPU-5f0c1a2b-aaaa, MIG-GPU-5f0c/1/0", ["GPU-5f0c1a2b-aaaa", "MIG-GPU-5f0c/1/0"]),
    ("0,-1,2", ["0"]),          # CUDA stops at the first invalid entry
    ("1,gpu1,2", ["1"]),
    ("3,1,3", ["3", "1"]),      # and at a repeated one
])
def test_visible_devices_reads_the_list_as_cuda_does(value, entries):
    assert visible_devices({} if value is None else {"CUDA_VISIBLE_DEVICES": value}) == entries


def test_a_child_is_pinned_to_this_process_s_device_through_its_own_entry():
    assert device_selector(1, {}) == "1"
    assert device_selector(0, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "2"
    assert device_selector(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "3"
    assert device_selector(1, {"CUDA_VISIBLE_DEVICES": "GPU-aa11,GPU-bb22"}) == "GPU-bb22"
    with pytest.raises(GpuUnavailable, match=r"CUDA device 2 is not visible: CUDA_VISIBLE_DEVICES='2,3' makes 2"):
        device_selector(2, {"CUDA_VISIBLE_DEVICES": "2,3"})
    with pytest.raises(GpuUnavailable, match="not visible"):
        device_selector(0, {"CUDA_VISIBLE_DEVICES": "-1"})
    with pytest.raises(GpuUnavailable, match="0 or more"):
        device_selector(-1, {})


def test_pool_processes_get_their_environment_before_importing_the_tasks_module():
    assert "PLANCACHE_TEST_PIN" not in os.environ
    from tests.pinned_env_task import seen_at_import

    with OrderedPool(2, environ={"PLANCACHE_TEST_PIN": "GPU-bb22"}) as pool:
        assert list(pool.map_ordered(seen_at_import, [1, 2, 3])) == ["GPU-bb22"] * 3
    assert "PLANCACHE_TEST_PIN" not in os.environ  # this process's own environment is left alone


def test_without_cuda_the_device_checks_say_so(monkeypatch):
    torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    from plancache.environment import detect, require_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(GpuUnavailable, match=r"torch sees no CUDA device; CUDA_VISIBLE_DEVICES='3'"):
        require_device(0)
    with pytest.raises(GpuUnavailable, match="no CUDA device"):
        detect(1)


def test_builders_are_pinned_through_cuda_visible_devices(monkeypatch):
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
    from plancache.gpu.candidates import builder_environ

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert builder_environ(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert builder_environ(1) == {"CUDA_VISIBLE_DEVICES": "6"}


@pytest.mark.parametrize(("cores", "builders"), [(128 // 8, 12), (64 // 8, 4), (32, 16), (192 // 8, 16), (3, 0)])
def test_builder_processes_are_sized_for_a_share_of_the_host(cores, builders):
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
    from plancache.gpu.candidates import default_processes

    assert default_processes(cores) == builders


def test_a_plan_sets_its_stream_and_launches_on_its_own_device():
    torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
    from plancache.client.plan import Plan
    from plancache.spec import SpecBuilder
    from tests.client_fakes import FakeBuiltPlan, RecordingBackend

    b = SpecBuilder(io_data_type="float32", name="relu")
    b.relu(b.tensor("X", dim=[1, 4])).set_output(True).set_name("Y")
    spec = b.build()
    seen: list[tuple[str, bool]] = []

    class Backend(RecordingBackend):
        def set_stream(self, stream: object) -> None:
            seen.append(("set_stream", self.on_device_now))
            super().set_stream(stream)

    class Built(FakeBuiltPlan):
        def execute(self, tensors: dict, workspace: object, handle: object) -> None:
            seen.append(("execute", backend.on_device_now))

    backend = Backend()
    plan = Plan(spec, spec.graph_key, Built(spec, "test"), backend, source="server", lock=threading.Lock())
    plan.execute(X=torch.zeros(1, 4), Y=torch.zeros(1, 4))
    assert seen == [("set_stream", True), ("execute", True)]
    assert not backend.on_device_now


def test_the_two_gpu_benchmark_compares_winners_by_the_one_worker_runs_table():
    from bench.multi_gpu import compare, per_worker

    def graph(name, engine, ms, worker, table):
        return {"name": name, "engine_id": engine, "knobs": {"K": 1}, "winner_ms": ms, "tuning_s": 2.0,
                "worker": worker, "candidates": table}

    table = [[1, {"K": 1}, 1.0], [2, {"K": 1}, 1.02], [3, {"K": 1}, 1.5]]
    one = {"graphs": [graph("a", 1, 1.0, "one", table), graph("b", 1, 1.0, "one", table),
                      graph("c", 1, 1.0, "one", table)]}
    two = {"graphs": [graph("a", 1, 1.0, "w-gpu0", []), graph("b", 2, 0.99, "w-gpu1", []),
                      graph("c", 3, 0.98, "w-gpu1", [])]}
    result = compare(one, two, noise=0.03)
    assert [g["verdict"] for g in result["per_graph"]] == ["same", "tie", "different"]
    assert result["different"] == ["c"] and result["per_graph"][2]["tuned_by"] == "w-gpu1"
    assert per_worker(two) == {"w-gpu0": {"graphs": 1, "tuning_s": 2.0}, "w-gpu1": {"graphs": 2, "tuning_s": 4.0}}


def test_the_docs_start_workers_with_options_the_worker_has():
    import re
    from pathlib import Path

    import typer.main

    from plancache.cli import make_app

    worker = typer.main.get_command(make_app()).commands["worker"]
    options = {o for p in worker.params for o in p.opts}
    assert {"--device", "--all-devices", "--spool-dir", "--worker-id"} <= options
    root = Path(__file__).resolve().parents[2]
    used = []
    for path in (root / "README.md", *sorted((root / "docs").glob("*.md"))):
        for line in path.read_text().splitlines():
            for command in re.findall(r"plancache worker([^#`|]*)", line):
                used += re.findall(r"(?<![\w-])--[a-z][a-z-]*", command)
    assert "--all-devices" in used
    assert set(used) <= options, sorted(set(used) - options)


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "800000 100000\n"}, 8),          # cgroup v2, limits.cpu: 8
    ({"cpu.max": "250000 100000\n"}, 3),          # 2.5 CPUs: rounded up
    ({"cpu.max": "max 100000\n"}, None),          # no limit
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),                                   # no cgroup file system
])
def test_builders_are_sized_for_the_container_s_cpu_limit_not_the_node_s_cores(tmp_path, monkeypatch, files, quota):
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
    from plancache.gpu import candidates

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert candidates.cpu_quota(tmp_path) == quota
    monkeypatch.setattr(candidates, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(candidates.os, "sched_getaffinity", lambda _: set(range(128)), raising=False)
    assert candidates.usable_cores() == (128 if quota is None else quota)
