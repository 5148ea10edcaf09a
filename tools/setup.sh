#!/usr/bin/env bash
# Idempotent set-up for horovod-micro on a Debian machine (what the README's two
# commands run first). Each step checks whether its result is already there, so a
# second run takes seconds:
#
#   1. Open MPI from Debian's packages, when mpirun is missing.
#   2. A virtual environment in .venv (git-ignored).
#   3. torch and torchvision (pinned below; pip takes them from this machine's disk).
#   4. Horovod 0.28.1 built from its PyPI sdist with PyTorch, Gloo and MPI. The
#      build needs two things Horovod itself does not provide (see
#      tools/cmake/cxx20-toolchain.cmake and docs/install.md, troubleshooting):
#      C++20 for torch 2.14's headers, and CUDA_HOME pointing at the toolkit
#      because the torch wheel is a CUDA build. The wheel is cached outside the
#      repository, keyed by Horovod, torch and Python versions, so the 8-minute
#      build happens once per machine.
#   5. This package, editable, with its test extra.
#
# Environment knobs:
#   HVM_VENV         where the venv lives (default: <repo>/.venv)
#   HVM_WHEEL_CACHE  where built Horovod wheels are kept (default: ~/.cache/horovod-micro/wheels)
#   HVM_PYTHON       interpreter the venv is made from (default: python3)
#   HVM_DEPS_ONLY    1: stop after step 4 (dependencies only; docker/Dockerfile uses it so
#                    the Horovod build stays a cached layer while the sources change)
#   HVM_CLUSTER_TOOLS 1: also step 1c, the test machine's packages (sshd, SLURM, iproute2);
#                    `make test` sets it, `make run` and the image do not
#   HVM_PACKAGES_ONLY 1: stop after step 1 (Debian's packages only; `make image-test` uses
#                    it to check in a fresh container what `make run` installs)
#   HOROVOD_GPU_OPERATIONS=NCCL  build Horovod's GPU collectives too (the GPU image). The
#                    set-up then also requires nccl_built(), and the wheel cache key gets a
#                    "-nccl" suffix so a CPU-only wheel is never reused for it. Horovod's
#                    other build variables (HOROVOD_NCCL_HOME/_INCLUDE/_LIB/_LINK,
#                    HOROVOD_BUILD_CUDA_CC_LIST, ...) pass through from the environment.
#   HVM_NCCL         pip: build against the NCCL of the nvidia-nccl wheel that torch already
#                    installed (one NCCL for torch and Horovod): sets HOROVOD_NCCL_HOME/
#                    _INCLUDE/_LIB there, HOROVOD_NCCL_LINK=SHARED, and adds the libnccl.so
#                    link the linker needs (the wheel ships only libnccl.so.2).
#                    Unset: Horovod searches for NCCL itself (e.g. libnccl-dev from apt).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVM_VENV:-$REPO/.venv}"
PY_BOOT="${HVM_PYTHON:-python3}"
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
HOROVOD_VERSION=0.28.1
WHEEL_CACHE="${HVM_WHEEL_CACHE:-$HOME/.cache/horovod-micro/wheels}"

log() { printf '[setup] %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# 1. Open MPI (mpirun for horovodrun --mpi, mpicc for mpi4py and Horovod's MPI build).
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    log "installing Open MPI from Debian's packages"
    as_root apt-get update -q
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q libopenmpi-dev openmpi-bin
fi

# 1b. Fashion-MNIST (Debian's dataset-fashion-mnist: the idx files under
#     /usr/share/datasets/fashion-mnist: python -m horovod_micro_train's default dataset, make run).
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
    log "installing Fashion-MNIST from Debian's packages"
    as_root apt-get update -q
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q dataset-fashion-mnist
fi

