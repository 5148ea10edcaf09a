#!/usr/bin/env bash
# `make image`: build the CPU variant of docker/Dockerfile as $HVM_IMAGE
# (default localhost/horovod-micro:cpu), with the Dockerfile unchanged in recipe.
# `make image-gpu-check` (HVM_VARIANT=gpu): the GPU variant, compile only (no GPU needed):
# with buildah, on the local Debian base with this machine's CUDA toolkit mounted
# read-only at /usr/local/cuda for the build ($HVM_CUDA_TOOLKIT, default $CUDA_HOME or
# /usr/local/cuda) and NCCL from the nvidia-nccl wheel that torch brings; with docker, on
# the Dockerfile's CUDA devel base. The Dockerfile's last step fails the build unless
# `horovodrun --check-build` lists NCCL.
#
#   - builder: `docker build` when a Docker engine answers (`docker info`), else Debian's
#     `buildah bud` (installed when missing) with its storage under $HVM_BUILDAH_ROOT
#     (default ~/.cache/horovod-micro/buildah) and `--layers`, so unchanged steps are reused;
#   - base: the Dockerfile's CPU base (ubuntu:24.04) when a registry gives it, else a
#     Debian base made here by `debootstrap --variant=minbase` from the mirror that this
#     machine's apt sources name (kept as localhost/horovod-micro-base:<codename>);
#   - Python wheels: the way this machine's pip gets them. Its configuration (`pip config
#     list`: PIP_* variables and pip.conf files) goes in as build arguments (PIP_*, which
#     are not kept in the image); local directories it names (find-links, file:// indexes)
#     and its CA bundle are mounted read-only for the build (buildah only).
#   - the Horovod wheel: kept by the Dockerfile's `RUN --mount=type=cache` (buildah keeps it
#     under /var/tmp/buildah-cache*), so only the first build compiles Horovod.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=docker/image-env.sh
. "$REPO/docker/image-env.sh"
cd "$REPO"

REGISTRY_BASE="${HVM_REGISTRY_BASE:-ubuntu:24.04}"
VARIANT="${HVM_VARIANT:-cpu}"
case "$VARIANT" in
    cpu|gpu) ;;
    *) log "HVM_VARIANT must be cpu or gpu, got '$VARIANT'"; exit 2 ;;
esac

# ---- pip's effective configuration -----------------------------------------------------
# `pip config list` prints the merged value per section: ":env:" (PIP_* variables) wins
# over the files' "global"/"install" sections, as in pip itself.
PIP_LIST="$( (python3 -m pip config list || pip config list) 2>/dev/null || true)"
pip_setting() {  # pip_setting KEY -> effective value or nothing
    local section line
    for section in ':env:' install global; do
        line="$(grep -F -- "$section.$1=" <<<"$PIP_LIST" | head -1 || true)"
        if [ -n "$line" ]; then
            line="${line#*=}"; line="${line#\'}"; line="${line%\'}"
            printf '%s' "$line"
            return
        fi
    done
}

