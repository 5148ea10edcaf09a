"""Why MiCRO needs more iterations than dense training: one ingredient changed at a time.

On the emulated cluster (``bench.time_to_accuracy``, n = 4, d = 0.001) MiCRO reaches 85 %
on Fashion-MNIST in about twice dense's iterations, and that factor, not the iteration
time, is what stands between it and 3x sooner. This script finds which ingredient of the
method costs those iterations, without Horovod or a network: one process computes the n
workers' gradients in turn (the same model, data, batch and lr schedule as the cluster
runs) and applies one of these updates to a single copy of the weights.

* ``dense``: the mean gradient.
* ``micro``: MiCRO's rule. The flat vector is cut into n parts; at iteration t worker w owns
  part ``(t + w) mod n`` and picks the top ``k * |part| / N`` entries of its own error-
  compensated gradient ``a_w = e_w + g_w`` there (an exact count where the optimizer steers
  a threshold to it); every worker's values at the union are averaged, and each worker's
  residual keeps ``a_w`` elsewhere.
* ``micro-summed``: the same parts, quotas and rotation, but the owner judges the workers'
  summed ``a``: an oracle (it would take a dense exchange), which isolates what judging by
  one worker's local view costs.
* ``micro-momentum-correction``: ``micro`` with DGC's momentum correction (Lin et al., ICLR
  2018): momentum is accumulated per worker before the residual, the selected
  coordinates' momentum is cleared, and the optimizer steps without momentum.
* ``global-topk``: the top k of the summed ``a`` over the whole vector (what gTop-k
  approximates): no parts at all.

Every method steps the wrapped SGD (Nesterov 0.9, weight decay 1e-4, the trainer's linear
scaling and warm-up) on its averaged sparse gradient; momentum correction steps it without
momentum. With ``--density 1`` every method but momentum correction is dense training
(``tests/test_iterations_ablation.py``).

    python -m bench.iterations_ablation                   # n=4, d=0.001, 700 iterations
    python -m bench.iterations_ablation --methods dense micro --iters 300

Reports, per method, the iteration of the first evaluation at or above each target and the
accuracy at the end (``--json``, ``--markdown``). About 0.3-0.4 s per iteration at n = 4 on
two vCPUs, so the default run takes about half an hour.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.nn import functional as F  # noqa: N812

from horovod_micro.partition import owned_part, part_bounds
from horovod_micro.reducer import FlatLayout
from horovod_micro_train.data import build_datasets
from horovod_micro_train.models import build_model
from horovod_micro_train.schedule import lr_at, peak_lr

METHODS = ("dense", "micro", "micro-summed", "micro-momentum-correction", "global-topk")
MOMENTUM, WEIGHT_DECAY = 0.9, 1e-4


def as_tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """A map-style dataset of (image, label) pairs as two stacked tensors."""
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(xs), torch.tensor([int(y) for y in ys])


@functools.cache
def load(dataset: str, data_dir: str | None, seed: int) -> tuple:
    """Train and test tensors and the class count, read once per process (every method
    of a run trains on the same data)."""
    data = build_datasets(dataset, data_dir, seed=seed)
    return (*as_tensors(data.train), *as_tensors(data.test), data.num_classes)


class Workers:
    """The n simulated workers' error-feedback state and the rule that merges their
    gradients into one averaged (sparse) gradient."""

    def __init__(self, method: str, n: int, numel: int, density: float):
        self.method, self.n, self.numel = method, n, numel
        self.k = max(1, int(density * numel))
        self.parts = part_bounds(numel, n)
        sparse = method != "dense"
        self.residual = [torch.zeros(numel) for _ in range(n)] if sparse else []
        self.velocity = ([torch.zeros(numel) for _ in range(n)]
                         if method == "micro-momentum-correction" else [])

    def merge(self, grads: Sequence[torch.Tensor], iteration: int) -> torch.Tensor:
        """The averaged gradient the optimizer applies at ``iteration``."""
        if self.method == "dense":
            return torch.stack(list(grads)).sum(0) / self.n
        for w, g in enumerate(grads):
            if self.velocity:
                self.velocity[w].mul_(MOMENTUM).add_(g)
                g = self.velocity[w]
            self.residual[w].add_(g)  # a_w = e_w + g_w, in place
        acc = self.residual
        summed = (torch.stack(acc).sum(0)
                  if self.method in ("micro-summed", "global-topk") else None)
        if self.method == "global-topk":
            chosen = summed.abs().topk(self.k).indices
        else:
            picks = []
            for w in range(self.n):
                start, end = self.parts[owned_part(w, iteration, self.n)]
                judged = (summed if summed is not None else acc[w])[start:end]
                quota = min(end - start, max(1, round(self.k * (end - start) / self.numel)))
                picks.append(start + judged.abs().topk(quota).indices)
            chosen = torch.cat(picks)
        merged = torch.zeros(self.numel)
        merged[chosen] = torch.stack([a[chosen] for a in acc]).sum(0) / self.n
        for w in range(self.n):
            acc[w][chosen] = 0.0
            if self.velocity:
                self.velocity[w][chosen] = 0.0
        return merged


def train(method: str, *, n: int, density: float, iters: int, eval_every: int,
          dataset: str = "fashion-mnist", model_name: str = "wide_mlp",
          data_dir: str | None = None, batch_size: int = 32, lr: float = 0.1,
          warmup_epochs: float = 0.5, seed: int = 1,
          report: Callable[[str], None] = print) -> dict:
    """One simulated run; returns its accuracy curve and final flat weights."""
    x, y, test_x, test_y, num_classes = load(dataset, data_dir, seed)
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes)
    layout = FlatLayout(list(model.named_parameters()))
    params, numel = layout.params, layout.numel
    peak = peak_lr(lr, batch_size, n)
    momentum = 0.0 if method == "micro-momentum-correction" else MOMENTUM
    optimizer = torch.optim.SGD(params, lr=peak, momentum=momentum,
                                nesterov=momentum > 0, weight_decay=WEIGHT_DECAY)
    workers = Workers(method, n, numel, density)
    steps_per_epoch = len(x) // (batch_size * n)
    order = torch.Generator().manual_seed(seed)
    curve, start = [], time.perf_counter()
    for it in range(iters):
        step = it % steps_per_epoch
        if step == 0:
            perm = torch.randperm(len(x), generator=order)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it / steps_per_epoch, peak, n, warmup_epochs, (), 0.1)
        grads = []
        for w in range(n):
            batch = perm[(step * n + w) * batch_size:(step * n + w + 1) * batch_size]
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        merged = workers.merge(grads, it)
        for p, view in zip(params, layout.views(merged)):
            p.grad = view
        optimizer.step()
        if (it + 1) % eval_every == 0 or it + 1 == iters:
            accuracy = evaluate(model, test_x, test_y)
            curve.append((it + 1, accuracy))
            report(f"{method}: iteration {it + 1}, test accuracy {accuracy:.4f} "
                   f"({time.perf_counter() - start:.0f} s)")
    weights = torch.cat([p.detach().reshape(-1) for p in params])
    return {"method": method, "curve": curve, "weights": weights}


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                      for i in range(0, len(x), 1000))
    model.train()
    return correct / len(x)


def first_at(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """The iteration of the first evaluation at or above ``target`` (None: never)."""
    return next((it for it, acc in curve if acc >= target), None)


def table(runs: Sequence[dict], targets: Sequence[float]) -> str:
    dense = next((r for r in runs if r["method"] == "dense"), None)
    head = " | ".join(f"iterations to {t:.0%}" for t in targets)
    lines = [f"| method | {head} | accuracy at the end |",
             "|---|" + "---:|" * (len(targets) + 1)]
    for run in runs:
        cells = []
        for t in targets:
            it = first_at(run["curve"], t)
            base = first_at(dense["curve"], t) if dense else None
            ratio = f" ({it / base:.2f}x dense)" if it and base else ""
            cells.append("not reached" if it is None else f"{it}{ratio}")
        lines.append(f"| {run['method']} | " + " | ".join(cells)
                     + f" | {run['curve'][-1][1]:.2%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--iters", type=int, default=700)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="wide_mlp")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--targets", type=float, nargs="+", default=[0.80, 0.85])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    if not 0.0 < args.density <= 1.0:
        p.error(f"--density must be in (0, 1], got {args.density}")
    torch.set_num_threads(args.threads)
    runs = []
    for method in args.methods:
        run = train(method, n=args.workers, density=args.density, iters=args.iters,
                    eval_every=args.eval_every, dataset=args.dataset,
                    model_name=args.model, data_dir=args.data_dir, seed=args.seed)
        runs.append({"method": method, "curve": run["curve"]})
    text = (f"n = {args.workers} simulated workers, d = {args.density}, seed {args.seed}, "
            f"{args.model} on {args.dataset}\n\n" + table(runs, args.targets))
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k not in ("json", "markdown")},
                                         "runs": runs}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