# 1c. The test machine's packages, for `make test` only (HVM_CLUSTER_TOOLS=1): the emulated
#     cluster of the tests (ip/tc, nsenter/unshare, sshd and ssh) and the throwaway
#     single-node SLURM of tests/test_jobs_slurm.py (slurmctld, slurmd, sbatch), from
#     Debian's packages. The tests start their own sshd and SLURM daemons on their own
#     ports; the system's services stay off: tools/no_service_starts.sh keeps the packages
#     from starting them while they install (whatever policy-rc.d the machine had), and the
#     units of the packages installed here are disabled after, so that no SSH server on port
#     22 and no SLURM daemon comes up at the next boot of a machine that runs systemd.
if [ "${HVM_DEPS_ONLY:-0}" != 1 ] && [ "${HVM_CLUSTER_TOOLS:-0}" = 1 ]; then
    missing=()
    { command -v ip && command -v tc; } >/dev/null 2>&1 || missing+=(iproute2)
    { command -v nsenter && command -v unshare && command -v setpriv; } >/dev/null 2>&1 \
        || missing+=(util-linux)
    [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
    [ -x /usr/bin/ssh ] || missing+=(openssh-client)
    { command -v slurmctld && command -v slurmd && command -v sbatch; } >/dev/null 2>&1 \
        || missing+=(slurm-wlm)
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing ${missing[*]} from Debian's packages (their services left off)"
        as_root apt-get update -q
        as_root env DEBIAN_FRONTEND=noninteractive "$REPO/tools/no_service_starts.sh" \
            apt-get install -y -q --no-install-recommends "${missing[@]}"
        # Only the units of the packages installed just now: a machine's own SSH server,
        # installed before, is left as it was. systemctl reads and edits the unit links
        # without a running systemd; where systemd is not installed (containers), the
        # packages' scripts still write the links (deb-systemd-helper), and they are
        # removed here as `systemctl disable` would.
        units=()
        case " ${missing[*]} " in *" openssh-server "*) units+=(ssh.service ssh.socket);; esac
        case " ${missing[*]} " in
            *" slurm-wlm "*) units+=(slurmctld.service slurmd.service munge.service);;
        esac
        for unit in "${units[@]}"; do
            if command -v systemctl >/dev/null 2>&1; then
                systemctl is-enabled --quiet "$unit" 2>/dev/null || continue
                log "disabling the system's $unit (the tests run their own daemons)"
                as_root systemctl disable --quiet "$unit" 2>/dev/null || true
            elif [ -d /etc/systemd/system ]; then
                as_root find /etc/systemd/system -path "*.wants/$unit" -type l -delete
            fi
        done
    fi
fi

if [ "${HVM_PACKAGES_ONLY:-0}" = 1 ]; then
    log "Debian's packages are in place (HVM_PACKAGES_ONLY=1: stopping here)"
    exit 0
fi

# 2. The virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY_BOOT" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)

# 3. torch + torchvision (a matching pair).
if ! "$PY" - "$TORCH_VERSION" "$TORCHVISION_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(not (version("torch").split("+")[0] == sys.argv[1]
              and version("torchvision").split("+")[0] == sys.argv[2]))
EOF
then
    log "installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION"
    "${PIP[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

# 4. Horovod, built once per (Horovod, torch, Python) and then installed from the cache.
GPU_OPS="${HOROVOD_GPU_OPERATIONS:-}"
horovod_ok() {
    "$PY" - "$HOROVOD_VERSION" "$GPU_OPS" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
if version("horovod") != sys.argv[1]:
    sys.exit(1)
import horovod.torch as hvd  # noqa: F401  the extension must load against this torch
from horovod.common.util import gloo_built, mpi_built, nccl_built
ok = gloo_built() and mpi_built()
if sys.argv[2].upper() == "NCCL":
    ok = ok and bool(nccl_built())
sys.exit(not ok)
EOF
}

