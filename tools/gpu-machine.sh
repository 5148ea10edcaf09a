#!/usr/bin/env bash
# The CUDA path on a GPU machine that has a CUDA build of torch, nvcc and cmake but no
# network (no pip index): builds Horovod with NCCL from a source tarball brought along,
# then runs gpu_tests/ and the GPU benchmarks. Logs and results go to OUT.
#
#   bash tools/gpu-machine.sh SDIST WHEEL_DIR OUT [STEP ...]
#
# STEP: build tests syncs pipeline (the default) or bars ab cycle async batch train timeline, each
# a function below; ab needs BASE_TREE (AB_MODELS picks its models), train FMNIST_DIR.
# On an H100 (16 cores): build 145 s, tests 51 s, one bench.pipeline run about 25 s; so
# `build syncs ab tests` with AB_MODELS=wide_mlp fits one 10-minute call (about 6 min).
#
# SDIST: horovod-0.28.1.tar.gz (`pip download --no-deps --no-binary :all: horovod==0.28.1`);
# WHEEL_DIR: wheels for what the build needs and the machine may lack (cffi, pycparser).
# The build variables are tools/setup.sh's, with NCCL taken from torch's nvidia-nccl wheel,
# MPI left out, and kernels for the machine's own compute capability only. They are
# written out again here (setup.sh cannot run offline); keep the two lists in step.
set -uo pipefail
SDIST=$1 WHEELS=$2 OUT=$3
shift 3
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(build tests syncs pipeline)
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/json"
cd "$REPO" || exit 1

horovod_nccl() {
    "$PY" -c 'import horovod.torch; from horovod.common.util import nccl_built
assert nccl_built()' 2>/dev/null
}

build() {
    horovod_nccl && return 0
    local built
    built=$(ls "$WHEELS"/horovod-*-cp"$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"-*.whl 2>/dev/null | head -1)
    if [ -n "$built" ]; then  # a wheel this script built before, brought back
        "$PY" -m pip install -q --no-index --no-deps "$built" && horovod_nccl && return 0
    fi
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/build-site \
        "$WHEELS"/cffi-*.whl "$WHEELS"/pycparser-*.whl
    local nccl cc
    nccl="$("$PY" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')"
    mkdir -p /tmp/nccl/lib
    ln -sfn "$nccl/include" /tmp/nccl/include
    ln -sf "$nccl/lib/libnccl.so.2" /tmp/nccl/lib/libnccl.so.2
    ln -sf libnccl.so.2 /tmp/nccl/lib/libnccl.so
    cc="$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}")')"
    env PYTHONPATH=/tmp/build-site \
        CMAKE_TOOLCHAIN_FILE="$REPO/tools/cmake/cxx20-toolchain.cmake" \
        CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO \
        HOROVOD_GPU_OPERATIONS=NCCL CUDA_HOME=/usr/local/cuda HOROVOD_CUDA_HOME=/usr/local/cuda \
        HOROVOD_BUILD_CUDA_CC_LIST="$cc" HOROVOD_NCCL_HOME=/tmp/nccl \
        HOROVOD_NCCL_INCLUDE=/tmp/nccl/include HOROVOD_NCCL_LIB=/tmp/nccl/lib \
        HOROVOD_NCCL_LINK=SHARED CXXFLAGS="-include stdexcept -include string" \
        MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel --no-index --no-deps --no-build-isolation --no-cache-dir \
        -w /tmp/hvd-wheel "$SDIST" || return 1
    "$PY" -m pip install -q --no-index --no-deps /tmp/hvd-wheel/horovod-*.whl || return 1
    # The wheel comes back in pieces of at most 15 MB (cat them to reuse it).
    (cd /tmp/hvd-wheel && split -b 15M horovod-*.whl "$OUT/horovod-wheel.part-")
    ls /tmp/hvd-wheel
    horovod_nccl
}

tests() {
    "$PY" -m pytest -p no:cacheprovider -q gpu_tests
}

syncs() {
    "$PY" -m bench.cuda_syncs --np 1 --model wide_mlp --json "$OUT/json/cuda_syncs_wide_mlp.json" &&
        "$PY" -m bench.cuda_syncs --np 1 --model resnet18 --json "$OUT/json/cuda_syncs_resnet18.json"
}

pipeline() {
    local model
    for model in wide_mlp resnet18; do
        "$PY" -m bench.pipeline --device cuda --np 1 --model "$model" --iters 60 --warmup 20 \
            --variants compute barrier micro micro-phases micro-copy \
            --json "$OUT/json/pipeline_${model}.json" || return 1
    done
}

# Horovod's cycle time (default 1 ms in 0.28.1) against shorter ones, and the timeline.
cycle() {
    local model ct
    for model in wide_mlp resnet18; do
        for ct in 0.2 0; do
            "$PY" -m bench.pipeline --device cuda --np 1 --model "$model" --iters 60 \
                --warmup 20 --variants compute barrier micro --cycle-time-ms "$ct" \
                --json "$OUT/json/pipeline_${model}_cycle${ct}.json" || return 1
        done
    done
}