BUILD_ARGS=(--build-arg "VARIANT=$VARIANT")
MOUNTS=()
declare -A MOUNTED=()
mount_ro() {  # mount a host directory or file at the same path for the build
    local src="$1"
    [ -e "$src" ] || { log "pip names $src, which does not exist; not mounted"; return; }
    [ -n "${MOUNTED[$src]:-}" ] && return
    MOUNTED[$src]=1
    MOUNTS+=(-v "$src:$src:ro")
}
# Local locations in an index/find-links value: a PEP 503 ".../simple" index links to
# its parent's files (../../files/...), so its parent directory is mounted.
mount_locations() {
    local item path
    for item in $1; do
        case "$item" in
            file://*) path="${item#file://}" ;;
            /*) path="$item" ;;
            *) continue ;;
        esac
        path="${path%/}"
        [ "${path##*/}" = simple ] && path="${path%/*}"
        mount_ro "$path"
    done
}

for key in index-url find-links trusted-host default-timeout no-index; do
    value="$(pip_setting "$key")"
    [ -n "$value" ] || continue
    var="PIP_$(tr '[:lower:]-' '[:upper:]_' <<<"$key")"
    BUILD_ARGS+=(--build-arg "$var=$value")
    case "$key" in index-url|find-links) mount_locations "$value" ;; esac
done
# The CPU stage puts its torch index into PIP_EXTRA_INDEX_URL: pip's extra indexes here,
# when it has any (else the Dockerfile's default, PyTorch's CPU wheel index).
EXTRA_INDEX="$(pip_setting extra-index-url)"
if [ -n "$EXTRA_INDEX" ]; then
    BUILD_ARGS+=(--build-arg "TORCH_CPU_INDEX=$EXTRA_INDEX")
    mount_locations "$EXTRA_INDEX"
fi
# pip's CA bundle (PyPI is reached through a TLS proxy whose CA only the host trusts).
CERT="$(pip_setting cert)"
CERT="${CERT:-${REQUESTS_CA_BUNDLE:-}}"
if [ -n "$CERT" ] && [ -f "$CERT" ]; then
    MOUNTS+=(-v "$CERT:/run/hvm-pip-ca.pem:ro")
    BUILD_ARGS+=(--build-arg PIP_CERT=/run/hvm-pip-ca.pem)
fi

# ---- the base image --------------------------------------------------------------------
# The Debian mirror that this machine's apt sources name for its own release.
debian_mirror() {
    local codename="$1" site
    site="$(apt-get indextargets --format '$(SITE) $(CODENAME) $(COMPONENT)' \
        'Created-By: Packages' 2>/dev/null | awk -v c="$codename" '$2 == c && $3 == "main" {print $1; exit}')"
    if [ -z "$site" ]; then  # no apt lists yet: read the sources files themselves
        site="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk -v c="$codename" '$1 == "deb" && $3 == c {print $2; exit}')"
    fi
    if [ -z "$site" ]; then
        site="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk -v c="$codename" '
            /^URIs:/ {u = $2} /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == c) s = 1}
            /^$/ {if (s && u) {print u; exit} u = ""; s = 0}
            END {if (s && u) print u}' | head -1)"
    fi
    printf '%s' "$site"
}

make_local_base() {  # debootstrap a minimal Debian into the builder's local storage
    local name="$1" codename="$2" mirror rootfs ctr
    mirror="$(debian_mirror "$codename")"
    [ -n "$mirror" ] || { log "no Debian mirror for $codename in the apt sources"; exit 1; }
    need_pkg debootstrap debootstrap
    rootfs="$(mktemp -d "${TMPDIR:-/var/tmp}/hvm-rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs" "$rootfs.tar"' EXIT
    log "debootstrap --variant=minbase $codename from $mirror"
    as_root debootstrap --variant=minbase "$codename" "$rootfs" "$mirror" >&2
    as_root tar -C "$rootfs" --numeric-owner -cf "$rootfs.tar" .
    if [ "$HVM_BUILDER" = docker ]; then
        docker import "$rootfs.tar" "$name" >/dev/null
    else  # buildah 1.28 has no `import`: add the tree to an empty container, commit it
        ctr="$(bh from scratch)"
        bh add "$ctr" "$rootfs.tar" / >/dev/null
        bh commit --quiet "$ctr" "$name" >/dev/null
        bh rm "$ctr" >/dev/null
    fi
    as_root rm -rf "$rootfs" "$rootfs.tar"
    trap - EXIT
}

pull_base() {
    if [ "$HVM_BUILDER" = docker ]; then
        timeout 300 docker pull -q "$REGISTRY_BASE" >/dev/null 2>&1
    else
        timeout 300 bh pull -q "$REGISTRY_BASE" >/dev/null 2>&1
    fi
}

if [ "$VARIANT" = gpu ] && [ "$HVM_BUILDER" = docker ] && [ -z "${HVM_BASE_IMAGE:-}" ]; then
    BASE="the Dockerfile's CUDA_IMAGE"  # a CUDA devel base brings nvcc itself
elif [ -n "${HVM_BASE_IMAGE:-}" ]; then
    BASE="$HVM_BASE_IMAGE"
elif image_exists "$LOCAL_BASE"; then
    BASE="$LOCAL_BASE"
elif [ "$VARIANT" = cpu ] && { image_exists "$REGISTRY_BASE" || pull_base; }; then
    BASE="$REGISTRY_BASE"
else
    log "no base image at hand; making a local one"
    make_local_base "$LOCAL_BASE" "$CODENAME"
    BASE="$LOCAL_BASE"
fi
if [ "$VARIANT" = cpu ]; then
    BUILD_ARGS+=(--build-arg "CPU_IMAGE=$BASE")
elif [ "$BASE" != "the Dockerfile's CUDA_IMAGE" ]; then
    # A base without CUDA: this machine's toolkit (nvcc, headers, cudart) for the build.
    TOOLKIT="$(readlink -f "${HVM_CUDA_TOOLKIT:-${CUDA_HOME:-/usr/local/cuda}}")"
    [ -x "$TOOLKIT/bin/nvcc" ] || {
        log "no CUDA toolkit at $TOOLKIT (bin/nvcc); set HVM_CUDA_TOOLKIT"; exit 1; }
    BUILD_ARGS+=(--build-arg "CUDA_IMAGE=$BASE")
    MOUNTS+=(-v "$TOOLKIT:/usr/local/cuda:ro")
fi
log "building $HVM_IMAGE ($VARIANT) with $HVM_BUILDER on $BASE"

# ---- the build -------------------------------------------------------------------------
if [ "$HVM_BUILDER" = docker ]; then
    [ "${#MOUNTS[@]}" -eq 0 ] || log "docker build has no mounts: not passed: ${MOUNTS[*]}"
    DOCKER_BUILDKIT=1 docker build -f docker/Dockerfile "${BUILD_ARGS[@]}" -t "$HVM_IMAGE" .
else
    bh bud --layers --format docker -f docker/Dockerfile \
        "${BUILD_ARGS[@]}" "${MOUNTS[@]}" -t "$HVM_IMAGE" .
fi
log "built $HVM_IMAGE"
