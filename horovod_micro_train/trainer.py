"""The training loop of ``python -m horovod_micro_train``: one process per rank under
``horovodrun``.

Each iteration is timed phase by phase around the real work: data loading, forward,
backward, the gradient exchange (``optimizer.synchronize()``, split with the optimizer's
own ``last_stats`` into selection, communication and the rest) and the parameter update
(``step()`` inside ``skip_synchronize()``, so it times the update only). On a GPU every
boundary synchronises the device, so asynchronous kernels are charged to their own phase.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor as HorovodCompressor
from torch.nn import functional as F  # noqa: N812

import horovod_micro as hvm
from horovod_micro.compressors import config_of
from horovod_micro.stats import StepStats

from . import checkpoint, provenance
from .cli import TrainError, compressor_names
from .data import Datasets, build_datasets, eval_loader, train_loader
from .models import build_model
from .progress import Progress
from .records import EpochBuffer, RecordWriter
from .schedule import lr_at, peak_lr
from .summary import summarize

CHECKPOINT = "checkpoint.pt"


class UnknownCompressorError(TrainError, ValueError):
    """``--compressor`` names nothing in ``hvm.Compression``."""


def build_compression(name: str, density: float, controller: str | None = None,
                      momentum_masking: bool | None = None, judge: str | None = None,
                      capacity: int | str | None = None, powersgd_rank: int | None = None,
                      options: list[tuple[str, object]] = ()):
    """``hvm.Compression.<name>``: dense classes as they are, sparse factories called with
    ``density`` where they take one (and MiCRO with ``controller``, ``judge`` and
    ``capacity``, PowerSGD with its rank, any method with ``momentum_masking``, when given),
    plus ``options`` (``--compressor-option``: any keyword the factory takes). Unknown
    names list what this horovod_micro offers."""
    factory = getattr(hvm.Compression, name, None)
    if factory is None or name.startswith("_"):
        raise UnknownCompressorError(
            f"--compressor {name}: this horovod_micro has no Compression.{name} "
            f"(available: {', '.join(compressor_names())})")
    dense = isinstance(factory, type) and issubclass(factory, HorovodCompressor)
    params = {} if dense else inspect.signature(factory).parameters
    extra = {}
    for flag, key, value, applies in (
            ("--momentum-masking", "momentum_masking", momentum_masking, "sparse methods"),
            ("--judge", "judge", judge, "micro"),
            ("--controller", "controller", controller, "micro"),
            ("--capacity", "capacity", capacity, "micro"),
            ("--powersgd-rank", "rank", powersgd_rank, "powersgd")):
        if value is None:
            continue
        if key not in params:
            raise TrainError(f"{flag} applies to {applies}, not --compressor {name}")
        extra[key] = value
    for key, value in options:
        if key in extra:
            flag = {"rank": "--powersgd-rank"}.get(key, f"--{key.replace('_', '-')}")
            raise TrainError(f"--compressor-option {key}={value!r} and {flag} {extra[key]!r} "
                             "both set it: give one")
        if key not in params or key == "density":
            takes = ", ".join(k for k in params if k != "density") or "nothing"
            raise TrainError(f"--compressor-option {key}: Compression.{name} takes no {key} "
                             f"(it takes {takes}; the density is --density)")
        extra[key] = value
    if dense:
        return factory
    if "density" in params:
        return factory(density=density, **extra)
    return factory(**extra)


def _capacity(text: str | None) -> int | str | None:
    """``--capacity``: a number of slots, or "exact" (None: the method's default)."""
    return int(text) if text is not None and text.isdigit() else text


@dataclass
class Context:
    """Everything one rank's loop works with."""

    args: argparse.Namespace
    device: torch.device
    data: Datasets
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: torch.utils.data.DataLoader
    sampler: torch.utils.data.distributed.DistributedSampler
    test_loader: torch.utils.data.DataLoader
    peak_lr: float
    sparse: bool

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def setup(args: argparse.Namespace, cifar_classes: dict | None = None) -> Context:
    """Data, model and distributed optimizer of this rank (after ``hvd.init()``)."""
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if use_cuda else "cpu")
    data = build_datasets(args.dataset, args.data_dir, args.download, args.seed,
                          args.synthetic_size, cifar_classes)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = build_model(args.model, data.num_classes).to(device)
    if not getattr(args, "elastic", False):  # elastic: TorchState's sync broadcasts
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # From here on each rank draws its own augmentation randomness.
    torch.manual_seed(args.seed + 1 + hvd.rank())
    peak = peak_lr(args.lr, args.batch_size, hvd.size(), not args.no_lr_scaling)
    base = torch.optim.SGD(model.parameters(), lr=peak, momentum=args.momentum,
                           nesterov=not args.no_nesterov and args.momentum > 0,
                           weight_decay=args.weight_decay,
                           fused=True if args.fused_sgd else None)
    masking = getattr(args, "momentum_masking", None)
    compression = build_compression(args.compressor, args.density,
                                    getattr(args, "controller", None),
                                    None if masking is None else masking == "on",
                                    getattr(args, "judge", None),
                                    _capacity(getattr(args, "capacity", None)),
                                    getattr(args, "powersgd_rank", None),
                                    getattr(args, "compressor_options", []))
    optimizer = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                         compression=compression)
    loader, sampler = train_loader(data.train, args.batch_size, args.workers, args.seed,
                                   pin_memory=use_cuda)
    tests = eval_loader(data.test, args.test_batch_size, args.workers, pin_memory=use_cuda)
    return Context(args, device, data, model, optimizer, loader, sampler, tests, peak,
                   sparse=not isinstance(compression, type))


