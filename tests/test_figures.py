"""The accuracy figures labelled as the shipped defaults are those of recorded runs that used
the shipped defaults.

The README's results table, the docs' "Accuracy from 2 to 64 ranks" table and
BENCHMARKS.md's scaling table each show dense and MiCRO's defaults at n = 2-16; every one
of those cells must be the figure of the matching run in
``bench/results/scaling-defaults.json`` (seed 1, ``fmnist_mlp`` with Nesterov SGD,
d = 0.01, 3 epochs), where MiCRO ran as ``Compression.micro(density=0.01)`` with nothing
else set, and dense in the same run. A figure re-typed by hand, taken from another run
or with other settings fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNS = json.loads((ROOT / "bench" / "results" / "scaling-defaults.json").read_text())["runs"]
GRID = (2, 4, 8, 16)


def recorded(method: str, n: int) -> dict:
    """The one seed-1 run of ``method`` at ``n`` in the recipe the tables state."""
    found = [r for r in RUNS if r["method"] == method and r["n"] == n and r["seed"] == 1
             and r.get("model", "fmnist_mlp") == "fmnist_mlp"
             and r.get("optimizer", "nesterov") == "nesterov"]
    assert len(found) == 1, (method, n, len(found))
    run = found[0]
    assert run["density"] == 0.01 and run["epochs"] == 3, run
    return run


def percent(run: dict) -> str:
    return f"{100 * run['final_accuracy']:.2f}"


def kilobytes(run: dict) -> str:
    return f"{run['bytes_per_step'] / 1000:,.0f}"


def table(text: str, header: str) -> str:
    """The table whose header row starts with ``header``, up to the blank line after it."""
    start = text.index(header)
    end = text.find("\n\n", start)
    return text[start:] if end < 0 else text[start:end]


def row(text: str, label: str) -> list[str]:
    """The cells of the table row that starts with ``| label |``."""
    lines = [line for line in text.splitlines() if line.startswith(f"| {label} |")]
    assert len(lines) == 1, (label, lines)
    return [cell.strip() for cell in lines[0].strip("|").split("|")][1:]


def number(cell: str) -> str:
    """The first number in a cell, without its decoration (bold, %, KB)."""
    return re.search(r"[\d,]+(?:\.\d+)?", cell).group(0)


def test_the_micro_runs_are_the_shipped_defaults():
    """``bench.scaling`` names a run ``name[:key=value,...]`` and builds
    ``Compression.<name>(density=d, key=value, ...)``: a bare name set nothing else."""
    for n in GRID:
        assert recorded("micro", n)["method"] == "micro"
        assert ":" not in recorded("micro", n)["method"]
        assert recorded("dense", n)["method"] == "dense"


@pytest.mark.parametrize("label, method", [("dense allreduce", "dense"),
                                           ("MiCRO (defaults)", "micro")])
def test_readme_results_table(label, method):
    cells = row(table((ROOT / "README.md").read_text(), "| method | n = 2 |"), label)
    assert [number(c) for c in cells[:4]] == [percent(recorded(method, n)) for n in GRID]
    assert number(cells[4]) == kilobytes(recorded(method, 8))


def test_docs_accuracy_table():
    text = table((ROOT / "docs" / "benchmarks.md").read_text(), "| n (recipe) | dense |")
    for n in GRID:
        cells = row(text, str(n))
        assert number(cells[0]) == percent(recorded("dense", n)), n
        assert number(cells[1]) == percent(recorded("micro", n)), n


@pytest.mark.parametrize("label, method", [("dense", "dense"),
                                           ("**micro (default; slots)**", "micro")])
def test_benchmarks_scaling_table(label, method):
    text = table((ROOT / "BENCHMARKS.md").read_text(),
                 "| final test accuracy (bytes per rank per step) |")
    cells = row(text, label)
    for n, cell in zip(GRID, cells):
        accuracy, size = re.findall(r"[\d,]+(?:\.\d+)?", cell)[:2]
        assert (accuracy, size) == (percent(recorded(method, n)), kilobytes(recorded(method, n)))


def test_readme_headline_is_the_defaults_real_rank_run():
    """The README's first figures: 8 real ranks, MiCRO's defaults (``micro``, nothing else
    set) and dense (``none``) in one run, 2 seeds; the bytes are the busiest rank's."""
    runs = json.loads((ROOT / "bench" / "results" / "scaling-defaults.json").read_text())[
        "real_ranks_n8"]
    by = {(r["method"], r["seed"]): r for r in runs if r["ranks"] == 8 and r["epochs"] == 3}
    text = " ".join((ROOT / "README.md").read_text().split())
    micro = [f"{100 * by[('micro', s)]['final_accuracy']:.2f} %" for s in (1, 2)]
    dense = [f"{100 * by[('none', s)]['final_accuracy']:.2f} %" for s in (1, 2)]
    assert f"**{micro[0]} and {micro[1]}** test accuracy with MiCRO's defaults" in text
    assert f"against {dense[0]} and {dense[1]} with Horovod's dense allreduce" in text
    assert f"**{by[('micro', 1)]['bytes_per_iteration'] / 1000:.0f} KB per step" in text
    cells = row(table((ROOT / "BENCHMARKS.md").read_text(), "| method | 8 ranks"),
                "**micro (defaults)**, with dense " + ", ".join(dense) + " in the same run")
    assert cells[0] == f"**{micro[0]}, {micro[1]}**"


