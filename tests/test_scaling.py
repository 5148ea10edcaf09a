"""bench/scaling.py: n workers in one process through the real reducers (loopback ranks),
checked against plain dense training and against its own records (scikit-learn's digits,
no Horovod job: the benchmark needs none)."""

import json

import torch

from bench.scaling import main, parse_method, train

RUN = dict(epochs=0.2, dataset="digits", model_name="digits_cnn", report=lambda line: None)


def test_at_density_one_a_sparse_method_is_dense_training():
    """k = N: every rank sends its whole part, residuals stay empty, and without momentum
    masking the weights equal dense training's (sums in another order: float tolerance)."""
    dense = train("dense", n=3, density=1.0, **RUN)
    for method in ("micro:momentum_masking=False", "micro:judge='magnitude'", "topk"):
        run = train(method, n=3, density=1.0, **RUN)
        torch.testing.assert_close(run["weights"], dense["weights"], rtol=1e-4, atol=1e-6)
    sparse = train("micro", n=3, density=0.05, **RUN)
    assert not torch.allclose(sparse["weights"], dense["weights"], rtol=1e-3, atol=1e-4)


def test_records_bytes_and_diagnosis(tmp_path):
    out = tmp_path / "scaling.json"
    main(["--workers", "2", "4", "--epochs", "0.3", "--dataset", "digits", "--model",
          "digits_cnn", "--density", "0.05", "--methods", "dense", "micro", "--quiet",
          "--json", str(out), "--figures", str(tmp_path / "figures")])
    runs = json.loads(out.read_text())["runs"]
    assert {(r["method"], r["n"]) for r in runs} == {(m, n) for m in ("dense", "micro")
                                                     for n in (2, 4)}
    for r in runs:
        assert 0.0 < r["final_accuracy"] <= 1.0
        assert r["iterations"] == max(1, round(0.3 * (1437 // (32 * r["n"]))))
    dense = {r["n"]: r for r in runs if r["method"] == "dense"}
    micro = {r["n"]: r for r in runs if r["method"] == "micro"}
    for n in (2, 4):
        # MiCRO's bytes per rank are O(k), far below a dense ring allreduce of N.
        assert micro[n]["bytes_per_step"] < dense[n]["bytes_per_step"] / 5
        rows = micro[n]["diagnosis"]
        assert rows and all(0.0 <= row["in_summed_topk"] <= 1.0 for row in rows)
        assert all(row["mean_wait"] >= 1.0 for row in rows)
    for name in ("scaling-accuracy.png", "scaling-bytes.png"):
        assert (tmp_path / "figures" / name).read_bytes()[:4] == b"\x89PNG"
    # A second call with the same --json reuses the finished runs instead of training.
    before = out.read_text()
    main(["--workers", "2", "--epochs", "0.3", "--dataset", "digits", "--model",
          "digits_cnn", "--density", "0.05", "--methods", "micro", "--quiet",
          "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(before)


def test_method_arguments():
    assert parse_method("micro") == ("micro", {})
    assert parse_method("micro:judge='magnitude',momentum_masking=False") == (
        "micro", {"judge": "magnitude", "momentum_masking": False})