def _local_grad_norm(model: torch.nn.Module) -> float:
    norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def train_epoch(ctx: Context, epoch: int, iteration: int, progress: Progress,
                on_eval: Callable[[int, float], None] | None = None
                ) -> tuple[list[dict], float]:
    """One epoch; returns this rank's per-iteration rows and the loop's wall time.

    With ``--eval-every N``, ``on_eval(iteration, seconds)`` runs after every N-th
    iteration but the epoch's last (``seconds``: this rank's training time so far in the
    epoch); the time it takes is left out of the returned wall time.
    """
    args = ctx.args
    ctx.model.train()
    ctx.sampler.set_epoch(epoch)
    steps = len(ctx.train_loader)
    if args.max_iters_per_epoch:
        steps = min(steps, args.max_iters_per_epoch)
    rows, start, paused = [], time.perf_counter(), 0.0
    batches = iter(ctx.train_loader)
    for step in range(steps):
        row = train_step(ctx, batches, epoch, step, steps, iteration, ctx.peak_lr)
        rows.append(row)
        iteration += 1
        if hvd.rank() == 0:
            progress.update(epoch, step, steps, row["loss"], row["density"])
        every = args.eval_every
        if on_eval is not None and every and iteration % every == 0 and step + 1 < steps:
            pause = time.perf_counter()
            on_eval(iteration, pause - start - paused)
            ctx.model.train()
            paused += time.perf_counter() - pause
    return rows, time.perf_counter() - start - paused


def _evaluate_mid_epoch(ctx: Context, writer: RecordWriter, epoch: int, train_time: float,
                        iteration: int, seconds: float) -> None:
    """An ``--eval-every`` evaluation: one ``evals.jsonl`` row, at the slowest rank's
    training time (the runs's training time before this epoch plus ``seconds``)."""
    began = time.perf_counter()
    seconds = float(hvd.allreduce(torch.tensor(seconds), op=hvd.Max, name="train.eval_at"))
    test_loss, accuracy = evaluate(ctx)
    writer.evaluation({"epoch": epoch, "iteration": iteration,
                       "train_time": train_time + seconds, "test_loss": test_loss,
                       "test_accuracy": accuracy, "eval_time": time.perf_counter() - began})


def _no_exchange(ctx: Context, iteration: int) -> StepStats:
    """What a dense method on a single rank records: Horovod's optimizer then exchanges
    nothing (and leaves ``last_stats`` unset), so every gradient element is applied."""
    numel = sum(p.numel() for p in ctx.model.parameters())
    return StepStats(iteration=iteration, method=ctx.args.compressor, numel=numel,
                     target_count=numel, threshold=None, rank_counts=[numel],
                     global_count=numel, density=1.0)


