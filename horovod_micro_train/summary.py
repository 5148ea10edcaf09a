"""The end-of-run summary: one screen on stdout, ``summary.json`` under ``--out``.

It is computed from the records on disk, so a resumed run's summary covers the whole run.
"Bytes vs dense" compares the bytes the slowest rank sent, per iteration and over the whole
run, with what it would have sent in a dense fp32 ring allreduce of the same model on the
same number of ranks (``2 (n-1)/n`` times the model's bytes per iteration).
"""

from __future__ import annotations

import json
from pathlib import Path

from horovod_micro.stats import ring_allreduce_bytes

from .records import EPOCHS_FILE, ITERATIONS_FILE, TIME_FIELDS, read_jsonl


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(out: Path) -> dict:
    """Summary of the run recorded under ``out``; also written to ``out/summary.json``."""
    config = json.loads((out / "run.json").read_text())
    iterations = read_jsonl(out / ITERATIONS_FILE)
    epochs = read_jsonl(out / EPOCHS_FILE)
    n = config["world_size"]
    numel = iterations[0]["numel"] if iterations else config["parameters"]
    dense = ring_allreduce_bytes(4 * numel, n)[0]
    best = max(epochs, key=lambda e: e["test_accuracy"]) if epochs else None
    densities = [r["density"] for r in iterations]
    sent = _mean([r["bytes_sent"] for r in iterations])
    summary = {
        "out": str(out), "dataset": config["dataset"], "model": config["model"],
        "compressor": config["compressor"], "world_size": n, "parameters": numel,
        "epochs": len(epochs), "iterations": len(iterations),
        "final_accuracy": epochs[-1]["test_accuracy"] if epochs else None,
        "best_accuracy": best["test_accuracy"] if best else None,
        "best_epoch": best["epoch"] if best else None,
        "target_density": iterations[0]["target_density"] if iterations else None,
        "mean_density": _mean(densities),
        "min_density": min(densities, default=0.0), "max_density": max(densities, default=0.0),
        "bytes_sent_per_iteration": sent, "dense_bytes_per_iteration": dense,
        "bytes_sent_total": sum(r["bytes_sent"] for r in iterations),
        "dense_bytes_total": dense * len(iterations),
        "bytes_ratio": sent / dense if dense else None,
        "time_per_iteration": {f: _mean([r[f] for r in iterations]) for f in TIME_FIELDS},
        "train_time": epochs[-1]["train_time"] if epochs else 0.0,
        "elapsed": epochs[-1]["elapsed"] if epochs else 0.0,
        "records": [str(out / ITERATIONS_FILE), str(out / EPOCHS_FILE)],
        "checkpoint": str(out / "checkpoint.pt"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GB"


def format_summary(s: dict, figures: str | None = None) -> str:
    """The one-screen text of a :func:`summarize` result."""
    t = s["time_per_iteration"]
    ms = {k: 1000 * v for k, v in t.items()}
    lines = [
        f"== {s['dataset']} / {s['model']} / {s['compressor']} on {s['world_size']} ranks: "
        f"{s['epochs']} epochs, {s['iterations']} iterations, {s['parameters']:,} weights ==",
    ]
    if s["final_accuracy"] is not None:
        lines.append(f"test accuracy   : {s['final_accuracy']:.2%} final, "
                     f"{s['best_accuracy']:.2%} best (epoch {s['best_epoch'] + 1})")
    if s["target_density"] is not None:
        lines.append(f"density         : {s['mean_density']:.5g} mean actual vs "
                     f"{s['target_density']:.5g} target (min {s['min_density']:.5g}, "
                     f"max {s['max_density']:.5g})")
    if s["world_size"] == 1:
        lines.append("bytes/iteration : none (a single rank exchanges nothing)")
    elif s["bytes_ratio"] is not None:
        lines.append(f"bytes/iteration : {_bytes(s['bytes_sent_per_iteration'])} sent by the "
                     f"busiest rank; a dense fp32 allreduce would send "
                     f"{_bytes(s['dense_bytes_per_iteration'])} ({s['bytes_ratio']:.2%})")
        lines.append(f"bytes in total  : {_bytes(s['bytes_sent_total'])} sent (busiest rank "
                     f"of each iteration); dense would have sent {_bytes(s['dense_bytes_total'])}")
    lines.append(
        f"time/iteration  : {ms['total']:.2f} ms (slowest rank) = data {ms['data']:.2f} + "
        f"forward {ms['forward']:.2f} + backward {ms['backward']:.2f} + selection "
        f"{ms['selection']:.2f} + communication {ms['communication']:.2f} + other exchange "
        f"{ms['sync_other']:.2f} + update {ms['update']:.2f}")
    lines.append(f"wall time       : {s['train_time']:.1f} s training, {s['elapsed']:.1f} s "
                 "with evaluation and checkpoints")
    lines.append(f"records         : {', '.join(s['records'])}")
    if Path(s["checkpoint"]).exists():  # none under --elastic
        lines.append(f"checkpoint      : {s['checkpoint']} (continue with --resume)")
    lines.append(f"figures         : {figures}" if figures else
                 "figures         : python -m horovod_micro_train.plot "
                 f"{s['out']} --out {s['out']}/figures")
    return "\n".join(lines)


def write_figures(out: Path) -> str | None:
    """Draw the run's figures into ``out/figures``; ``None`` if matplotlib is missing."""
    try:
        from .plot import make_figures
    except ImportError:
        return None
    paths = make_figures([out], out / "figures")
    return f"{out / 'figures'}/ ({', '.join(p.name for p in paths)})"
