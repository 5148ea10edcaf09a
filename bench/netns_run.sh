#!/usr/bin/env bash
# Run a command inside a fresh network namespace whose loopback is rate-limited by tc tbf.
#
#   bench/netns_run.sh RATE TIMEOUT_S COMMAND [ARGS...]
#
# RATE is a tc rate (100mbit, 1gbit) or "none" (namespace without a limit). Everything the
# command sends over 127.0.0.1 (Gloo's TCP pairs between local ranks) passes the tbf qdisc
# on the namespace's loopback: both directions share that one queue. burst 1mb and
# latency 1s: a smaller burst or shorter latency made Gloo time out.
#
# HVM_TBF_BURST (default 1mb) sets another burst; the loopback's MTU is then 1500 (its own
# 64 KiB packets would not fit a small bucket, and Gloo would time out). What the burst
# does: a message that finds the bucket full passes at loopback speed, so with 1mb every
# message under about 1 MB that follows a quiet moment costs no wire time at all. A burst
# of a few packets (64kb) charges every message its wire time (BENCHMARKS.md, "Iteration
# time on rate-limited links").
# The namespace is deleted on every exit path (success, failure, timeout, Ctrl-C/TERM);
# the command runs in its own session so its whole process group can be killed.
set -euo pipefail
rate=$1 limit=$2
shift 2
ns="hvm-bench-$$"
child=""
cleanup() {
    if [[ -n "$child" ]] && kill -0 "$child" 2>/dev/null; then
        kill -TERM -- "-$child" 2>/dev/null || true
        sleep 2
        kill -KILL -- "-$child" 2>/dev/null || true
    fi
    ip netns del "$ns" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM
ip netns add "$ns"
burst=${HVM_TBF_BURST:-1mb}
ip netns exec "$ns" ip link set lo up
if [[ "$burst" != 1mb ]]; then
    ip netns exec "$ns" ip link set lo mtu 1500
fi
if [[ "$rate" != none ]]; then
    ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst "$burst" latency 1s
fi
ip netns exec "$ns" tc qdisc show dev lo >&2
setsid timeout --kill-after=10 "$limit" ip netns exec "$ns" "$@" &
child=$!
wait "$child"
