#!/usr/bin/env bash
# `make image-test`, second part: what the set-up installs on a fresh Debian machine, in a
# fresh container of the base image (the one `make image` built on; the repository mounted
# read-only), through tools/setup.sh's package steps (HVM_PACKAGES_ONLY=1):
#   1. `make run`'s set-up: Open MPI and Fashion-MNIST are installed, and no SSH server and
#      no SLURM (openssh-server, slurm-wlm, slurmctld, slurmd) is;
#   2. then `make test`'s (HVM_CLUSTER_TOOLS=1): they are installed, no unit of theirs is
#      enabled (no link under /etc/systemd/system/*.wants), none of their daemons runs, and
#      the container's policy-rc.d is as it was before.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=docker/image-env.sh
. "$REPO/docker/image-env.sh"

BASE="${HVM_BASE_IMAGE:-$LOCAL_BASE}"
image_exists "$BASE" || BASE="${HVM_REGISTRY_BASE:-ubuntu:24.04}"
image_exists "$BASE" || { log "no base image: run make image first"; exit 1; }

read -r -d '' IN_CONTAINER <<'SCRIPT' || true
set -euo pipefail
installed() { [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]; }
policy_state() { if [ -e /usr/sbin/policy-rc.d ]; then sha256sum </usr/sbin/policy-rc.d; else echo none; fi; }
daemons() {  # running sshd, slurmctld, slurmd or munged processes
    for c in /proc/[0-9]*/comm; do
        case "$(cat "$c" 2>/dev/null)" in sshd|slurmctld|slurmd|munged) echo "$c";; esac
    done
}
before="$(policy_state)"
cd /src
echo "== make run's set-up (the packages)"
HVM_PACKAGES_ONLY=1 bash tools/setup.sh
command -v mpirun >/dev/null && [ -d /usr/share/datasets/fashion-mnist ]
for pkg in openssh-server slurm-wlm slurmctld slurmd; do
    if installed "$pkg"; then echo "setup-packages: make run installed $pkg" >&2; exit 1; fi
done
echo "setup-packages: make run installed no SSH server and no SLURM"
echo "== make test's set-up (the packages)"
HVM_CLUSTER_TOOLS=1 HVM_PACKAGES_ONLY=1 bash tools/setup.sh
for pkg in openssh-server slurmctld slurmd; do installed "$pkg"; done
links="$(find /etc/systemd/system -path '*.wants/*' \( -name 'ssh*' -o -name 'slurm*' \
    -o -name 'munge*' \) 2>/dev/null || true)"
[ -z "$links" ] || { echo "setup-packages: enabled at boot: $links" >&2; exit 1; }
running="$(daemons)"
[ -z "$running" ] || { echo "setup-packages: running: $running" >&2; exit 1; }
[ "$(policy_state)" = "$before" ] || { echo "setup-packages: policy-rc.d changed" >&2; exit 1; }
echo "setup-packages: make test installed sshd and SLURM, none enabled or running; passed"
SCRIPT

if [ "$HVM_BUILDER" = docker ]; then
    docker run --rm -v "$REPO:/src:ro" "$BASE" bash -c "$IN_CONTAINER"
else
    ctr="$(bh from --quiet "$BASE")"
    trap 'bh rm "$ctr" >/dev/null' EXIT
    bh run --uts host -v "$REPO:/src:ro" "$ctr" -- bash -c "$IN_CONTAINER"
fi
