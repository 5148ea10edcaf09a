"""The training loop the scripts of this folder share: plain Horovod PyTorch, as in
Horovod's own ``examples/pytorch``. Each rank reads its shard of the data
(``DistributedSampler``), metrics are averaged over the ranks with ``hvd.allreduce``, and
rank 0 prints."""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train(model, optimizer, train_set, test_set, *, epochs: int, batch_size: int,
          max_iters: int | None = None, log_every: int = 50) -> float:
    """Train ``epochs`` epochs (at most ``max_iters`` iterations each); returns the test
    accuracy averaged over the ranks."""
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                      shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)
    accuracy = 0.0
    for epoch in range(epochs):
        model.train()
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for i, (x, y) in enumerate(loader):
            if max_iters is not None and i >= max_iters:
                break
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if i % log_every == 0 and hvd.rank() == 0:
                print(f"epoch {epoch} iteration {i} loss {loss.item():.4f}", flush=True)
        seconds = time.perf_counter() - start
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for i, (x, y) in enumerate(test_loader):
                if max_iters is not None and i >= max_iters:
                    break
                correct += int((model(x).argmax(1) == y).sum())
                total += len(y)
        accuracy = metric_average(correct / max(total, 1), "accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test accuracy {accuracy:.4f}, {seconds:.1f} s", flush=True)
    return accuracy
