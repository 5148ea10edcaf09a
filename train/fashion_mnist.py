"""Fashion-MNIST with a 784-256-10 MLP: a plain Horovod PyTorch script whose one changed
line switches Horovod's dense allreduce to MiCRO.

    horovodrun -np 2 -H localhost:2 --gloo python train/fashion_mnist.py
    horovodrun -np 2 -H localhost:2 --gloo python train/fashion_mnist.py --dense  # Horovod's

The data are Debian's ``dataset-fashion-mnist`` (``make run`` installs it)."""

from __future__ import annotations

import argparse
from pathlib import Path

import horovod.torch as hvd
import torch
from loop import train

import horovod_micro as hvm
from horovod_micro_train.data import fashion_mnist_datasets
from horovod_micro_train.fashion_mnist import DEBIAN_DIR
from horovod_micro_train.models import build_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128")
parser.add_argument("--density", type=float, default=0.01)
parser.add_argument("--dense", action="store_true", help="Horovod's own optimizer instead")
parser.add_argument("--max-iters", type=int, default=None, help="per epoch (a smoke run)")
parser.add_argument("--data-dir", default=DEBIAN_DIR)
args = parser.parse_args()

hvd.init()
torch.manual_seed(1)
torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))

data = fashion_mnist_datasets(Path(args.data_dir))
model = build_model("fmnist_mlp", data.num_classes)
lr = args.lr * args.batch_size * hvd.size() / 128  # scaled with the global batch
optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

if args.dense:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
else:  # the one-line switch
    optimizer = hvm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvm.Compression.micro(args.density))

accuracy = train(model, optimizer, data.train, data.test, epochs=args.epochs,
                 batch_size=args.batch_size, max_iters=args.max_iters)
if hvd.rank() == 0:
    method = "dense" if args.dense else f"micro d={args.density}"
    print(f"done: {method} on {hvd.size()} ranks, test accuracy {accuracy:.4f}")
