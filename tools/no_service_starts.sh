#!/usr/bin/env bash
# Run a command (a package installation) while Debian's invoke-rc.d starts no service:
# a policy-rc.d that answers 101 ("action forbidden") is in place for the command's
# duration. A policy-rc.d that was already there is set aside, not trusted (it may allow
# starts), and put back afterwards, also when the command fails or is interrupted.
#
#   tools/no_service_starts.sh apt-get install -y openssh-server
#
# Run it as root. HVM_POLICY_RC names the policy file (default /usr/sbin/policy-rc.d).
set -euo pipefail

policy="${HVM_POLICY_RC:-/usr/sbin/policy-rc.d}"
kept="$policy.horovod-micro-kept"
if [ -e "$kept" ]; then
    echo "no_service_starts.sh: $kept exists (an earlier run was killed?); put it back" \
         "as $policy or remove it, then run again" >&2
    exit 1
fi
restore() {
    rm -f "$policy"
    if [ -e "$kept" ]; then mv "$kept" "$policy"; fi
}
if [ -e "$policy" ]; then mv "$policy" "$kept"; fi
trap restore EXIT
trap 'exit 130' INT TERM
printf '#!/bin/sh\n# horovod-micro tools/no_service_starts.sh: no service starts during an install\nexit 101\n' \
    >"$policy"
chmod 755 "$policy"
"$@"
