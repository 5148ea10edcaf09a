"""Two ranks of the installed wheel, run from outside the checkout (tests/test_wheel.py):
MiCRO and PowerSGD each train a small model a few steps; every rank ends with the same
weights. Prints one JSON line on rank 0."""

import json
import sys

import horovod.torch as hvd
import torch

import horovod_micro as hvm
from horovod_micro import _select  # the native kernel came with the wheel

hvd.init()
results = {"file": hvm.__file__, "native": _select.__file__, "version": hvm.__version__}
for name, compression in (("micro", hvm.Compression.micro(density=0.1)),
                          ("powersgd", hvm.Compression.powersgd(rank=2))):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        x, y = torch.randn(8, 20, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(weights.unsqueeze(0), name=f"smoke.{name}")
    results[name] = {"same_weights": bool((everyone == everyone[0]).all()),
                     "method": opt.last_stats.method, "bytes": opt.last_stats.bytes_sent}
if hvd.rank() == 0:
    print("SMOKE " + json.dumps(results), flush=True)
hvd.shutdown()
sys.exit(0)
