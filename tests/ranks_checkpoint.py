"""Rank bodies of tests/test_train_crash.py: loading damaged checkpoints on real ranks."""

from pathlib import Path

from horovod_micro_train import checkpoint
from horovod_micro_train.cli import TrainError, parse_args
from horovod_micro_train.trainer import setup


def load_each(paths: dict[str, str], flags: list[str], unwritable: str) -> dict:
    """Try ``checkpoint.load`` on every file of ``paths`` (case -> path), then
    ``checkpoint.save`` to the path ``unwritable``, and report what this rank raised. A rank
    that raised goes on to the next case, so a case in which the ranks disagreed would
    show up as a hang of the next one."""
    ctx = setup(parse_args(flags))
    report = {}
    try:
        checkpoint.save(Path(unwritable), ctx.model, ctx.optimizer,
                        {"epoch": 0, "iteration": 0, "train_time": 0.0, "elapsed": 0.0})
        report["unwritable"] = {"raised": None}
    except TrainError as error:
        report["unwritable"] = {"raised": type(error).__name__, "message": str(error)}
    for case, path in paths.items():
        try:
            counters = checkpoint.load(Path(path), ctx.model, ctx.optimizer)
            report[case] = {"raised": None, "epoch": counters["epoch"]}
        except TrainError as error:
            report[case] = {"raised": type(error).__name__, "message": str(error)}
        except Exception as error:  # noqa: BLE001  any other type is what the test rejects
            report[case] = {"raised": type(error).__name__, "message": str(error)}
    return report
