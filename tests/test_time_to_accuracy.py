"""``bench/time_to_accuracy.py`` end to end on a real emulated cluster (4 hosts, 1 Gbit/s).

Dense and MiCRO each train a few iterations of a small MLP on Fashion-MNIST-shaped files
written here, one rank per host through ``horovodrun -H`` (the benchmark's own launch
path). Checked against what the test derives itself:

* ``--eval-every``: evaluations after the expected iterations (mid-epoch and at each
  epoch's end), at increasing training times that leave the evaluations out;
* dense bytes per rank per iteration equal a ring allreduce of the model's fp32 bytes,
  ``2 (n-1)/n * 4 * numel``, with numel counted here; MiCRO sends a small fraction of it;
* time to target: reached at the first evaluation for target 0, never for a target above
  100 %;
* the report, the results and the figures are written, and the cluster leaves no
  namespace or state behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from simulation_powersgd import compressed
from test_fashion_mnist import write_dataset

import horovod_micro as hvm
from horovod_micro_train.models import build_model
from horovod_micro_train.records import method_label
from hvm_testbed.cluster import clusters
from hvm_testbed.launch import run_bounded

REPO = Path(__file__).resolve().parent.parent
HOSTS = 4
BATCH = 8
TRAIN_SAMPLES = 96  # 3 iterations per epoch on 4 ranks of batch 8
EVAL_EVERY = 2


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    base = tmp_path_factory.mktemp("tta")
    write_dataset(base / "data", train=TRAIN_SAMPLES, test=40)
    out = base / "out"
    cmd = [sys.executable, "-m", "bench.time_to_accuracy", "--cells", "headline",
           "--methods", "none", "micro", "powersgd:rank=2", "--densities", "0.01",
           "--seeds", "1",
           "--model", "fmnist_mlp", "--epochs", "2", "--batch-size", str(BATCH),
           "--eval-every", str(EVAL_EVERY), "--data-dir", str(base / "data"),
           "--targets", "0", "1.01", "--run-timeout", "300", "--out", str(out)]
    before = set(clusters())
    output = run_bounded(cmd, 900, cwd=REPO).stdout
    return out, output, before


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("run", ["none-s1", "micro-d0.01-s1"])
def test_evaluations_come_every_n_iterations_and_leave_their_time_out(bench, run):
    out, _, _ = bench
    folder = out / f"n{HOSTS}-1gbit" / run
    evals = read(folder / "evals.jsonl")
    epochs = read(folder / "epochs.jsonl")
    # 3 iterations per epoch: mid-epoch at 2 and 4, epoch ends at 3 and 6.
    assert [e["iteration"] for e in evals] == [2, 3, 4, 6]
    times = [e["train_time"] for e in evals]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert times[1] == pytest.approx(epochs[0]["train_time"])
    assert times[3] == pytest.approx(epochs[1]["train_time"])
    assert [evals[1]["test_accuracy"], evals[3]["test_accuracy"]] == [
        e["test_accuracy"] for e in epochs]
    # The training time of epoch 2 left out its mid-epoch evaluation: it is at most the
    # run's wall time minus every evaluation.
    elapsed = epochs[-1]["elapsed"]
    assert times[-1] <= elapsed - sum(e["eval_time"] for e in evals)


def test_report_states_bytes_targets_and_figures(bench):
    out, output, _ = bench
    results = json.loads((out / "results.json").read_text())
    cell = results[f"n{HOSTS}-1gbit"]
    assert set(cell) == {"none", "micro d=0.01", "powersgd rank=2"}
    model = build_model("fmnist_mlp", 10)
    numel = sum(p.numel() for p in model.parameters())
    ring = 2 * (HOSTS - 1) / HOSTS * 4 * numel
    assert cell["none"]["bytes_sent"] == pytest.approx(ring, rel=1e-6)
    assert 0 < cell["micro d=0.01"]["bytes_sent"] < ring / 10
    # PowerSGD at rank 2 (its flag reached the run): r (m + c) numbers per compressed weight
    # matrix (the hidden layer's; by the default rule the classifier's goes whole, as the
    # biases do), in two ring allreduces, plus the 12-byte status header per rank.
    numbers = sum(2 * (p.shape[0] + p.shape[1]) if compressed(tuple(p.shape), 2)
                  else p.numel() for p in model.parameters())
    assert numbers < numel / 10
    header = 12 * (HOSTS - 1)
    low_rank = 2 * (HOSTS - 1) / HOSTS * 4 * numbers + header
    assert cell["powersgd rank=2"]["bytes_sent"] == pytest.approx(low_rank, rel=1e-3)
    for row in cell.values():
        first = read(Path(row["dirs"][0]) / "evals.jsonl")[0]["train_time"]
        assert row["time_to"]["0"]["mean"] == pytest.approx(first)
        assert row["seed_times"]["1"]["0"] == pytest.approx(first)  # seed by seed as well
        assert row["seed_times"]["1"]["1.01"] is None
        assert row["time_to"]["1.01"]["mean"] is None
        assert row["seeds"] == [1]
        assert row["equal_epochs"] == 2
    assert cell["micro d=0.01"]["mean_density_ratio"] == pytest.approx(1.0, abs=0.5)
    # Each row records its method's settings from the runs' run.json: MiCRO ran with every
    # flag of its own unset (the shipped defaults), PowerSGD with its rank.
    assert cell["micro d=0.01"]["settings"] == {
        "controller": None, "judge": None, "capacity": None, "momentum_masking": None,
        "powersgd_rank": None, "compressor_options": []}
    assert dict(cell["powersgd rank=2"]["settings"]["compressor_options"]) == {"rank": 2}
    assert cell["none"]["optimizer"]["epochs"] == 2
    # run.json also holds the compressor's whole configuration as the optimizer held it:
    # for MiCRO, that of Compression.micro with only the density given.
    micro = json.loads((Path(cell["micro d=0.01"]["dirs"][0]) / "run.json").read_text())
    assert micro["compression_config"] == hvm.Compression.micro(density=0.01).config()
    assert cell["micro d=0.01"]["compression_configs"] == [micro["compression_config"]]
    assert cell["none"]["compression_configs"] == [None]
    dense = json.loads((Path(cell["none"]["dirs"][0]) / "run.json").read_text())
    assert dense["compression_config"] is None
    report = (out / "report.md").read_text()
    assert "| none | 1 |" in report and "| micro d=0.01 | 1 |" in report
    assert "not reached" in report
    figures = out / "figures" / f"n{HOSTS}-1gbit"
    for name in ("accuracy_vs_time.png", "time_breakdown.png"):
        assert (figures / name).stat().st_size > 1000
    assert "report:" in output


def test_the_cluster_is_gone(bench):
    """Nothing of the benchmark's cluster is left (other clusters may be up meanwhile)."""
    before = bench[2]
    assert set(clusters()) <= before
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in netns.splitlines() if line.strip()}
    assert {n for n in names if n.startswith("hvmc-")} <= {
        n for n in names if any(n.startswith(f"hvmc-{cid}-") for cid in before)}


