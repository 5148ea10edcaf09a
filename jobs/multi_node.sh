#!/usr/bin/env bash
# The experiment matrix on several nodes: `horovodrun -np N -H host1:8,host2:8 ...` (or
# `--hostfile FILE` with lines `host1 slots=8`). Run it on one of the nodes; horovodrun
# reaches the others over passwordless ssh, and every node needs the same paths
# (repository or image, data, output directory).
#
#   jobs/multi_node.sh --hosts node1:8,node2:8 --data-dir /data --out-dir /runs --dry-run
#   jobs/multi_node.sh --hostfile hosts.txt --iface eth0 --data-dir /data --out-dir /runs
#
# Networking (docs/jobs.md, "Several nodes"): --iface IF sets NCCL_SOCKET_IFNAME,
# HOROVOD_GLOO_IFACE and horovodrun --network-interfaces; NCCL_IB_HCA, NCCL_IB_DISABLE,
# NCCL_IB_GID_INDEX, NCCL_SOCKET_IFNAME, HOROVOD_GLOO_IFACE, NCCL_DEBUG ... set in the
# environment are passed on to every rank. Options: jobs/matrix.py --help; after `--`:
# arguments for every run.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PY" "$HERE/matrix.py" --launcher hosts "$@"
