#!/usr/bin/env bash
# Regenerate docker/requirements-server.txt and docker/requirements-worker.txt: the full pinned
# dependency closure of each image, resolved by pip (metadata only, nothing is installed).
#   docker/lock.sh            # run from anywhere, with the project's virtualenv's pip on PATH
# The server lock keeps the versions installed in the current environment (the ones the tests ran
# against); the worker lock resolves for Python 3.12 / linux x86-64 around the pinned torch.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Installed versions, minus the CPU torch stack the worker lock resolves on its own.
pip freeze --exclude-editable | grep -viE '^(-e |plancache|torch|triton|nvidia-|cuda-|setuptools)' > "$tmp/installed.txt"

pip install --quiet --dry-run --ignore-installed --report "$tmp/server.json" -c "$tmp/installed.txt" '.[server]'

plats=(--platform manylinux2014_x86_64 --platform any)
for v in $(seq 17 39); do plats+=(--platform "manylinux_2_${v}_x86_64"); done
base=$(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
mapfile -t base_deps <<<"$base"
pip install --quiet --dry-run --ignore-installed --report "$tmp/worker.json" --target "$tmp/target" \
  --python-version 3.12 --only-binary=:all: "${plats[@]}" -c "$tmp/installed.txt" \
  "torch==${TORCH_VERSION}" "${base_deps[@]}"

python3 - "$tmp/server.json" "$tmp/worker.json" <<'PY'
import json
import sys

def pins(report: str) -> list[str]:
    install = json.load(open(report))["install"]
    names = sorted((i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in install)
    return [f"{n}=={v}" for n, v in names if n != "plancache"]

headers = {
    "docker/requirements-server.txt": (
        "# Every package the server image installs, pinned: the closure of plancache's base + [server]\n"
        "# dependencies at the versions the test suite ran against (Python 3.11, linux x86-64).\n"
        "# Regenerate with docker/lock.sh after changing pyproject.toml.\n"),
    "docker/requirements-worker.txt": (
        "# Every package the worker image installs from PyPI, pinned: plancache's base dependencies plus\n"
        "# torch, which pins the CUDA 13.0 libraries and cuDNN (nvidia-cudnn-cu13) the worker runs on\n"
        "# (Python 3.12, linux x86-64). nvidia-cudnn-frontend is installed with --no-deps (worker.Dockerfile).\n"
        "# Regenerate with docker/lock.sh after changing pyproject.toml.\n"),
}
for (path, header), report in zip(headers.items(), sys.argv[1:]):
    with open(path, "w") as fh:
        fh.write(header + "\n".join(pins(report)) + "\n")
    print(f"wrote {path}")
PY
