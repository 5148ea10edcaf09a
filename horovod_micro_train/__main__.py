"""``horovodrun -np 2 -H localhost:2 --gloo python -m horovod_micro_train [flags]``: see
:mod:`horovod_micro_train.cli`.

The entry point chooses between a fixed set of ranks (:func:`.trainer.run`) and Elastic
Horovod (:func:`.elastic.run_elastic`), and turns a :class:`~.cli.TrainError`, raised
alike on every rank, into one error line and exit status 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import horovod.torch as hvd

from .cli import TrainError, parse_args
from .elastic import run_elastic
from .summary import format_summary, write_figures
from .threads import share_cores
from .trainer import run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    share_cores(args.threads, hvd.local_size())
    try:
        summary = run_elastic(args) if args.elastic else run(args)
    except TrainError as error:  # raised alike on every rank: report once, no traceback
        if hvd.rank() == 0:
            print(f"python -m horovod_micro_train: error: {error}", file=sys.stderr, flush=True)
        return 2
    if hvd.rank() == 0:
        figures = None if args.no_plots else write_figures(Path(args.out))
        print(format_summary(summary, figures), flush=True)
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
