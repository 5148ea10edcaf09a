"""CIFAR-10 with one of the MiCRO paper's models (ResNet-18, GoogLeNet, SENet-18): a plain
Horovod PyTorch script whose one changed line switches Horovod's dense allreduce to MiCRO.
Run through ``cifar10_resnet18.py``, ``cifar10_googlenet.py`` or ``cifar10_senet18.py``:

    horovodrun -np 4 -H localhost:4 --gloo python train/cifar10_resnet18.py --data-dir data

``--data-dir`` holds torchvision's ``cifar-10-batches-py`` (``--download`` fetches it);
``--synthetic`` trains on random images of the same shape instead (a smoke run: accuracy
stays at chance). The paper's recipe: batch 32 per rank, density 0.001, 150 epochs."""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
from loop import train

import horovod_micro as hvm
from horovod_micro_train.data import build_datasets, synthetic_datasets
from horovod_micro_train.models import build_model


def main(model_name: str) -> None:
    parser = argparse.ArgumentParser(description=f"CIFAR-10, {model_name}, Horovod + MiCRO")
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--dense", action="store_true", help="Horovod's own optimizer")
    parser.add_argument("--max-iters", type=int, default=None, help="per epoch")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--download", action="store_true")
    parser.add_argument("--synthetic", action="store_true")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(1)
    torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))

    data = (synthetic_datasets(512, seed=1) if args.synthetic
            else build_datasets("cifar10", args.data_dir, download=args.download))
    model = build_model(model_name, data.num_classes)
    lr = args.lr * args.batch_size * hvd.size() / 128  # scaled with the global batch
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if args.dense:
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
    else:  # the one-line switch
        optimizer = hvm.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=hvm.Compression.micro(args.density))

    accuracy = train(model, optimizer, data.train, data.test, epochs=args.epochs,
                     batch_size=args.batch_size, max_iters=args.max_iters)
    if hvd.rank() == 0:
        method = "dense" if args.dense else f"micro d={args.density}"
        print(f"done: {method}, {model_name} on {hvd.size()} ranks, "
              f"test accuracy {accuracy:.4f}")
