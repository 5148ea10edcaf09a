# Sourced by docker/build-image.sh and docker/test-image.sh: which builder runs the image
# (`docker` when a Docker engine answers, else Debian's buildah without a daemon), and
# buildah's storage, kept outside the repository so that layers and the Horovod wheel
# survive between builds and across clones.
# shellcheck shell=bash

HVM_IMAGE="${HVM_IMAGE:-localhost/horovod-micro:cpu}"
HVM_BUILDAH_ROOT="${HVM_BUILDAH_ROOT:-$HOME/.cache/horovod-micro/buildah}"

log() { printf '[image] %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Install Debian packages only when their command is missing (idempotent).
need_pkg() {  # need_pkg COMMAND PACKAGE
    command -v "$1" >/dev/null 2>&1 && return 0
    log "installing $2 from Debian's packages"
    as_root apt-get update -q
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q --no-install-recommends "$2"
}

if [ -z "${HVM_BUILDER:-}" ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        HVM_BUILDER=docker
    else
        HVM_BUILDER=buildah
    fi
fi

# buildah with this project's storage: overlay when the kernel and the backing file
# system allow it (it does here: ext4), else vfs (a full copy per layer: ~8 GB each).
# The choice is recorded, since a storage tree cannot change driver afterwards.
bh() {
    buildah --root "$HVM_BUILDAH_ROOT/storage" --runroot "$HVM_BUILDAH_ROOT/run" \
        --storage-driver "$HVM_STORAGE_DRIVER" "$@"
}

if [ "$HVM_BUILDER" = buildah ]; then
    need_pkg buildah buildah
    export BUILDAH_ISOLATION=chroot  # the default (oci) fails here: cgroups in hybrid mode
    mkdir -p "$HVM_BUILDAH_ROOT"
    if [ -s "$HVM_BUILDAH_ROOT/driver" ]; then
        HVM_STORAGE_DRIVER="$(cat "$HVM_BUILDAH_ROOT/driver")"
    else
        HVM_STORAGE_DRIVER=overlay
        if probe="$(bh from scratch 2>/dev/null)" && bh mount "$probe" >/dev/null 2>&1; then
            bh rm "$probe" >/dev/null
        else
            log "overlay storage does not work here; using vfs"
            [ -n "${probe:-}" ] && bh rm "$probe" >/dev/null 2>&1 || true
            rm -rf "$HVM_BUILDAH_ROOT/storage" "$HVM_BUILDAH_ROOT/run"
            HVM_STORAGE_DRIVER=vfs
        fi
        echo "$HVM_STORAGE_DRIVER" >"$HVM_BUILDAH_ROOT/driver"
    fi
fi

# This machine's Debian release (bookworm when it names none), and the local base image
# that `make image` debootstraps from it when no registry base is at hand.
CODENAME="$( (. /etc/os-release 2>/dev/null && printf '%s' "${VERSION_CODENAME:-}") || true)"
CODENAME="${CODENAME:-bookworm}"
LOCAL_BASE="localhost/horovod-micro-base:$CODENAME"

# True when the image exists in the builder's storage.
image_exists() {
    if [ "$HVM_BUILDER" = docker ]; then
        docker image inspect "$1" >/dev/null 2>&1
    else
        bh inspect --type image "$1" >/dev/null 2>&1
    fi
}
