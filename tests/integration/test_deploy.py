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


def test_keda_scales_each_gpu_type_on_its_own_jobs_counted_once_over_replicas():
    """The query takes ``max by`` every label of ``plancache_fleet_jobs`` (each replica reports the same figure),
    matches each environment label of the type (or a target's open ``""``) and counts running jobs too; its two
    replicas are evaluated in tests/integration/test_fleet_metrics.py."""
    from plancache.server.metrics import ENV_LABELS, _StoreCollector

    docs = documents()
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    workers = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"
               and d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"}
    assert scaled["spec"]["scaleTargetRef"]["name"] in workers
    (trigger,) = scaled["spec"]["triggers"]
    family = _StoreCollector._families()["fleet_jobs"]
    query = " ".join(trigger["metadata"]["query"].split())
    m = re.fullmatch(r"sum\(max by \(([\w, ]+)\) \((\w+)\{(.*)\}\)\)", query)
    assert m and m.group(2) == family.name, query
    assert [s.strip() for s in m.group(1).split(",")] == [*ENV_LABELS, "status"]
    matchers = dict(re.findall(r'(\w+)=~"([^"]*)"', m.group(3)))
    assert matchers.pop("status") == "queued|running"
    assert set(matchers) == set(ENV_LABELS) and all(v.endswith("|") for v in matchers.values())


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
    """Before: the token went on sbatch's command line (visible to every user) and the spool was keyed by the job
    id, so a requeued task never found what it had tuned."""
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    text = SBATCH.read_text()
    assert "#SBATCH --gres=gpu:1" in text and "exec plancache worker --once --worker-id" in text
    assert "PLANCACHE_TOKEN=" not in text.split("#SBATCH")[0]  # the usage line puts no secret on a command line
    bin_dir = tmp_path / "bin"  # a plancache stand-in that records its arguments and environment
    bin_dir.mkdir()
    (bin_dir / "plancache").write_text('#!/usr/bin/env bash\necho "$@" > "$ARGS_FILE"\n'
                                       'echo "$PLANCACHE_TOKEN $PLANCACHE_CACHE_DIR" > "$ENV_FILE"\n')
    (bin_dir / "plancache").chmod(0o755)
    token_file = tmp_path / ".config" / "plancache" / "worker.token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text("pct_secret\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "ARGS_FILE": str(tmp_path / "args"),
           "ENV_FILE": str(tmp_path / "env"), "PLANCACHE_SERVER_URL": "http://plancache:8787",
           "SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "2"}
    spools = []
    for job_id in ("7", "9"):  # a requeued task, or task 2 of the next submission
        assert subprocess.run(["bash", str(SBATCH)], env={**env, "SLURM_JOB_ID": job_id}, timeout=30).returncode == 0
        args = (tmp_path / "args").read_text().split()
        assert args[:3] == ["worker", "--once", "--worker-id"] and args[3].startswith("slurm-5-2-")
        assert "pct_secret" not in " ".join(args)
        token, spool = (tmp_path / "env").read_text().split()
        assert token == "pct_secret"
        spools.append(spool)
    assert spools[0] == spools[1] and spools[0].endswith("task-2") and spools[0].startswith(str(tmp_path))
    from typer.testing import CliRunner

    from plancache.cli import make_app

    helped = CliRunner().invoke(make_app(), ["worker", "--help"])
    assert "--once" in helped.output and "--worker-id" in helped.output
    token_file.unlink()
    missing = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 8 and "worker.token" in missing.stderr


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(tmp_path):
    import json

    from plancache.server.metrics import Metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {family.name + suffix for family in Metrics(lambda: None).registry.collect()
                for suffix in suffixes.get(family.type, ("",))}
    from plancache.server.metrics import _StoreCollector

    exported |= {f.name for f in _StoreCollector._families().values()}  # collected from the store, closed here
    exported.add("plancache_build_info")
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "plancache.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\bplancache_[a-z_]+\b", e)}
    assert len(dashboard["panels"]) >= 6 and names and names <= exported, sorted(names - exported)


def _pods() -> list[tuple[str, dict]]:
    """(name, pod spec) of every workload."""
    out = []
    for d in documents():
        if d["kind"] in ("Deployment", "Job"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
    return out


def _quantity(text: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}
    text = str(text)
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[:-len(unit)]) * factor
    return float(text)


def test_every_pod_meets_the_restricted_pod_security_standard():
    """Namespaces enforcing the restricted level admit the pods: non-root, RuntimeDefault seccomp, no privilege
    escalation, every capability dropped."""
    pods = _pods()
    assert {name for name, _ in pods} >= {"plancache-server", "plancache-worker-h200"}
    for name, pod in pods:
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0, name
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name


def test_the_worker_can_read_its_signing_key_and_says_when_it_is_alive():
    """Before: the key was mounted 0400 for root with no fsGroup, so uid 10001 could not read it."""
    for name, pod in _pods():
        if not name.startswith("plancache-worker"):
            continue
        ctx = pod["securityContext"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        mode = volume["secret"]["defaultMode"]
        assert ctx["fsGroup"] == ctx["runAsGroup"] and mode & 0o040 and not mode & 0o007, (name, oct(mode))
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        alive = env["PLANCACHE_ALIVE_FILE"]
        assert alive in " ".join(container["livenessProbe"]["exec"]["command"])
        assert alive in " ".join(container["startupProbe"]["exec"]["command"])
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert _quantity(limits["cpu"]) >= 4 and limits["cpu"] == requests["cpu"]  # builders: from the CPU limit


def test_the_server_memory_limit_covers_the_documented_bound():
    """docs/DEPLOYMENT.md "Request limits": R0 + MAX_INFLIGHT_BYTES + T x MAX_BLOB_BYTES (database blob store) + C x
    80 KiB, with R0 90 MB, T 40 threads and C 1000 connections; before: 2Gi, under the 3.2 GiB the defaults reach."""
    s = Settings()
    bound = 90e6 + s.max_inflight_bytes + 40 * s.max_blob_bytes + 1000 * 80 * 1024
    (server,) = [pod for name, pod in _pods() if name == "plancache-server"]
    (container,) = server["containers"]
    assert _quantity(container["resources"]["limits"]["memory"]) >= bound
    assert "T × MAX_BLOB_BYTES" in (ROOT / "docs" / "DEPLOYMENT.md").read_text()


def test_the_server_has_a_disruption_budget_and_network_policies_admit_only_its_port():
    docs = documents()
    (server,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "plancache-server"]
    labels = server["spec"]["template"]["metadata"]["labels"]
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] >= 1 and pdb["spec"]["minAvailable"] < server["spec"]["replicas"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    port = server["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert policies["plancache-server"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert [p["port"] for rule in policies["plancache-server"]["ingress"] for p in rule["ports"]] == [port]
    assert policies["plancache-worker"]["policyTypes"] == ["Ingress"] and "ingress" not in policies["plancache-worker"]


def test_the_example_admin_token_is_refused():
    """Before: ``REPLACE-WITH-A-LONG-RANDOM-TOKEN`` passed the length check, so the manifest applied unedited
    served a public admin token."""
    from pydantic import ValidationError

    from plancache.settings import ServerSettings

    (secret,) = [d for d in documents() if d["kind"] == "Secret" and d["metadata"]["name"] == "plancache-server"]
    with pytest.raises(ValidationError, match="placeholder of an example file"):
        ServerSettings(admin_token=secret["stringData"]["admin-token"])
