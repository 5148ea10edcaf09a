"""Host reads and ops of one MiCRO step on the torch path (what a GPU would pay), counted.

On a GPU every read of a tensor's value by the host (``.item()``, ``float()``/``int()``/
``bool()`` of a tensor, ``.tolist()``) and every data-dependent shape (``nonzero``) is a
synchronisation: the host waits for the device's queue to drain. This counts them on the
CPU, on the code path a GPU takes (``HOROVOD_MICRO_SELECT=torch``), with a
``TorchDispatchMode`` (``aten._local_scalar_dense``, which every scalar read goes through,
``aten.nonzero``, ``aten.masked_select``) plus a counter on ``Tensor.tolist``, each read
charged to the line of ``horovod_micro`` that made it. Ops are every aten call of the step
(forward and backward included: compare variants, not absolutes).

    .venv/bin/python -m bench.host_reads [--steps 20] [--density 0.01] [--capacity exact] \
        [--json FILE] [--ops]
    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m bench.host_reads

A small MLP (5 linear layers, 10 parameter tensors), 10 warm-up steps, then ``--steps``
counted; rank 0 prints reads per step by line (and writes them to ``--json``). Statistics
that need a read (the residual's norm) are computed when read: this step reads none.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import traceback


def _site() -> str:
    frames = [f for f in traceback.extract_stack() if "horovod_micro" in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--capacity", default=None,
                    help="MiCRO's capacity= (default: its own; 'exact' for exact sizes)")
    ap.add_argument("--json", default=None, help="write rank 0's census here")
    ap.add_argument("--ops", action="store_true",
                    help="also list the ops per step by the line of horovod_micro that ran them")
    args = ap.parse_args()
    os.environ["HOROVOD_MICRO_SELECT"] = "torch"
    import horovod.torch as hvd
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import horovod_micro as hvm

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)],
                                torch.nn.Linear(256, 10))
    opt = hvm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=hvm.Compression.micro(
            density=args.density,
            capacity=int(args.capacity) if (args.capacity or "").isdigit() else args.capacity))
    reads: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    ops_by_site: collections.Counter = collections.Counter()
    by_site = args.ops
    scalar_reads = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select")

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            ops[name] += 1
            if by_site:
                ops_by_site[(name.removeprefix("aten."), _site())] += 1
            if name in scalar_reads:
                reads[(name.removeprefix("aten."), _site())] += 1
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        reads[("tolist", _site())] += 1
        return tolist(self)

    gen = torch.Generator().manual_seed(hvd.rank())
    batch = torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    for _ in range(10):
        step()
    torch.Tensor.tolist = counted_tolist
    try:
        with Census():
            for _ in range(args.steps):
                step()
    finally:
        torch.Tensor.tolist = tolist
    if hvd.rank() == 0:
        print(f"# {hvd.size()} rank(s), MiCRO d = {args.density}, capacity "
              f"{args.capacity or 'default'}, torch path, "
              f"{args.steps} steps\n\n| reads per step | kind | line |\n|---:|---|---|")
        for (kind, line), count in sorted(reads.items(), key=lambda kv: -kv[1]):
            print(f"| {count / args.steps:.2f} | {kind} | {line} |")
        print(f"\nhost reads per step: {sum(reads.values()) / args.steps:.2f}; "
              f"ops per step (model included): {sum(ops.values()) / args.steps:.1f}")
        if args.ops:
            print("\n| ops per step | op | line |\n|---:|---|---|")
            for (op, line), count in sorted(ops_by_site.items(), key=lambda kv: -kv[1]):
                if line != "?":
                    print(f"| {count / args.steps:.2f} | {op} | {line} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": hvd.size(), "steps": args.steps,
                           "reads_per_step": sum(reads.values()) / args.steps,
                           "ops_per_step": sum(ops.values()) / args.steps,
                           "by_site": {f"{kind} {line}": count / args.steps
                                       for (kind, line), count in reads.items()}}, f)


if __name__ == "__main__":
    main()