def test_time_to_accuracy_n2_is_the_defaults_run():
    """The n = 2 time-to-accuracy cell: every row's runs recorded no method flag (their
    run.json), MiCRO's recorded configurations are those of ``Compression.micro`` with only
    the density given, and the figures in BENCHMARKS.md, the docs and the which-method
    tables are that run's."""
    import horovod_micro as hvm

    cell = json.loads((ROOT / "bench" / "results" / "scaling-defaults.json").read_text())[
        "time_to_accuracy_n2_1gbit"]["rows"]
    micro, dense, topk = cell["micro d=0.001"], cell["none"], cell["topk d=0.001"]
    unset = {"controller": None, "judge": None, "capacity": None, "momentum_masking": None,
             "powersgd_rank": None, "compressor_options": []}
    for method in (micro, dense, topk):
        assert method["settings"] == unset
        assert method["optimizer"]["fused_sgd"] and method["world_size"] == 2
    recorded = [c for c in micro["compression_configs"] if isinstance(c, dict)]
    assert recorded and all(c == hvm.Compression.micro(density=0.001).config()
                            for c in recorded)
    assert micro["seeds"] == dense["seeds"] == [1, 2]

    def spread(method, target):
        s = method["time_to"][target]
        return f"{s['mean']:.0f} ({s['min']:.0f}-{s['max']:.0f})"

    def ratio(method, target):
        return f"{dense['time_to'][target]['mean'] / method['time_to'][target]['mean']:.2f}x"

    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    text = table(benchmarks, "| | MiCRO d = 0.001 (seeds 1, 2) |")
    for target, label in (("0.8", "time to 80 %, s (dense / method)"),
                          ("0.85", "time to 85 %, s (dense / method)")):
        cells = row(text, label)
        assert cells[0] == f"{spread(micro, target)} (**{ratio(micro, target)}**)"
        assert cells[1] == f"{spread(dense, target)} (1.00x)"
        assert cells[2] == f"{topk['time_to'][target]['mean']:.0f} ({ratio(topk, target)})"
    over_topk = topk["time_to"]["0.85"]["mean"] / micro["time_to"]["0.85"]["mean"]
    claim = (f"85 % test accuracy {ratio(micro, '0.85')} sooner than dense, "
             f"{over_topk:.2f}x sooner than Top-k")
    assert claim in benchmarks
    choosing = (ROOT / "docs" / "choosing.md").read_text()
    assert (f"85 % test accuracy {ratio(micro, '0.85')} sooner than dense and "
            f"{over_topk:.2f}x sooner than Top-k") in choosing
    docs = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert (f"MiCRO reached 85 % test accuracy {ratio(micro, '0.85')} sooner than dense** "
            f"({micro['time_to']['0.85']['mean']:.0f} s vs "
            f"{dense['time_to']['0.85']['mean']:.0f} s") in docs
