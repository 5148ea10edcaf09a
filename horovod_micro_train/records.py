"""Per-iteration and per-epoch records, aggregated the paper's way and written by rank 0.

Every rank measures its own iterations; at the end of each epoch one allreduce (max) turns
the times and byte counts into the slowest worker's, and one allreduce (average) turns the
loss and norms into the ranks' mean. Buffering for the epoch keeps these two collectives
out of the timed iterations. Rank 0 appends the results to ``iterations.jsonl`` and
``epochs.jsonl`` under ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path

import horovod.torch as hvd
import torch

#: Seconds per phase of one iteration (each measured around the real work).
TIME_FIELDS = ("data", "forward", "backward", "selection", "communication", "sync_other",
               "update", "total")
MAX_FIELDS = TIME_FIELDS + ("bytes_sent", "bytes_received")
MEAN_FIELDS = ("loss", "residual_norm", "grad_norm")
ITERATIONS_FILE = "iterations.jsonl"
EPOCHS_FILE = "epochs.jsonl"
#: Test evaluations against training time: one per ``--eval-every`` iterations and one at
#: the end of every epoch (accuracy-against-time curves, ``bench/time_to_accuracy.py``).
EVALS_FILE = "evals.jsonl"
#: ``python -m horovod_micro_train --elastic`` only: one record per (re)start of the worker set.
MEMBERSHIP_FILE = "membership.jsonl"


class EpochBuffer:
    """One epoch's per-iteration measurements on this rank."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def aggregate(self) -> list[dict]:
        """Every rank's rows combined (collective: all ranks must call it with the same
        number of rows). Times and bytes: max over ranks; loss and norms: mean; the rest
        (density, threshold, counts: identical on every rank) from this rank."""
        if not self.rows:
            return []
        maxed = _collective([[float(r[f]) for f in MAX_FIELDS] for r in self.rows], hvd.Max,
                            "horovod_micro_train.records.max")
        meaned = _collective([[_nan_if_none(r[f]) for f in MEAN_FIELDS] for r in self.rows],
                             hvd.Average, "horovod_micro_train.records.mean")
        out = []
        for row, mx, mn in zip(self.rows, maxed, meaned):
            merged = dict(row)
            merged.update({f: v for f, v in zip(MAX_FIELDS, mx)})
            merged.update({f: (None if v != v else v) for f, v in zip(MEAN_FIELDS, mn)})
            for f in ("bytes_sent", "bytes_received"):
                merged[f] = int(merged[f])
            out.append(merged)
        self.rows = []
        return out


def _nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _collective(rows: list[list[float]], op, name: str) -> list[list[float]]:
    tensor = torch.tensor(rows, dtype=torch.float64)
    return hvd.allreduce(tensor, op=op, name=name).tolist()


class RecordWriter:
    """JSON Lines files under ``out`` (rank 0 only; other ranks get a no-op writer)."""

    def __init__(self, out: Path, enabled: bool, resume_epoch: int | None = None):
        self.out = out
        self.enabled = enabled
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        for name in (ITERATIONS_FILE, EPOCHS_FILE, EVALS_FILE):
            path = out / name
            if resume_epoch is None or not path.exists():
                path.write_text("")
            else:
                # Drop records of epochs after the checkpoint (an interrupted epoch),
                # and a last line cut short by a crash.
                kept = [line for line in _whole_lines(path)
                        if json.loads(line)["epoch"] < resume_epoch]
                path.write_text("".join(line + "\n" for line in kept))

    def iterations(self, rows: list[dict]) -> None:
        self._append(ITERATIONS_FILE, rows)

    def epoch(self, row: dict) -> None:
        self._append(EPOCHS_FILE, [row])

    def evaluation(self, row: dict) -> None:
        self._append(EVALS_FILE, [row])

    def _append(self, name: str, rows: list[dict]) -> None:
        if self.enabled and rows:
            with open(self.out / name, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")


def _whole_lines(path: Path) -> list[str]:
    """The non-empty lines of ``path``, without a last line that a crash cut short."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return lines


def read_jsonl(path: Path) -> list[dict]:
    """All records of one JSON Lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def method_label(config: dict) -> str:
    """How reports and figures name a run's method, from its ``run.json``: ``none``,
    ``micro d=0.001``, ``powersgd rank=2`` (the density only for a method that takes one;
    ``--compressor-option`` values and the method's own flags, such as ``judge=magnitude``,
    after it, so that a label without them means the method's defaults)."""
    import horovod_micro as hvm
    from horovod_micro.compression import takes_density

    name = config["compressor"]
    factory = getattr(hvm.Compression, name, None)
    takes = factory is not None and takes_density(factory)
    label = f"{name} d={config['density']:g}" if takes else name
    options = dict(config.get("compressor_options") or [])
    if config.get("powersgd_rank"):
        options.setdefault("rank", config["powersgd_rank"])
    for flag in METHOD_FLAGS:
        if config.get(flag) is not None:  # a method's own flag: not its defaults
            options.setdefault(flag, config[flag])
    return " ".join([label, *(f"{k}={v}" for k, v in options.items())])


#: The flags of ``run.json`` that set a method's own options (``None``: its default).
METHOD_FLAGS = ("controller", "judge", "capacity", "momentum_masking")
#: All that configures the method beyond its name and density (``None`` or empty: its
#: defaults): those flags, PowerSGD's rank and ``--compressor-option``.
METHOD_SETTINGS = (*METHOD_FLAGS, "powersgd_rank", "compressor_options")


def method_settings(config: dict) -> dict:
    """What a run's ``run.json`` says of its method beyond its name and density: every flag
    of :data:`METHOD_SETTINGS` as recorded (all ``None`` or empty: the shipped defaults)."""
    return {flag: config.get(flag) for flag in METHOD_SETTINGS}
