"""Which lines of one MiCRO step make the host wait for the GPU: a census.

docs/gpu.md lists, from reading the code, the host synchronisations left in a step on CUDA
tensors. This counts them on a real GPU instead: the ranks train the model with
``hvm.DistributedOptimizer`` (MiCRO, defaults), and after the warm-up steps run a few
under ``torch.cuda.set_sync_debug_mode("warn")``, which makes PyTorch warn at every
operation that synchronises the host with the device (``.item()``, ``float(t)``,
``nonzero``, a device-to-host copy, ...). Each warning carries the Python line that
caused it; the table counts them per line and step.

What it cannot see: waits inside Horovod's C++ (its collectives' completion), which do not
go through PyTorch. Those are the collectives' own, one per collective.

Needs a CUDA device and Horovod built with it (``horovodrun -np 1`` suffices: every sync
that a rank makes with n ranks it makes with one, only the collectives differ).

    python -m bench.cuda_syncs --np 1 --json runs/cuda_syncs.json
"""

from __future__ import annotations

import argparse
import json
import linecache
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

from bench.common import random_batches
from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import horovod_micro as hvm
    from bench.pipeline import build_model

    hvd.init()
    device = torch.device("cuda", hvd.local_rank())
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(args.model).to(device)
    opt = hvm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=hvm.Compression.micro(density=args.density))
    batches = [(x.to(device), y.to(device)) for x, y in random_batches(args.model, 32, 8)]

    def step(t: int) -> None:
        opt.zero_grad()
        x, y = batches[t % len(batches)]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for t in range(args.warmup):
        step(t)
    torch.cuda.synchronize()
    where: Counter = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for t in range(args.steps):
            step(args.warmup + t)
        torch.cuda.set_sync_debug_mode("default")
    torch_dir = str(Path(torch.__file__).parent)
    for w in caught:  # (switching the mode back off warns from inside torch: not a step's)
        if "synchroniz" in str(w.message) and not w.filename.startswith(torch_dir):
            where[(w.filename, w.lineno)] += 1
    rows = [{"file": str(Path(f).resolve().relative_to(REPO)) if str(f).startswith(str(REPO))
             else f, "line": n, "per_step": c / args.steps,
             "source": linecache.getline(f, n).strip()} for (f, n), c in where.items()]
    rows.sort(key=lambda r: (r["file"], r["line"]))
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "ranks": hvd.size(), "steps": args.steps, "rows": rows,
              "per_step": sum(r["per_step"] for r in rows),
              "stats": opt.last_stats.to_dict()}
    if hvd.rank() == 0:
        Path(args.worker).write_text(json.dumps(result))
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("wide_mlp", "resnet18"), default="wide_mlp")
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = [sys.executable, "-m", "bench.cuda_syncs", "--worker", str(out),
                "--model", args.model, "--density", str(args.density),
                "--warmup", str(args.warmup), "--steps", str(args.steps)]
        run_bounded(horovodrun_cmd(args.np, "gloo", argv), timeout=600,
                    env={"PYTHONPATH": str(REPO)})
        result = json.loads(out.read_text())
    print(f"# host syncs per MiCRO step: {args.model}, d = {args.density}, "
          f"{result['ranks']} rank(s) on {result['device']}, torch {result['torch']}; "
          f"{result['per_step']:g} per step\n")
    print("| file:line | per step | source |\n|---|---:|---|")
    for r in result["rows"]:
        print(f"| {r['file']}:{r['line']} | {r['per_step']:g} | `{r['source']}` |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         **result}, indent=1))


if __name__ == "__main__":
    main()
