"""Measure a TCP stream's rate between two emulated hosts (run inside them by
tests/test_cluster.py). ``recv ADDR PORT SKIP TOTAL``: accept one connection, read TOTAL
bytes and print the rate (bits/s) between byte SKIP and the end (SKIP covers tbf's burst).
``send ADDR PORT TOTAL``: connect (retrying while the receiver starts) and send."""

import socket
import sys
import time


def receive(addr: str, port: int, skip: int, total: int) -> None:
    server = socket.create_server((addr, port))
    print("LISTENING", flush=True)
    conn, _ = server.accept()
    got, start = 0, None
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


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
