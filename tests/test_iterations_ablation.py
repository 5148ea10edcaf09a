"""bench/iterations_ablation.py: its simulated workers against plain dense training, on
scikit-learn's digits (one process, no Horovod: the script itself has none)."""

import json

import torch

from bench.iterations_ablation import Workers, main, train

RUN = dict(n=2, iters=6, eval_every=3, dataset="digits", model_name="digits_cnn",
           report=lambda line: None)


def test_at_density_one_every_sparse_rule_is_dense_training():
    """k = N: every worker's part is selected whole, the residuals stay empty, and the
    weights after 6 steps equal dense training's bit for bit."""
    dense = train("dense", density=1.0, **RUN)
    for method in ("micro", "micro-summed", "global-topk"):
        run = train(method, density=1.0, **RUN)
        torch.testing.assert_close(run["weights"], dense["weights"], rtol=0, atol=0)
        assert run["curve"] == dense["curve"]
    sparse = train("micro", density=0.01, **RUN)
    assert not torch.equal(sparse["weights"], dense["weights"])


def test_micro_parts_are_disjoint_and_rotate():
    """Each worker picks its quota in the part it owns this iteration, so the merged
    gradient's support has exactly k entries, one block per part, and a worker's pick
    moves to the next part at the next iteration."""
    workers = Workers("micro", n=3, numel=30, density=0.3)  # k = 9, 3 per part of 10
    grads = [torch.arange(30.0) + 100 * w for w in range(3)]
    merged = workers.merge(grads, iteration=0)
    support = merged.nonzero().flatten().tolist()
    # Each part's 3 largest entries (the ramp's tail): 7-9, 17-19, 27-29.
    assert support == [7, 8, 9, 17, 18, 19, 27, 28, 29]
    expected = sum(grads)[support] / 3
    torch.testing.assert_close(merged[support], expected)
    for w in range(3):  # the residual keeps everything but the support
        assert workers.residual[w][support].abs().sum() == 0
        assert workers.residual[w].count_nonzero() == 30 - 9 - (w == 0)

    # Worker w's largest entry lies in part w + 1: it is picked when w owns that part,
    # which is at iteration 1, not 0.
    spikes = [torch.arange(30.0) / 100 for _ in range(3)]
    for w, spot in enumerate((10, 20, 0)):
        spikes[w][spot] = 50.0
    for iteration, picked in ((0, False), (1, True)):
        merged = Workers("micro", n=3, numel=30, density=0.3).merge(spikes, iteration)
        assert all(bool(merged[spot] != 0) == picked for spot in (0, 10, 20))


def test_writes_a_table_and_json(tmp_path):
    out, md = tmp_path / "ablation.json", tmp_path / "ablation.md"
    main(["--methods", "dense", "micro", "--workers", "2", "--density", "0.05",
          "--iters", "4", "--eval-every", "2", "--dataset", "digits", "--model",
          "digits_cnn", "--targets", "0.0", "1.01", "--json", str(out), "--markdown", str(md)])
    runs = json.loads(out.read_text())["runs"]
    assert [r["method"] for r in runs] == ["dense", "micro"]
    assert all([it for it, _ in r["curve"]] == [2, 4] for r in runs)
    text = md.read_text()
    assert "| dense | 2 (1.00x dense) | not reached |" in text