if ! horovod_ok; then
    PYTAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
    KEY_DIR="$WHEEL_CACHE/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$PYTAG"
    if [ -n "$GPU_OPS" ]; then
        KEY_DIR="$KEY_DIR-$(printf '%s' "$GPU_OPS" | tr '[:upper:]' '[:lower:]')"
    fi
    mkdir -p "$KEY_DIR"
    if ! ls "$KEY_DIR"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION from source (about 8 minutes on 2 cores)"
        CUDA_DIR="${CUDA_HOME:-/usr/local/cuda}"
        BUILD_ENV=(
            CMAKE_TOOLCHAIN_FILE="$REPO/tools/cmake/cxx20-toolchain.cmake"
            CMAKE_POLICY_VERSION_MINIMUM=3.5
            HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
            HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO
            MAKEFLAGS="-j$(nproc)"
        )
        if [ -d "$CUDA_DIR" ]; then
            BUILD_ENV+=(CUDA_HOME="$CUDA_DIR" HOROVOD_CUDA_HOME="$CUDA_DIR"
                        HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-80,90}")
        fi
        if [ "${HVM_NCCL:-}" = pip ]; then
            NCCL_DIR="$("$PY" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')"
            [ -e "$NCCL_DIR/lib/libnccl.so" ] || ln -s libnccl.so.2 "$NCCL_DIR/lib/libnccl.so"
            BUILD_ENV+=(HOROVOD_NCCL_HOME="$NCCL_DIR" HOROVOD_NCCL_INCLUDE="$NCCL_DIR/include"
                        HOROVOD_NCCL_LIB="$NCCL_DIR/lib" HOROVOD_NCCL_LINK=SHARED)
        fi
        # gcc 13 (Ubuntu 24.04) no longer pulls these headers in transitively for Horovod.
        if [ "$("${CXX:-c++}" -dumpversion 2>/dev/null | cut -d. -f1)" -ge 13 ] 2>/dev/null; then
            BUILD_ENV+=(CXXFLAGS="${CXXFLAGS:-} -include stdexcept -include string")
        fi
        # Build and install-time needs of Horovod's setup.py; cmake stays the system one
        # (CMake 4 refuses Horovod's bundled Gloo unless the policy minimum is set above).
        "${PIP[@]}" cloudpickle psutil pyyaml packaging cffi
        TMP_WHEELS="$(mktemp -d)"
        # --no-cache-dir: pip's own wheel cache would hand back a Horovod built earlier
        # with other options (e.g. without NCCL) or against another torch.
        env "${BUILD_ENV[@]}" "$PY" -m pip wheel --no-cache-dir --no-build-isolation \
            --no-deps --no-binary horovod -w "$TMP_WHEELS" "horovod==$HOROVOD_VERSION"
        mv "$TMP_WHEELS"/horovod-*.whl "$KEY_DIR"/
        rm -rf "$TMP_WHEELS"
    fi
    log "installing Horovod from $KEY_DIR"
    "${PIP[@]}" --force-reinstall --no-deps "$KEY_DIR"/horovod-*.whl
    "${PIP[@]}" cloudpickle psutil pyyaml packaging cffi
    if ! horovod_ok; then
        log "Horovod installed but cannot load with Gloo and MPI${GPU_OPS:+ and $GPU_OPS};" \
            "removing the wheel from $KEY_DIR so that the next run builds it again"
        rm -f "$KEY_DIR"/horovod-*.whl
        exit 1
    fi
fi

if [ "${HVM_DEPS_ONLY:-0}" = 1 ]; then
    log "dependencies ready (HVM_DEPS_ONLY=1: horovod_micro not installed): $VENV"
    exit 0
fi

# 5. This package, editable, with the test extra.
# Reinstalled when setup.cfg or a native kernel's source changed (the editable install
# builds the kernels into the source tree once).
stale=0
for source in "$REPO/setup.cfg" "$REPO/setup.py" "$REPO"/horovod_micro/_native/*.c; do
    [ "$source" -nt "$VENV/.hvm-installed" ] && stale=1
done
if ! "$PY" -c 'import horovod_micro, pytest, hypothesis, sklearn, mpi4py, tensorboard, sphinx, myst_parser, build' \
        2>/dev/null \
        || [ "$stale" = 1 ]; then
    log "installing horovod_micro (editable) with its test extra"
    "${PIP[@]}" -e "$REPO[test]"
    touch "$VENV/.hvm-installed"
fi
log "ready: $VENV"
