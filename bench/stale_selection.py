"""What it costs in accuracy to choose MiCRO's coordinates one step ahead.

MiCRO's exchange runs after backward because each part's owner chooses its coordinates
in ``a_t = e_{t-1} + g_t``, and the values can be summed only once every rank knows the
chosen indices. If the owner chose in its residual ``e_{t-1}`` instead, the index set of
step t would be known when backward of step t starts: the index gather could run during
the forward pass, and the value allreduce bucket by bucket during backward, as dense
Horovod's allreduce does. The values sent stay those of ``a_t``. The price is a judgement
one gradient old; this benchmark measures it before any rank code is written.

Two step-ahead judges, each MiCRO with the shipped defaults except for what its owner
judges (nothing is agreed at the first step, which therefore applies nothing):

* ``micro_stale`` (simulated here): the residual ``e_{t-1}`` alone, with MiCRO's own
  exchange. A coordinate applied at step t-1 is 0 there on every rank, so it cannot be
  chosen at t: the coordinates whose gradient keeps its sign, sent on most steps by the
  defaults, go at most every other step;
* ``micro_ahead``, the shipped method (:mod:`horovod_micro.compressors.micro.ahead`): its
  own one-allreduce exchange, judging ``e_{t-1} + w g_{t-1}`` with ``w = 2`` under SGD,
  the previous gradient standing in for the one backward has not computed yet, and
  ``w = 0`` (the residual alone) under Adam and AdamW.

Each runs in ``bench.scaling``'s simulator (the real reducers on loopback ranks, the same
recipe and seeds) beside the defaults, so each pair differs only in the judgement (and,
for ``micro_ahead``, the exchange that carries it)::

    .venv/bin/python -m bench.stale_selection --workers 2 3 4 6 8 12 16 --seeds 1 2 \\
        --variants micro_stale micro_ahead --json runs/stale-selection.json

Prints, per n, seed and variant, the final test accuracy of both, their difference and the
bytes each rank sends per step; with ``--optimizer adamw`` the Adam recipe of
``bench.scaling``. What the step-ahead exchange costs per iteration: ``micro-ahead`` in
``bench.iteration_ranks``, and the floors of ``bench.pipeline``'s ``ahead-*`` variants.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.scaling import OPTIMIZERS, train
from horovod_micro.compressors import register
from horovod_micro.compressors.micro.compressor import MicroCompressor


@register
class StaleMicroCompressor(MicroCompressor):
    """MiCRO whose owner chooses in ``e_{t-1}`` (this rank's residual after the step
    before) and sends the values of ``a_t`` at the chosen coordinates."""

    name = "micro_stale"

    def bind(self, numel, comm) -> None:
        super().bind(numel, comm)
        self._acc: torch.Tensor | None = None
        self._before: torch.Tensor | None = None  # e_{t-1}

    def select(self, acc: torch.Tensor, iteration: int):
        self._acc = acc
        before = self._before if self._before is not None else torch.zeros_like(acc)
        return super().select(before, iteration)

    def observe(self, reduced) -> None:
        super().observe(reduced)
        # The reducer has just written the residual into a_t's buffer (what this rank sent
        # is cleared there): that is e_t, which the next step judges.
        self._before = self._acc.clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4, 6, 8, 12, 16])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="nesterov")
    p.add_argument("--variants", nargs="+", choices=("micro_stale", "micro_ahead"),
                   default=["micro_stale", "micro_ahead"])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = json.loads(args.json.read_text())["runs"] if args.json and args.json.exists() else []
    print("| n | seed | variant | micro | variant's | variant - micro, points "
          "| KB per rank per step: micro / variant's |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for n in args.workers:
        for seed in args.seeds:
            pair = {}
            for method in ("micro", *args.variants):
                done = [r for r in runs if (r["method"], r["n"], r["seed"], r["optimizer"])
                        == (method, n, seed, args.optimizer)]
                if not done:
                    done = [train(method, n=n, density=args.density, epochs=args.epochs,
                                  seed=seed, optimizer=args.optimizer, report=lambda _: None)]
                    for bulky in ("weights", "curve", "diagnosis"):  # as stored
                        done[0].pop(bulky, None)
                    runs.append(done[0])
                    if args.json:
                        args.json.write_text(json.dumps({"runs": runs}))
                pair[method] = done[0]
            micro = pair["micro"]
            for variant in args.variants:
                stale = pair[variant]
                print(f"| {n} | {seed} | {variant} | {100 * micro['final_accuracy']:.2f} % | "
                      f"{100 * stale['final_accuracy']:.2f} % | "
                      f"{100 * (stale['final_accuracy'] - micro['final_accuracy']):+.2f} | "
                      f"{micro['bytes_per_step'] / 1e3:.1f} / "
                      f"{stale['bytes_per_step'] / 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