def test_a_label_names_every_setting_that_is_not_a_default():
    """A run with a method flag set is never labelled (and so grouped or reported) as that
    method's defaults."""
    base = {"compressor": "micro", "density": 0.001}
    assert method_label(base) == "micro d=0.001"
    assert method_label({**base, "judge": "magnitude", "capacity": "exact"}) == (
        "micro d=0.001 judge=magnitude capacity=exact")
    assert method_label({**base, "momentum_masking": False}) == (
        "micro d=0.001 momentum_masking=False")
    assert method_label({"compressor": "powersgd", "density": 0.001,
                         "powersgd_rank": 2}) == "powersgd rank=2"


def test_a_time_reached_on_some_seeds_says_on_how_many():
    """The report's mean and range cover only the seeds that reached the target, and say so
    (a range of one seed would read as agreement between seeds)."""
    from bench.time_to_accuracy import _fmt_spread
    one = {"mean": 319.2, "min": 319.2, "max": 319.2, "reached": 1, "runs": 2}
    two = {"mean": 300.0, "min": 280.0, "max": 320.0, "reached": 2, "runs": 3}
    every = {"mean": 143.4, "min": 122.0, "max": 164.0, "reached": 2, "runs": 2}
    none = {"mean": None, "min": None, "max": None, "reached": 0, "runs": 2}
    assert _fmt_spread(one) == "319 (1 of 2 seeds)"
    assert _fmt_spread(two) == "300 (280-320, 2 of 3 seeds)"
    assert _fmt_spread(every) == "143 (122-164)"
    assert _fmt_spread({**every, "runs": 1, "reached": 1}) == "143"
    assert _fmt_spread(none) == "not reached"


def test_a_cell_with_a_small_bucket_is_its_own_cell_and_needs_hosts(tmp_path):
    """``--burst`` names the cell, so its runs never mix with the 1 MB bucket's, and a
    ``--burst`` that no cell would use is refused before anything runs."""
    from bench.time_to_accuracy import Cell, main
    assert Cell(4, "100mbit").name == "n4-100mbit"
    assert Cell(4, "100mbit", "64kb").name == "n4-100mbit-burst64kb"
    with pytest.raises(SystemExit) as refused:
        main(["--cells", "headline", "--burst", "64kb", "--out", str(tmp_path / "out")])
    assert refused.value.code == 2
    assert not (tmp_path / "out").exists()
