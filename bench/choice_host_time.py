"""Host time of one MiCRO selection on the device path: the choice made on the device
against the host rule, on the CPU with ``HOROVOD_MICRO_SELECT=torch`` (one thread).

On a small part the time is Python and op dispatch, which a GPU's host pays as well (plus
a launch per op), while the host rule also waits for the device once (its read of the
counts) and the device-side choice does not. On a large part it is the CPU's own compute
of the torch ops (the CPU's native kernel is neither of these). The two run alternated,
rounds of ``--calls`` calls each; medians.

    .venv/bin/python -m bench.choice_host_time --numel 2000 20000
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time


def _medians(numel: int, density: float, rounds: int, calls: int) -> tuple[float, float]:
    """Median microseconds per selection: (host rule, device-side choice)."""
    import torch

    from horovod_micro.compressors.micro.device_choice import device_choice
    from horovod_micro.compressors.micro.part_controller import PartController
    from horovod_micro.selection import ThresholdSelector

    k = max(int(density * numel), 1)
    acc = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    controller = PartController(k, [numel], density)
    scale = torch.sqrt(torch.dot(acc, acc).double() / numel)

    def host_rule():
        controller.select(acc, 0, numel, 0, ThresholdSelector(4 * k + 64), scale)

    def on_device():
        device_choice(controller, acc, 0, numel, 0, ThresholdSelector(4 * k + 64), scale,
                      math.ceil(1.2 * k))

    times: dict = {host_rule: [], on_device: []}
    for f in times:
        for _ in range(calls // 2):
            f()
    for _ in range(rounds):
        for f, seen in times.items():
            start = time.perf_counter()
            for _ in range(calls):
                f()
            seen.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times[host_rule]), statistics.median(times[on_device])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, nargs="+", default=[2000, 20000])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    os.environ["HOROVOD_MICRO_SELECT"] = "torch"
    import torch

    torch.set_num_threads(1)
    print("| part size | host rule, us | device-side choice, us | ratio |\n|---:|---:|---:|---:|")
    for numel in args.numel:
        host, device = _medians(numel, args.density, args.rounds, args.calls)
        print(f"| {numel} | {host:.0f} | {device:.0f} | {device / host:.2f} |")


if __name__ == "__main__":
    main()
