"""Rank bodies of tests/test_train_cifar.py: the CIFAR path of ``train`` on real ranks."""

import horovod.torch as hvd
import torch
from torchvision.datasets import CIFAR10, CIFAR100

from horovod_micro_train.cli import parse_args
from horovod_micro_train.progress import Progress
from horovod_micro_train.trainer import setup, train_epoch


def checked_classes(md5: dict[str, str]) -> dict[str, type]:
    """torchvision's CIFAR classes listing the test-written files' checksums, through the
    class attributes torchvision documents (``train_list``, ``test_list``, ``meta``), so
    the real integrity check and loader run on them."""

    class TestCIFAR10(CIFAR10):
        train_list = [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)]
        test_list = [["test_batch", md5["test_batch"]]]
        meta = {**CIFAR10.meta, "md5": md5["batches.meta"]}

    class TestCIFAR100(CIFAR100):
        train_list = [["train", md5["train"]]]
        test_list = [["test", md5["test"]]]
        meta = {**CIFAR100.meta, "md5": md5["meta"]}

    return {"cifar10": TestCIFAR10, "cifar100": TestCIFAR100}


def one_step(root: str, md5: dict[str, str], runs: list[list[str]]) -> list[dict]:
    """For each model: batch and output shapes, then one MiCRO step (forward, backward,
    exchange of the whole flat gradient, update) on every rank."""
    results = []
    for dataset, name in runs:
        args = parse_args(["--dataset", dataset, "--data-dir", root, "--model", name,
                           "--batch-size", "4", "--workers", "0", "--density", "0.001",
                           "--max-iters-per-epoch", "1", "--progress", "none"])
        ctx = setup(args, checked_classes(md5))
        x, y = next(iter(ctx.train_loader))
        with torch.no_grad():
            logits = ctx.model(x)
        before = [p.detach().clone() for p in ctx.model.parameters()]
        rows, _ = train_epoch(ctx, 0, 0, Progress("none", 1))
        after = list(ctx.model.parameters())
        changed = sum(int(not torch.equal(a, b)) for a, b in zip(before, after))
        checksum = float(sum(p.double().sum() for p in after))
        results.append({
            "dataset": dataset, "model": name, "train_len": len(ctx.data.train),
            "test_len": len(ctx.data.test),
            "classes": ctx.data.num_classes, "batch": list(x.shape), "labels": list(y.shape),
            "logits": list(logits.shape), "changed": changed, "params": len(after),
            "checksum": checksum, "rows": len(rows), "method": rows[0]["method"],
            "global_count": rows[0]["global_count"], "numel": rows[0]["numel"],
            "weights": sum(p.numel() for p in after),
            "size": hvd.size()})
    return results
