"""Command line of ``python -m horovod_micro_train`` (run it under ``horovodrun``).

The flags are a stable interface (job scripts are built against :func:`build_parser`);
docs/reproducing.md lists them. Flags left unset take the defaults of the chosen dataset's
recipe (:data:`RECIPES`), so ``--dataset cifar10`` alone is the MiCRO paper's set-up and a bare
``python -m horovod_micro_train`` is the main job: Fashion-MNIST with MiCRO, a couple of minutes
on two CPU ranks (``--dataset digits`` is the seconds-long embedded run).
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence

import horovod_micro as hvm
from horovod_micro.compression import takes_density
from horovod_micro.compressors.registry import compressor_names


class TrainError(RuntimeError):
    """A problem with the user's input or files (missing data, unknown compressor, bad
    checkpoint): ``python -m horovod_micro_train`` prints it without a traceback and exits with
    2."""


class DataNotFoundError(TrainError, FileNotFoundError):
    """The dataset's files are not where ``--data-dir`` (or its default) says."""


DATASETS = ("digits", "fashion-mnist", "cifar10", "cifar100", "synthetic")

#: Per-dataset defaults of the flags whose argparse default is ``None``.
#: CIFAR: the paper's recipe (reference scripts of Yoon & Oh: batch 32 per worker, base lr
#: 0.1 for a global batch of 128 scaled linearly, 5 warm-up epochs, 200 epochs, decay x0.1 at
#: epoch 150, density 0.001). Digits: a 12-epoch version that finishes in well under a minute
#: on two CPU ranks; density 0.01 because the model has only 38k weights (0.001 would send
#: 38 coordinates per step). Fashion-MNIST (``make run``): a 784-256-10 MLP (203,530
#: weights), 3 epochs at batch 64 per worker: 87 % test accuracy in under two minutes on two
#: busy CPU ranks, where each step's exchange costs more than its compute, so half the
#: steps of batch 32 halve the time.
#: Synthetic: throughput only (random labels), a few short epochs.
RECIPES: dict[str, dict] = {
    "cifar10": dict(model="resnet18", epochs=200, warmup_epochs=5.0, lr_decay_epochs=[150],
                    density=0.001, workers=2, batch_size=32),
    "cifar100": dict(model="resnet18", epochs=200, warmup_epochs=5.0, lr_decay_epochs=[150],
                     density=0.001, workers=2, batch_size=32),
    "digits": dict(model="digits_cnn", epochs=12, warmup_epochs=1.0, lr_decay_epochs=[9],
                   density=0.01, workers=0, batch_size=32),
    "fashion-mnist": dict(model="fmnist_mlp", epochs=3, warmup_epochs=0.5, lr_decay_epochs=[2],
                          density=0.01, workers=0, batch_size=64),
    "synthetic": dict(model="resnet18", epochs=3, warmup_epochs=0.0, lr_decay_epochs=[],
                      density=0.001, workers=0, batch_size=32),
}


