"""The deployment recipes in deploy/: the Kubernetes manifests pass ``kubernetes-validate --strict`` (Kubernetes'
own OpenAPI schemas), KEDA's ScaledObject (a CRD that tool has no schema for) scales the worker Deployment on a
metric the server really exports, every ``PLANCACHE_*`` variable they set is a real setting, and the Slurm job
script parses and runs the real worker command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from plancache.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
K8S = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
SBATCH = ROOT / "deploy" / "slurm" / "plancache-worker.sbatch"


def documents() -> list[dict]:
    return [doc for path in K8S for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_the_kubernetes_manifests_pass_the_kubernetes_schemas():
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    if validator is None:
        pytest.skip("kubernetes-validate is not installed (the dev extra)")
    proc = subprocess.run([validator, "--strict", *map(str, K8S)], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    passed = [ln for ln in lines if " passed for resource " in ln]
    unchecked = [ln for ln in lines if "Couldn't find schema" in ln]
    assert proc.returncode == 0 and len(passed) == len(documents()) - 1, "\n".join(lines)
    assert len(unchecked) == 1 and "ScaledObject" in unchecked[0]  # KEDA's CRD: checked below


def test_keda_scales_the_worker_deployment_on_the_queued_jobs_metric():
    from plancache.server.metrics import _JobsCollector
    from plancache.store.jobs import JOB_STATUSES

    docs = documents()
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    workers = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"
               and d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"}
    assert scaled["spec"]["scaleTargetRef"]["name"] in workers
    (trigger,) = scaled["spec"]["triggers"]
    metric = _JobsCollector(lambda: None)._family()
    m = re.fullmatch(r"sum\((\w+)\{(\w+)=\"(\w+)\"\}\)", trigger["metadata"]["query"])
    assert m and m.group(1) == metric.name and m.group(2) == "status" and m.group(3) in JOB_STATUSES


def test_each_worker_takes_one_gpu_of_one_sku():
    for d in documents():
        if d["kind"] == "Deployment" and d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker":
            pod = d["spec"]["template"]["spec"]
            assert "nvidia.com/gpu.product" in pod["nodeSelector"]
            (container,) = pod["containers"]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_every_plancache_variable_in_the_recipes_is_a_setting():
    known = {env_name(f) for f in Settings.model_fields}
    text = "\n".join(p.read_text() for p in [*K8S, SBATCH, *(ROOT / "docker").glob("*")] if p.is_file())
    used = set(re.findall(r"\bPLANCACHE_[A-Z_]+\b", text)) - {"PLANCACHE_WORKER_TOKEN", "PLANCACHE_SIGNING_KEY_FILE",
                                                                  "PLANCACHE_PORT"}  # compose's own variables
    assert used and used <= known, f"not settings: {sorted(used - known)}"


def test_the_slurm_script_parses_and_runs_the_worker_once(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    text = SBATCH.read_text()
    assert "#SBATCH --gres=gpu:1" in text and "exec plancache worker --once --worker-id" in text
    bin_dir = tmp_path / "bin"  # a plancache stand-in that records its arguments
    bin_dir.mkdir()
    (bin_dir / "plancache").write_text("#!/usr/bin/env bash\necho \"$@\" > \"$ARGS_FILE\"\n")
    (bin_dir / "plancache").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "ARGS_FILE": str(tmp_path / "args"),
           "PLANCACHE_SERVER_URL": "http://plancache:8787", "PLANCACHE_TOKEN": "pct_x", "SLURM_JOB_ID": "7",
           "SLURM_ARRAY_TASK_ID": "2"}
    assert subprocess.run(["bash", str(SBATCH)], env=env, timeout=30).returncode == 0
    args = (tmp_path / "args").read_text().split()
    assert args[:3] == ["worker", "--once", "--worker-id"] and args[3].startswith("slurm-7-2-")
    from typer.testing import CliRunner

    from plancache.cli import make_app

    helped = CliRunner().invoke(make_app(), ["worker", "--help"])
    assert "--once" in helped.output and "--worker-id" in helped.output
    missing = subprocess.run(["bash", str(SBATCH)], env={**env, "PLANCACHE_TOKEN": ""}, capture_output=True,
                             text=True, timeout=30)
    assert missing.returncode != 0 and "PLANCACHE_TOKEN" in missing.stderr


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(tmp_path):
    import json

    from plancache.server.metrics import Metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {family.name + suffix for family in Metrics(lambda: None).registry.collect()
                for suffix in suffixes.get(family.type, ("",))}
    exported.add("plancache_jobs")  # a gauge collected from the store, which is closed here
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "plancache.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\bplancache_[a-z_]+\b", e)}
    assert len(dashboard["panels"]) >= 6 and names and names <= exported, sorted(names - exported)
