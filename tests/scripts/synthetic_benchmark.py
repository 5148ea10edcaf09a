"""A stock Horovod PyTorch script (synthetic-data throughput benchmark, in the shape of
Horovod's examples/pytorch/pytorch_synthetic_benchmark.py, written for this project).

It knows nothing of horovod_micro: the tests switch it to MiCRO by editing the one line
that wraps the optimizer (plus the import), exactly what a user would do.
"""

import argparse
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torchvision import models

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--model", type=str, default="resnet18")
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=1)
parser.add_argument("--num-batches-per-iter", type=int, default=2)
parser.add_argument("--num-iters", type=int, default=2)
parser.add_argument("--use-adasum", action="store_true", default=False)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
model = getattr(models, args.model)(num_classes=10)
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average)  # noqa: E501
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 10


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Model: {args.model}, batch size: {args.batch_size}, ranks: {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
    img_secs.append(img_sec)
log(f"Img/sec per rank: {sum(img_secs) / len(img_secs):.1f}")
log(f"optimizer type: {type(optimizer).__module__}.{type(optimizer).__name__}")
stats = getattr(optimizer, "last_stats", None)
if stats is not None:
    log(f"last exchange: method={stats.method} density={stats.density:.5f} "
        f"iteration={stats.iteration}")
