#!/usr/bin/env bash
# The experiment matrix on one node: `horovodrun -np N -H localhost:N python -m horovod_micro_train ...`
# for every (dataset, model, compressor, density, N), one run after another.
#
#   jobs/single_node.sh --data-dir /data --out-dir /runs --dry-run      # print the commands
#   jobs/single_node.sh --data-dir /data --out-dir /runs --np 8         # run them
#   jobs/single_node.sh --data-dir /data --out-dir /runs --models resnet18 \
#       --datasets cifar10 --compressors micro,topk --densities 0.001 -- --epochs 50
#
# Options: jobs/matrix.py --help (shared by all launchers); after `--`: extra arguments
# for every `python -m horovod_micro_train`. PYTHON and HOROVODRUN choose the interpreter and launcher.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PY" "$HERE/matrix.py" --launcher local "$@"