# The step against compute-only at the cycle the docs advise (0.2 ms), three rounds per model.
bars() {
    local model round
    for model in wide_mlp resnet18; do
        for round in 1 2 3; do
            "$PY" -m bench.pipeline --device cuda --np 1 --model "$model" --iters 60 \
                --warmup 20 --variants compute micro --cycle-time-ms 0.2 \
                --json "$OUT/json/bars_${model}_${round}.json" || return 1
        done
    done
}

# Horovod's cycle time against its asynchronous completion (HOROVOD_ENABLE_ASYNC_COMPLETION,
# which lets a CUDA collective finish without the background thread waiting on it).
async() {
    local ct on
    for ct in 1 0.2 0; do
        for on in 0 1; do
            HOROVOD_ENABLE_ASYNC_COMPLETION=$on "$PY" -m bench.pipeline --device cuda --np 1 \
                --model wide_mlp --iters 60 --warmup 20 --variants compute micro \
                --cycle-time-ms "$ct" --json "$OUT/json/pipeline_wide_mlp_cycle${ct}_async${on}.json" \
                || return 1
        done
    done
}

# ResNet-18 at batch 128: a GPU-sized batch, so more compute per exchanged parameter.
batch() {
    local ct
    for ct in 1 0; do
        "$PY" -m bench.pipeline --device cuda --np 1 --model resnet18 --batch 128 --iters 60 \
            --warmup 20 --variants compute barrier micro --cycle-time-ms "$ct" \
            --json "$OUT/json/pipeline_resnet18_b128_cycle${ct}.json" || return 1
    done
}

# Before/after: the same benchmark from BASE_TREE (an older checkout of this repository)
# and from this one, alternated, two rounds per model; and the older tree's sync census.
ab() {
    local model round tree tag
    [ -d "${BASE_TREE:-}" ] || { echo "BASE_TREE is not a directory"; return 1; }
    for model in ${AB_MODELS:-wide_mlp resnet18}; do
        for round in 1 2; do
            for tree in "$BASE_TREE" "$REPO"; do
                tag=after
                [ "$tree" = "$REPO" ] || tag=before
                (cd "$tree" && "$PY" -m bench.pipeline --device cuda --np 1 --model "$model" \
                    --iters 60 --warmup 20 --variants compute barrier micro \
                    --json "$OUT/json/ab_${model}_${tag}${round}.json") || return 1
            done
        done
    done
    (cd "$BASE_TREE" && "$PY" -m bench.cuda_syncs --np 1 --model wide_mlp \
        --json "$OUT/json/cuda_syncs_wide_mlp_before.json")
}

# The main job on the GPU: Fashion-MNIST (FMNIST_DIR, default Debian's folder) with MiCRO
# and with dense allreduce, one rank; the TensorBoard events read back by TensorBoard.
train() {
    local c data="${FMNIST_DIR:-/usr/share/datasets/fashion-mnist}"
    for c in micro none; do
        horovodrun -np 1 -H localhost:1 --gloo "$PY" -m horovod_micro_train --data-dir "$data" \
            --compressor "$c" --tensorboard --out "/tmp/run-$c" || return 1
        "$PY" - "/tmp/run-$c" <<'EOF' || return 1
import json, sys
from pathlib import Path
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
out = Path(sys.argv[1])
events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
events.Reload()
acc = {e.step: round(e.value, 4) for e in events.Scalars("epoch/test_accuracy")}
run = json.loads((out / "run.json").read_text())
print(out.name, "device", run.get("device"), "test accuracy per epoch (TensorBoard):", acc)
EOF
        cp "/tmp/run-$c/summary.json" "$OUT/json/train_${c}_summary.json"
        cp "/tmp/run-$c/epochs.jsonl" "$OUT/json/train_${c}_epochs.jsonl"
    done
}

timeline() {
    "$PY" -m bench.pipeline --device cuda --np 1 --model wide_mlp --iters 60 --warmup 20 \
        --variants compute barrier micro --timeline --json "$OUT/json/pipeline_timeline.json"
}

{ nvidia-smi -L; "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__)'
  nproc; } >"$OUT/steps.txt" 2>&1
status=0
for step in "${STEPS[@]}"; do
    start=$SECONDS
    "$step" >"$OUT/$step.log" 2>&1
    rc=$?
    echo "$step: exit $rc, $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
    [ $rc -eq 0 ] || status=1
    if [ "$step" = build ] && [ $rc -ne 0 ]; then break; fi
done
tar -C "$OUT" -cf "$OUT/json.tar" json && rm -rf "$OUT/json"
(cd "$OUT" && tar -cf logs.tar ./*.log && rm -f ./*.log)
exit $status
