"""bench/compute_cost.py: the parameter counts it reports, and its JSON (one process)."""

import json

from bench.compute_cost import main


def mlp_parameters(widths):
    """Weights and biases of a chain of linear layers, counted by hand."""
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def test_reports_parameters_and_positive_times(tmp_path):
    out = tmp_path / "cost.json"
    assert main(["--models", "fmnist_mlp", "wide_mlp", "--steps", "2", "--warmup", "0",
                 "--json", str(out)]) == 0
    rows = {r["model"]: r for r in json.loads(out.read_text())}
    assert rows["fmnist_mlp"]["parameters"] == mlp_parameters([784, 256, 10]) == 203_530
    assert rows["wide_mlp"]["parameters"] == mlp_parameters([784, 4096, 2048, 512, 10])
    assert rows["wide_mlp"]["parameters"] == 12_660_234
    for row in rows.values():
        assert row["threads"] == 1 and row["batch_size"] == 32 and row["steps"] == 2
        assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["median_cpu_ms"] > 0
        assert row["dense_fp32_mb"] == 4 * row["parameters"] / 1e6


def test_sgd_step_times_every_implementation(tmp_path):
    out = tmp_path / "sgd.json"
    assert main(["--models", "fmnist_mlp", "--sgd-step", "--steps", "2",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["model"] == "fmnist_mlp"
    assert set(row["sgd_step_ms"]) == {"loop", "foreach", "fused"}
    assert all(ms > 0 for ms in row["sgd_step_ms"].values())