def train_step(ctx: Context, batches, epoch: int, step: int, steps: int, iteration: int,
               peak: float) -> dict:
    """One timed iteration on the next batch of ``batches``; returns its row."""
    args, model, opt = ctx.args, ctx.model, ctx.optimizer
    t0 = time.perf_counter()
    x, y = next(batches)
    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
    lr = lr_at(epoch + step / steps, peak, hvd.size(), args.warmup_epochs,
               args.lr_decay_epochs, args.lr_decay_factor)
    for group in opt.param_groups:
        group["lr"] = lr
    ctx.sync()
    t1 = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    ctx.sync()
    t2 = time.perf_counter()
    loss.backward()
    ctx.sync()
    t3 = time.perf_counter()
    # Untimed: the local gradient's norm scales the residual norm in the figures (dense
    # gradients are being reduced in place by then, so only sparse methods have it).
    grad_norm = _local_grad_norm(model) if ctx.sparse else None
    t3b = time.perf_counter()
    opt.synchronize()
    ctx.sync()
    t4 = time.perf_counter()
    with opt.skip_synchronize():
        opt.step()
    ctx.sync()
    t5 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    stats = opt.last_stats or _no_exchange(ctx, iteration)
    exchange = t4 - t3b
    return {
        "epoch": epoch, "iteration": iteration, "step": step, "lr": lr,
        "loss": float(loss.detach()), "data": t1 - t0, "forward": t2 - t1,
        "backward": t3 - t2, "selection": stats.select_time,
        "communication": stats.comm_time,
        "sync_other": max(exchange - stats.select_time - stats.comm_time, 0.0),
        "update": t5 - t4, "total": (t3 - t0) + (t5 - t3b),
        "method": stats.method, "density": stats.density,
        "target_density": stats.target_density, "threshold": stats.threshold,
        "global_count": stats.global_count, "target_count": stats.target_count,
        "rank_counts": stats.rank_counts, "load_imbalance": stats.load_imbalance,
        "selected_counts": stats.selected_counts, "momentum_masked": stats.momentum_masked,
        "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
        "residual_norm": stats.residual_norm if ctx.sparse else None,
        "grad_norm": grad_norm, "nonfinite": stats.nonfinite, "numel": stats.numel,
    }


