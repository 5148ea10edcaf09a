#!/usr/bin/env bash
# What HOROVOD_CYCLE_TIME=0 does to the training entrypoint when torch's thread pool has a
# core to spare, and when it has none (BENCHMARKS.md, "The GPU path").
#
#   bench/cycle_threads.sh [OUT_DIR] [ROUNDS]
#
# One Gloo rank trains wide_mlp on Fashion-MNIST with MiCRO (d = 0.001) for 120 iterations,
# four times per round: torch threads 1 and 2 (OMP_NUM_THREADS), Horovod's default cycle
# (1 ms) and 0. At cycle 0 Horovod's background thread never sleeps, so it keeps a core
# busy; with 2 torch threads on a 2-core machine the pool then has one core fewer than
# it thinks. Prints the median of each phase over iterations 21-120, from the run's
# iterations.jsonl (horovod_micro_train.records). Runs from the repository root with the set-up's venv.
set -euo pipefail
out=${1:-/tmp/hvm-cycle-threads}
rounds=${2:-2}
py=.venv/bin/python
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
    for threads in 1 2; do
        for cycle in default 0; do
            run="$out/r$round-t$threads-c$cycle"
            rm -rf "$run"
            envs=(OMP_NUM_THREADS="$threads")
            [[ $cycle == 0 ]] && envs+=(HOROVOD_CYCLE_TIME=0)
            env "${envs[@]}" .venv/bin/horovodrun -np 1 -H localhost:1 --gloo \
                "$py" -m horovod_micro_train --dataset fashion-mnist --model wide_mlp --compressor micro \
                --density 0.001 --epochs 1 --max-iters-per-epoch 120 --out "$run" \
                --no-plots --progress none > "$run.log" 2>&1
            "$py" - "$run" "$threads" "$cycle" <<'EOF'
import statistics
import sys
from pathlib import Path

from horovod_micro_train.records import ITERATIONS_FILE, read_jsonl

rows = read_jsonl(Path(sys.argv[1]) / ITERATIONS_FILE)[20:]


def ms(*keys):
    return 1e3 * statistics.median(sum(r[k] for k in keys) for r in rows)


print(f"threads {sys.argv[2]}, cycle {sys.argv[3]:>7}: data {ms('data'):.2f} ms, "
      f"forward {ms('forward'):.1f}, backward {ms('backward'):.1f}, "
      f"exchange {ms('selection', 'communication'):.1f}, update {ms('update'):.1f}, "
      f"total {ms('total'):.1f}")
EOF
        done
    done
done
