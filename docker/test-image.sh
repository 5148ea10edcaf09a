#!/usr/bin/env bash
# `make image-test`: run, inside the image built by `make image` ($HVM_IMAGE),
#   1. docker/check-build.sh PyTorch Gloo MPI (`horovodrun --check-build` must list them);
#   2. a 2-rank MiCRO training run (digits, 1 epoch of 5 iterations) under
#      `horovodrun --gloo`, and one under `horovodrun --mpi` (as root: the image sets
#      OMPI_ALLOW_RUN_AS_ROOT*), each checked from its records: both ranks wrote
#      ranks/rank<R>.json with size 2 and the same final-parameter SHA-256.
# With buildah the container shares the host's UTS namespace (`--uts host`), and its
# hostname is made resolvable: Gloo's lookupAddrForHostname crashes (exit 139) when the
# container's hostname is not in its /etc/hosts.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=docker/image-env.sh
. "$REPO/docker/image-env.sh"

image_exists "$HVM_IMAGE" || bash "$REPO/docker/build-image.sh"

read -r -d '' IN_IMAGE <<'SCRIPT' || true
set -euo pipefail
export OMP_NUM_THREADS=1
getent hosts "$(hostname)" >/dev/null || echo "127.0.1.1 $(hostname)" >>/etc/hosts
cd /opt/horovod-micro
bash docker/check-build.sh PyTorch Gloo MPI
for controller in gloo mpi; do
    out="/tmp/image-test-$controller"
    rm -rf "$out"
    echo "== 2-rank MiCRO training under horovodrun --$controller"
    horovodrun -np 2 -H localhost:2 "--$controller" python -m horovod_micro_train --dataset digits \
        --epochs 1 --max-iters-per-epoch 5 --no-plots --progress lines --out "$out"
    python - "$out" "$controller" <<'PY'
import json, sys
from pathlib import Path
out, controller = Path(sys.argv[1]), sys.argv[2]
records = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
assert [r["rank"] for r in records] == [0, 1], records
assert all(r["size"] == 2 for r in records), records
digests = {r["parameters_sha256"] for r in records}
assert len(digests) == 1, f"ranks disagree on the final weights: {records}"
print(f"image-test: {controller}: 2 ranks, same final weights {digests.pop()[:16]}")
PY
done
echo "image-test: passed"
SCRIPT

if [ "$HVM_BUILDER" = docker ]; then
    docker run --rm "$HVM_IMAGE" bash -c "$IN_IMAGE"
else
    ctr="$(bh from --quiet "$HVM_IMAGE")"
    trap 'bh rm "$ctr" >/dev/null' EXIT
    bh run --uts host "$ctr" -- bash -c "$IN_IMAGE"
fi