@torch.no_grad()
def evaluate(ctx: Context) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test set, each sample counted once."""
    ctx.model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    for x, y in ctx.test_loader:
        x, y = x.to(ctx.device), y.to(ctx.device)
        out = ctx.model(x)
        totals[0] += float(F.cross_entropy(out, y, reduction="sum"))
        totals[1] += float((out.argmax(1) == y).sum())
        totals[2] += y.numel()
    totals = hvd.allreduce(totals, op=hvd.Sum, name="train.eval")
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def _open_tensorboard(args: argparse.Namespace, out: Path):
    if not args.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # every rank raises the same error before training
        raise TrainError("--tensorboard needs the tensorboard package: "
                           "pip install 'horovod-micro[tensorboard]'") from error
    return SummaryWriter(str(out / "tensorboard")) if hvd.rank() == 0 else None


def run(args: argparse.Namespace, cifar_classes: dict | None = None) -> dict:
    """Train as ``args`` say (every rank calls it); returns the run's summary."""
    started = time.perf_counter()
    out = Path(args.out)
    tensorboard = _open_tensorboard(args, out)
    ctx = setup(args, cifar_classes)
    rank0 = hvd.rank() == 0
    start_epoch, iteration, train_time, elapsed0 = 0, 0, 0.0, 0.0
    if args.resume:
        path = out / CHECKPOINT if args.resume == "auto" else Path(args.resume)
        counters = checkpoint.load(path, ctx.model, ctx.optimizer)
        start_epoch, iteration = counters["epoch"], counters["iteration"]
        train_time, elapsed0 = counters["train_time"], counters["elapsed"]
    writer = RecordWriter(out, rank0, start_epoch if args.resume else None)
    hosts = provenance.gather_hosts()
    if rank0:
        config = {**vars(args), "world_size": hvd.size(), "hosts": hosts,
                  "device": str(ctx.device),
                  "compression_config": config_of(ctx.optimizer.compression),
                  "peak_lr": ctx.peak_lr, "parameters": sum(p.numel() for p in
                                                           ctx.model.parameters()),
                  "train_samples": len(ctx.data.train), "test_samples": len(ctx.data.test)}
        (out / "run.json").write_text(json.dumps(config, indent=1))
    progress = Progress(args.progress, args.epochs)
    buffer = EpochBuffer()
    for epoch in range(start_epoch, args.epochs):
        on_eval = partial(_evaluate_mid_epoch, ctx, writer, epoch, train_time)
        rows, seconds = train_epoch(ctx, epoch, iteration, progress, on_eval)
        iteration += len(rows)
        for row in rows:
            buffer.add(row)
        rows = buffer.aggregate()
        seconds = float(hvd.allreduce(torch.tensor(seconds), op=hvd.Max, name="train.ep"))
        train_time += seconds
        eval_start = time.perf_counter()
        test_loss, accuracy = evaluate(ctx)
        record = {
            "epoch": epoch, "iterations": iteration,
            "train_loss": _mean_loss(rows),
            "test_loss": test_loss, "test_accuracy": accuracy, "epoch_time": seconds,
            "train_time": train_time, "eval_time": time.perf_counter() - eval_start,
            "elapsed": elapsed0 + time.perf_counter() - started,
            "lr": rows[-1]["lr"] if rows else None,
            "mean_density": sum(r["density"] for r in rows) / max(len(rows), 1),
        }
        writer.iterations(rows)
        writer.epoch(record)
        writer.evaluation({"iteration": iteration, **{key: record[key] for key in (
            "epoch", "train_time", "test_loss", "test_accuracy", "eval_time")}})
        _log_tensorboard(tensorboard, rows, record)
        if rank0:
            loss = record["train_loss"]
            progress.end_epoch(f"epoch {epoch + 1}/{args.epochs}: train loss "
                               f"{'not finite' if loss is None else f'{loss:.4f}'}, "
                               f"test accuracy {accuracy:.2%}, {seconds:.1f} s")
        checkpoint.save(out / CHECKPOINT, ctx.model, ctx.optimizer, {
            "epoch": epoch + 1, "iteration": iteration, "train_time": train_time,
            "elapsed": record["elapsed"], "args": vars(args)})
    if tensorboard is not None:
        tensorboard.close()
    provenance.write_rank_record(out, ctx.model)
    summary = summarize(out) if rank0 else {}
    return hvd.broadcast_object(summary, root_rank=0, name="horovod_micro_train.summary")


def _mean_loss(rows: list[dict]) -> float | None:
    """The epoch's mean training loss; None once the loss is not finite (a diverged run:
    its rows hold None for a NaN mean over ranks) or when the epoch had no iteration."""
    losses = [r["loss"] for r in rows]
    if not losses or any(loss is None or not math.isfinite(loss) for loss in losses):
        return None
    return sum(losses) / len(losses)


def _log_tensorboard(tb, rows: list[dict], record: dict) -> None:
    if tb is None:
        return
    for row in rows:
        for key in ("loss", "lr", "density", "threshold", "residual_norm", "total",
                    "selection", "communication", "bytes_sent", "bytes_received"):
            if row.get(key) is not None:
                tb.add_scalar(f"iteration/{key}", row[key], row["iteration"])
    for key in ("train_loss", "test_loss", "test_accuracy", "epoch_time", "mean_density"):
        if record[key] is not None:
            tb.add_scalar(f"epoch/{key}", record[key], record["epoch"])
    tb.add_scalar("epoch/bytes_sent", sum(r["bytes_sent"] for r in rows), record["epoch"])
    tb.add_scalar("wall/test_accuracy", record["test_accuracy"], int(record["train_time"]))
