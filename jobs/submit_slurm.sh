#!/usr/bin/env bash
# Submit the experiment matrix to SLURM as a job array, one array task per configuration:
# `sbatch --array=0-(N-1) jobs/slurm.sbatch OPTIONS`, N = `jobs/matrix.py --count`. Each
# task gets its own allocation (slurm.sbatch's #SBATCH lines) and runs configuration
# $SLURM_ARRAY_TASK_ID; a failed configuration does not stop the others. Run it from a
# login node; the options are checked (train's parser) before anything is submitted.
#
#   jobs/submit_slurm.sh --data-dir /data --out-dir /runs --dry-run     # print the sbatch line
#   jobs/submit_slurm.sh --data-dir /data --out-dir /runs               # submit 78 tasks
#   jobs/submit_slurm.sh --sbatch-args "--nodes=4 --partition=gpu" --max-parallel 8 \
#       --np 32 --data-dir /data --out-dir /runs -- --epochs 50
#   jobs/submit_slurm.sh --index 12 --data-dir /data --out-dir /runs    # configuration 12 again
#   python jobs/matrix.py --launcher slurm --list --data-dir /data --out-dir /runs  # the numbering
#
# --sbatch-args: extra sbatch options (one string; a single one as --sbatch-args=--qos=x);
# --max-parallel M: at most M tasks at once (--array=0-(N-1)%M). Every other option (and
# everything after `--`) goes to the array tasks: jobs/matrix.py --help.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PY" "$HERE/matrix.py" --launcher slurm --submit "$@"
