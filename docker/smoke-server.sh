#!/usr/bin/env bash
# Build the server image without a Docker daemon (buildah) and check that `serve` answers /readyz.
#   docker/smoke-server.sh                 # base image python:3.11.14-slim-bookworm from the registry
#   BASE=localhost/my-python:3.11 docker/smoke-server.sh
#                                          # a local stand-in where Docker Hub is unreachable (see DEPLOYMENT.md)
# Extra buildah arguments go in BUILDAH_ARGS, e.g. BUILDAH_ARGS="-v /etc/ssl/certs:/etc/ssl/certs:ro" where pip
# must trust a proxy's certificate authority during the build. Uses chroot isolation, so it also runs where the
# sandbox refuses the OCI runtime's setrlimit calls (podman run fails there).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v buildah >/dev/null || { echo "buildah is not installed (Debian: apt-get install buildah)" >&2; exit 2; }
tag=${TAG:-plancache-server:smoke}
port=${PORT:-18787}
from=()
[ -n "${BASE:-}" ] && from=(--from "$BASE")
# shellcheck disable=SC2086 # BUILDAH_ARGS is a list of arguments
buildah bud --isolation chroot "${from[@]}" ${BUILDAH_ARGS:-} -f docker/server.Dockerfile -t "$tag" .
ctr=$(buildah from "$tag")
log=$(mktemp)
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; buildah rm "$ctr" >/dev/null; rm -f "$log"' EXIT
# The image's own user (10001) and its entrypoint's command; chroot isolation shares the host's network.
buildah run --isolation chroot "$ctr" -- python -m plancache serve --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
pid=$!
for _ in $(seq 1 30); do
  if curl -sf "http://127.0.0.1:$port/readyz"; then echo; echo "ok: $tag serves /readyz on :$port"; exit 0; fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 1
done
echo "the server in $tag did not answer /readyz:" >&2
cat "$log" >&2
exit 1
