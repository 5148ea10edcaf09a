"""The selection kernel's software prefetch distance, measured.

Why: on a 2-core VM the AVX2 compare loop of ``_native/select.c`` ran at
1.3-1.6x the time of ``torch.sum`` over the same cold data: the hardware prefetcher alone
did not keep it fed. This builds the kernel's own source several times with
``-DPREFETCH_AHEAD=D`` (0: no prefetch), loads every build side by side with ctypes, and
times each against the read floor (``torch.sum`` of the same cold part, 5.6M floats: half
of ResNet-18's gradient), interleaved, paired per repetition, at no hit, d = 0.001 and
d = 0.01 (thresholds of a standard normal). Prints the median ratio to the floor.

    .venv/bin/python -m bench.kernel_prefetch [--distances 0 1024 2048 4096] [--reps 31]

Needs gcc and the Python headers (the set-up builds the kernel with them too). On a loaded
machine run it under ``chrt -f 50`` (as root): the paired ratios then match a quiet run.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

SOURCE = Path(__file__).resolve().parent.parent / "horovod_micro/_native/select.c"
#: |x| >= t keeps this share of a standard normal (no hit, d = 0.001, d = 0.01).
CASES = (("no hit", 1e9), ("d = 0.001", 3.2905), ("d = 0.01", 2.5758))


def build(distance: int, out_dir: Path):
    """The kernel's ``hvm_select_abs_ge`` built with ``PREFETCH_AHEAD=distance``."""
    lib = out_dir / f"select_{distance}.so"
    subprocess.run(["gcc", "-O3", "-fno-math-errno", "-shared", "-fPIC",
                    f"-DPREFETCH_AHEAD={distance}", f"-I{sysconfig.get_paths()['include']}",
                    str(SOURCE), "-o", str(lib)], check=True)
    fn = ctypes.CDLL(str(lib)).hvm_select_abs_ge
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64]
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--distances", nargs="+", type=int, default=[0, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--numel", type=int, default=11_173_962 // 2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    part = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    flush = torch.ones(16 * 1024 * 1024)  # 64 MB: evicts the part from every cache level
    out = torch.empty(args.numel // 50, dtype=torch.int32)

    def cold(fn) -> float:
        flush.sum()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        kernels = {d: build(d, Path(tmp)) for d in args.distances}
        print("| hits | " + " | ".join(f"prefetch {d}" if d else "no prefetch"
                                       for d in kernels) + " |")
        print("|---|" + "---:|" * len(kernels))
        for label, threshold in CASES:
            ratios: dict[int, list[float]] = {d: [] for d in kernels}
            for _ in range(args.reps):
                floor = cold(lambda: torch.sum(part))
                for d, fn in kernels.items():
                    ratios[d].append(cold(lambda fn=fn, t=threshold: fn(
                        part.data_ptr(), part.numel(), t, 0, out.data_ptr(),
                        out.numel())) / floor)
            print(f"| {label} | " + " | ".join(f"{median(r):.2f}x" for r in ratios.values())
                  + " |", flush=True)


if __name__ == "__main__":
    main()
