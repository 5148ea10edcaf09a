"""``python -m horovod_micro_train --elastic``: the training loop under Elastic Horovod.

    horovodrun -np 2 --min-np 2 --max-np 4 --host-discovery-script ./discover.sh \\
        python -m horovod_micro_train --elastic --commit-every 10 ...

The loop runs inside ``hvd.elastic.run`` with an ``hvd.elastic.TorchState`` holding the
model, the ``hvm.DistributedOptimizer`` (residual, controller and iteration included:
:mod:`horovod_micro.elastic`) and the loop's counters. Every ``--commit-every`` iterations and
at every epoch's end the state is committed in memory. When a worker is lost, the others
restore the last commit and go on with the ranks that are left; when one is added, it
joins at the next commit with the committed state. After each reset the data shards, the
test shard and the linearly scaled learning rate follow the new number of ranks, and the
epoch continues at its committed step (on the new shards, so the rest of that epoch is
drawn from a new shuffle of the same epoch: a few samples may repeat or be skipped).

Records: rank 0 appends its own rows (no per-epoch max/mean over ranks, which needs a fixed set
of ranks) to ``iterations.jsonl`` at each commit, with a ``world_size`` field, so the file holds
exactly the committed iterations; ``membership.jsonl`` gets one record per (re)start: iteration,
epoch, world size. ``python -m horovod_micro_train.plot`` draws a vertical line at each
membership change.

Not under ``--elastic``: file checkpoints and ``--resume`` (a checkpoint holds one
residual per rank of a fixed world size), and CIFAR's ``--download`` (a barrier before the
elastic loop).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, Sampler

from .data import eval_loader
from .progress import Progress
from .records import EPOCHS_FILE, ITERATIONS_FILE, MEMBERSHIP_FILE
from .schedule import peak_lr
from .summary import summarize
from .trainer import Context, evaluate, setup, train_step


class ResumedSampler(Sampler):
    """A DistributedSampler's indices for ``epoch`` without the first ``skip`` of them:
    the rest of an epoch after a reset, without loading the batches already done."""

    def __init__(self, dataset, epoch: int, skip: int, seed: int):
        self.inner = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=seed)
        self.inner.set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return iter(list(self.inner)[self.skip:])

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


def _append(path: Path, rows: list[dict]) -> None:
    if hvd.rank() == 0 and rows:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def run_elastic(args: argparse.Namespace) -> dict:
    """Train as ``args`` say under Elastic Horovod (every worker calls it); returns the
    run's summary."""
    started = time.perf_counter()
    out = Path(args.out)
    ctx = setup(args)  # no collective here: a joining worker must not run one
    state = hvd.elastic.TorchState(model=ctx.model, optimizer=ctx.optimizer, epoch=0, step=0,
                                   iteration=0, train_time=0.0, epoch_loss=0.0,
                                   epoch_density=0.0, epoch_rows=0, starts=0)
    pending: list[dict] = []  # rank 0's rows since the last commit
    # Rows after the last commit are undone by a restore: they must not be written.
    state.register_reset_callbacks([pending.clear])
    progress = Progress(args.progress, args.epochs)

    def commit() -> None:
        _append(out / ITERATIONS_FILE, pending)
        pending.clear()
        state.commit()

    @hvd.elastic.run
    def train(state) -> None:
        state.starts += 1
        if hvd.rank() == 0 and state.starts == 1:
            _start_files(out, args, ctx)
        _append(out / MEMBERSHIP_FILE, [{
            "start": state.starts, "iteration": state.iteration, "epoch": state.epoch,
            "step": state.step, "world_size": hvd.size(),
            "elapsed": time.perf_counter() - started}])
        peak = peak_lr(args.lr, args.batch_size, hvd.size(), not args.no_lr_scaling)
        ctx.test_loader = eval_loader(ctx.data.test, args.test_batch_size, args.workers)
        while state.epoch < args.epochs:
            steps = _epoch_steps(ctx, args)
            sampler = ResumedSampler(ctx.data.train, state.epoch, state.step * args.batch_size,
                                     args.seed)
            batches = iter(DataLoader(ctx.data.train, batch_size=args.batch_size,
                                      sampler=sampler, num_workers=args.workers))
            ctx.model.train()
            while state.step < steps:
                row = train_step(ctx, batches, state.epoch, state.step, steps,
                                 state.iteration, peak)
                row["world_size"] = hvd.size()
                if hvd.rank() == 0:
                    pending.append(row)
                    progress.update(state.epoch, state.step, steps, row["loss"],
                                    row["density"])
                state.train_time += row["total"]
                state.epoch_loss += row["loss"]
                state.epoch_density += row["density"]
                state.epoch_rows += 1
                state.step += 1
                state.iteration += 1
                if state.iteration % args.commit_every == 0:
                    commit()
            _end_epoch(ctx, state, out, started)
            state.epoch, state.step = state.epoch + 1, 0
            state.epoch_loss = state.epoch_density = 0.0
            state.epoch_rows = 0
            commit()

    train(state)
    summary = summarize(out) if hvd.rank() == 0 else {}
    return hvd.broadcast_object(summary, root_rank=0, name="horovod_micro_train.summary")


def _epoch_steps(ctx: Context, args: argparse.Namespace) -> int:
    """Batches per epoch at the current number of ranks."""
    per_rank = -(-len(ctx.data.train) // hvd.size())
    steps = -(-per_rank // args.batch_size)
    return min(steps, args.max_iters_per_epoch) if args.max_iters_per_epoch else steps


def _start_files(out: Path, args: argparse.Namespace, ctx: Context) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in (ITERATIONS_FILE, EPOCHS_FILE, MEMBERSHIP_FILE):
        (out / name).write_text("")
    config = {**vars(args), "world_size": hvd.size(), "device": str(ctx.device),
              "peak_lr": peak_lr(args.lr, args.batch_size, hvd.size(),
                                 not args.no_lr_scaling),
              "parameters": sum(p.numel() for p in ctx.model.parameters()),
              "train_samples": len(ctx.data.train), "test_samples": len(ctx.data.test)}
    (out / "run.json").write_text(json.dumps(config, indent=1))


def _end_epoch(ctx: Context, state, out: Path, started: float) -> None:
    eval_start = time.perf_counter()
    test_loss, accuracy = evaluate(ctx)
    rows = max(state.epoch_rows, 1)
    _append(out / EPOCHS_FILE, [{
        "epoch": state.epoch, "iterations": state.iteration,
        "train_loss": state.epoch_loss / rows, "test_loss": test_loss,
        "test_accuracy": accuracy, "epoch_time": None, "train_time": state.train_time,
        "eval_time": time.perf_counter() - eval_start,
        "elapsed": time.perf_counter() - started, "lr": None,
        "mean_density": state.epoch_density / rows, "world_size": hvd.size()}])
