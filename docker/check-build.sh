#!/usr/bin/env bash
# Print `horovodrun --check-build` and fail unless every name given is checked ("[X] NAME"):
#   docker/check-build.sh PyTorch MPI Gloo NCCL
# The image build ends with it; it also runs on any machine with horovodrun on PATH.
set -euo pipefail
[ "$#" -gt 0 ] || { echo "usage: $0 NAME..." >&2; exit 2; }
report="$(horovodrun --check-build)"
printf '%s\n' "$report"
missing=()
for name in "$@"; do
    grep -Eq "^[[:space:]]*\[X\][[:space:]]+${name}[[:space:]]*$" <<<"$report" || missing+=("$name")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "check-build: Horovod was built without: ${missing[*]}" >&2
    exit 1
fi
echo "check-build: found $*"