def compressor_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--compressor-option``: VALUE as a Python literal (``2``,
    ``'magnitude'``, ``False``), or as the bare word when it is none (``judge=magnitude``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m horovod_micro_train`` (stable: job scripts are tested against
    it)."""
    p = argparse.ArgumentParser(
        prog="python -m horovod_micro_train",
        description="Train with Horovod and a gradient compressor (MiCRO by default); run "
                    "under horovodrun. Unset flags take the dataset's recipe (see RECIPES).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None,
                   help="resnet18 | googlenet | senet18 | digits_cnn | fmnist_mlp | wide_mlp "
                        "(default: by dataset)")
    g.add_argument("--dataset", default="fashion-mnist", choices=DATASETS)
    g.add_argument("--data-dir", default=None,
                   help="fashion-mnist: the folder holding the four idx .gz files (default "
                        "/usr/share/datasets/fashion-mnist, Debian's dataset-fashion-mnist); "
                        "CIFAR: the root holding cifar-10-batches-py/ or cifar-100-python/ "
                        "(default data)")
    g.add_argument("--download", action="store_true",
                   help="download CIFAR into --data-dir if missing (off: never any network)")
    g.add_argument("--workers", type=int, default=None, help="DataLoader worker processes")
    g.add_argument("--synthetic-size", type=int, default=4096,
                   help="training samples of the synthetic dataset")

    g = p.add_argument_group("compression")
    g.add_argument("--compressor", default="micro", choices=compressor_names(),
                   metavar="NAME",
                   help="hvm.Compression attribute: " + "|".join(compressor_names()))
    g.add_argument("--density", type=float, default=None,
                   help="target density of sparse compressors (default: by dataset)")
    g.add_argument("--controller", default=None,
                   help="MiCRO's density controller: bounded (default) | scale | newton | "
                        "paper (the authors' rule as written)")
    g.add_argument("--judge", choices=("drift", "magnitude"), default=None,
                   help="what MiCRO's owners rank by: drift (default) | magnitude (as "
                        "published)")
    g.add_argument("--capacity", default=None, metavar="SLOTS|exact",
                   help="MiCRO's index slots per rank (default: 1.2 k/n, one shape every "
                        "step); exact: exact sizes, renegotiated every step")
    g.add_argument("--powersgd-rank", type=int, default=None, metavar="R",
                   help="PowerSGD's approximation rank (default 1)")
    g.add_argument("--compressor-option", action="append", type=compressor_option,
                   default=[], metavar="KEY=VALUE", dest="compressor_options",
                   help="any keyword of hvm.Compression.NAME, VALUE a Python literal "
                        "(repeatable): --compressor-option rank=2, judge='magnitude'")
    g.add_argument("--momentum-masking", choices=("on", "off"), default=None,
                   help="clear the momentum where a sparse aggregate arrived (default: the "
                        "method's own, on for micro; off runs MiCRO as published)")

    g = p.add_argument_group("optimisation (paper recipe)")
    g.add_argument("--epochs", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=None,
                   help="per worker (default: by dataset; 32, Fashion-MNIST 64)")
    g.add_argument("--test-batch-size", type=int, default=256, help="per worker")
    g.add_argument("--lr", type=float, default=0.1,
                   help="base lr for a global batch of 128, scaled by batch*ranks/128")
    g.add_argument("--no-lr-scaling", action="store_true",
                   help="use --lr as is instead of scaling it by batch*ranks/128")
    g.add_argument("--warmup-epochs", type=float, default=None,
                   help="gradual warm-up from lr/ranks to the scaled lr")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--no-nesterov", action="store_true", help="plain instead of Nesterov")
    g.add_argument("--weight-decay", type=float, default=1e-4)
    g.add_argument("--fused-sgd", action="store_true",
                   help="torch's fused SGD kernel (fused=True): the same update in one pass "
                        "over the weights instead of several (wide_mlp's update on one CPU "
                        "thread: 52 ms -> 8 ms)")
    g.add_argument("--lr-decay-epochs", type=int, nargs="*", default=None,
                   help="epochs at which the lr is multiplied by --lr-decay-factor")
    g.add_argument("--lr-decay-factor", type=float, default=0.1)
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--max-iters-per-epoch", type=int, default=None,
                   help="cut every epoch short (tiny runs, throughput)")
    g.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="also evaluate on the test set every N iterations (evals.jsonl: "
                        "accuracy against training time, evaluations not counted)")

    g = p.add_argument_group("elastic (run under horovodrun --min-np/--max-np "
                             "--host-discovery-script)")
    g.add_argument("--elastic", action="store_true",
                   help="Elastic Horovod: survive lost and added workers "
                        "(docs/reproducing.md, Elastic training)")
    g.add_argument("--commit-every", type=int, default=10, metavar="K",
                   help="with --elastic: commit the state in memory every K iterations")

    g = p.add_argument_group("output")
    g.add_argument("--out", default="runs/default",
                   help="records (JSON Lines), checkpoint, figures")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                   help="continue from CHECKPOINT (default: OUT/checkpoint.pt)")
    g.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")
    g.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                   help="rank 0's progress display (auto: bar on a terminal, else lines)")
    g.add_argument("--no-plots", action="store_true", help="skip the figures at the end")
    g.add_argument("--no-cuda", action="store_true", help="train on CPU even with a GPU")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads per rank (default: OMP_NUM_THREADS if set, else the "
                        "host's cores shared among its ranks)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and fill the unset flags from the dataset's recipe."""
    parser = build_parser()
    args = parser.parse_args(argv)
    density_given = args.density is not None
    for key, value in RECIPES[args.dataset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.density is not None and not 0.0 < args.density <= 1.0:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    factory = getattr(hvm.Compression, args.compressor, None)
    if factory is not None and not takes_density(factory):
        # A dense method or PowerSGD (a rank): no density applies, and none is recorded.
        if density_given:
            parser.error(f"--density applies to the methods that take a density, not "
                         f"--compressor {args.compressor}")
        args.density = None
    if args.elastic and args.resume:
        parser.error("--resume cannot be combined with --elastic (a checkpoint holds one "
                     "residual per rank of a fixed world size)")
    for flag in ("download", "tensorboard", "eval_every"):
        if args.elastic and getattr(args, flag):
            parser.error(f"--{flag.replace('_', '-')} cannot be combined with --elastic "
                         "(docs/reproducing.md, Elastic training)")
    for name in ("epochs", "batch_size", "test_batch_size", "commit_every", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args
