#!/usr/bin/env bash
# `make image`: build the sidecar image on a machine that reaches no container registry.
#
# 1. a Debian base from Debian's packages (debootstrap, cached under build/image/, imported
#    once as localhost/kvgov-base:bookworm);
# 2. the image from ./Containerfile with that base (BASE_IMAGE build argument);
# 3. its size, and the time from `podman run` to a ready /readyz (read-only root, non-root).
#
# Environment: IMAGE (default localhost/kvgov:dev), BASE (an existing base image to use
# instead of building one, e.g. docker.io/library/python:3.11-slim-bookworm), MIRROR
# (Debian mirror for debootstrap), PODMAN (default podman).
set -euo pipefail
cd "$(dirname "$0")/../.."

IMAGE=${IMAGE:-localhost/kvgov:dev}
PODMAN=${PODMAN:-podman}
SUITE=bookworm
CACHE=build/image
BASE_TAG=localhost/kvgov-base:${SUITE}

need() { command -v "$1" >/dev/null 2>&1 || { echo "make image: $1 not found ($2)" >&2; exit 2; }; }
need "$PODMAN" "apt-get install podman runc; see docs/deploy.md"

if [ -z "${BASE:-}" ]; then
    BASE=$BASE_TAG
    if ! "$PODMAN" image exists "$BASE"; then
        if [ ! -f "$CACHE/rootfs.tar" ]; then
            need debootstrap "apt-get install debootstrap, or set BASE to a public Python image"
            MIRROR=${MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
            MIRROR=${MIRROR:-http://deb.debian.org/debian}
            echo "make image: debootstrap $SUITE from $MIRROR (a few minutes, once)"
            rm -rf "$CACHE/rootfs"
            mkdir -p "$CACHE"
            debootstrap --variant=minbase "$SUITE" "$CACHE/rootfs" "$MIRROR" >"$CACHE/debootstrap.log"
            tar -C "$CACHE/rootfs" -cf "$CACHE/rootfs.tar.tmp" .
            mv "$CACHE/rootfs.tar.tmp" "$CACHE/rootfs.tar"
            rm -rf "$CACHE/rootfs"
        fi
        "$PODMAN" import --quiet \
            --change 'ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            "$CACHE/rootfs.tar" "$BASE" >/dev/null
    fi
fi

# a network that intercepts TLS: hand the host's CA bundle (pip's, else PIP_CERT) to the build
extra=()
HOST_CA=${HOST_CA:-${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}}
if [ -n "$HOST_CA" ] && [ -f "$HOST_CA" ]; then
    extra+=(--volume "$HOST_CA:/kvgov-build-ca.crt:ro" --build-arg PIP_CERT=/kvgov-build-ca.crt)
fi

echo "make image: building $IMAGE on $BASE"
# docker format: OCI images have no HEALTHCHECK; host network: the build stage reaches PyPI
"$PODMAN" build --quiet --format docker --network=host "${extra[@]}" \
    --build-arg "BASE_IMAGE=$BASE" -t "$IMAGE" -f Containerfile . >/dev/null

size=$("$PODMAN" image inspect --format '{{.Size}}' "$IMAGE")
echo "make image: $IMAGE size $((size / 1000000)) MB"

# start-up time to ready: read-only root, non-root, development settings, own API port
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
name=kvgov-image-check-$$
state=$(mktemp -d)
chown 10001:10001 "$state" 2>/dev/null || chmod 0777 "$state"
trap '"$PODMAN" rm -f -v "$name" >/dev/null 2>&1 || true; rm -rf "$state"' EXIT
start=$(date +%s.%N)
"$PODMAN" run -d --name "$name" --read-only --read-only-tmpfs=false --network=host \
    --security-opt no-new-privileges --cap-drop ALL --no-healthcheck \
    -e KVGOV_API__PORT="$port" -e KVGOV_DATAPLANE__HOST= \
    -v "$state:/var/lib/kvgov" "$IMAGE" >/dev/null
for _ in $(seq 600); do
    if python3 - "$port" <<'PY' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/readyz", timeout=1) as r:
    sys.exit(0 if r.status == 200 else 1)
PY
    then
        ready=$(date +%s.%N)
        echo "make image: start-up to ready $(python3 -c "print(f'{$ready - $start:.2f}')") s"
        exit 0
    fi
    sleep 0.1
done
echo "make image: the container did not become ready; its log:" >&2
"$PODMAN" logs "$name" >&2 || true
exit 1
