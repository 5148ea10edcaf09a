"""TCP rates across the emulated cluster's links (``hvm_testbed.cluster``): what a
host can send and receive, alone and when links are shared.

    python -m bench.link_rate --rate 1gbit            # 3 hosts, the scenarios below
    python -m bench.link_rate --rate 1gbit --burst 64kb   # the same with a 64 KB tbf bucket
    python bench/link_rate.py recv ADDR PORT SKIP TOTAL   # one end (used inside a host)
    python bench/link_rate.py send ADDR PORT TOTAL

Scenarios (each stream's rate is measured at its receiver, after SKIP bytes so that tbf's
1 MB burst does not count): one stream hvm2 -> hvm1; both directions at once between hvm1
and hvm2 (full duplex: each near the rate); hvm2 and hvm3 into hvm1 at once (they share
hvm1's download: each near half). Standard library only (the ends run in the hosts).
``--burst`` sets tbf's bucket (the cluster's default 1 MB): a small bucket charges every
message its wire time, and needs the kernel's timer to refill it every ``burst / rate``
seconds (0.5 ms for 64 KB at 1 Gbit/s), which a busy machine may not keep up with.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

SKIP = 2 << 20


def receive(addr: str, port: int, skip: int, total: int) -> None:
    server = socket.create_server((addr, port))
    print("LISTENING", flush=True)
    conn, _ = server.accept()
    got, start, mark = 0, None, 0
    while got < total:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
        if start is None and got >= skip:
            start, mark = time.perf_counter(), got
    seconds = time.perf_counter() - start
    print(f"RATE {(got - mark) * 8 / seconds:.0f} BYTES {got}", flush=True)


def send(addr: str, port: int, total: int) -> None:
    for _ in range(200):
        try:
            conn = socket.create_connection((addr, port))
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"cannot connect to {addr}:{port}")
    conn.sendall(b"\0" * total)
    conn.close()


def streams(cluster, pairs: list[tuple[str, str]], total: int) -> list[float]:
    """Run one stream per (src, dst) at once; their rates in bit/s."""
    tool = str(Path(__file__).resolve())
    receivers, senders = [], []
    for i, (_, dst) in enumerate(pairs):
        proc = cluster.popen(dst, [sys.executable, tool, "recv", cluster.address(dst),
                                   str(5100 + i), str(SKIP), str(total)],
                             stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "LISTENING"
        receivers.append(proc)
    for i, (src, dst) in enumerate(pairs):
        senders.append(cluster.popen(src, [sys.executable, tool, "send", cluster.address(dst),
                                           str(5100 + i), str(total)]))
    rates = []
    for proc in receivers:
        out, _ = proc.communicate(timeout=600)
        rates.append(float(out.split()[1]))
    for proc in senders:
        proc.wait(timeout=60)
    return rates


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("recv", "send"):
        if sys.argv[1] == "recv":
            receive(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        else:
            send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="tc rate per host and direction")
    parser.add_argument("--megabytes", type=int, default=40, help="bytes per stream (MB)")
    parser.add_argument("--burst", default=None, help="tbf's bucket (default: the cluster's)")
    args = parser.parse_args(argv)
    from hvm_testbed.cluster import DEFAULT_BURST, Cluster

    total, burst = args.megabytes << 20, args.burst or DEFAULT_BURST
    scenarios = {"one stream hvm2->hvm1": [("hvm2", "hvm1")],
                 "full duplex hvm1<->hvm2": [("hvm2", "hvm1"), ("hvm1", "hvm2")],
                 "hvm2+hvm3 -> hvm1": [("hvm2", "hvm1"), ("hvm3", "hvm1")]}
    results = {}
    with Cluster.up(3, rate=args.rate, burst=burst) as cluster:
        for name, pairs in scenarios.items():
            rates = streams(cluster, pairs, total)
            results[name] = [round(r / 1e6, 1) for r in rates]
            print(f"{name}: " + ", ".join(f"{r / 1e6:.0f} Mbit/s" for r in rates), flush=True)
    print(json.dumps({"rate": args.rate, "burst": burst, "mbit_per_s": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
