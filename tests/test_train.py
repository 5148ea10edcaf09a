"""``python -m horovod_micro_train`` end to end on 2 real Gloo ranks (the embedded digits run).

Stated accuracy: the digits recipe shortened to 4 epochs (lr decay at epoch 3) reaches at
least 90 % test accuracy with MiCRO at density 0.01, and dense training with the same recipe
reaches it too. Resuming from the epoch checkpoints ends with exactly the parameters, residuals
and threshold state of the uninterrupted run.
"""

import json
import os
import sys

import pytest
import torch
from multirank import run_script

from horovod_micro_train.plot import Run, group, make_figures
from horovod_micro_train.records import MAX_FIELDS, MEAN_FIELDS

RECIPE = ["--dataset", "digits", "--epochs", "4", "--lr-decay-epochs", "3", "--progress",
          "lines"]
ACCURACY = 0.90


def train(out, *flags, env=None):
    return run_script([sys.executable, "-m", "horovod_micro_train",
                       "--out", str(out), *RECIPE, *flags], env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One MiCRO and one dense run of the shortened embedded recipe: MiCRO launched as a
    user would, with no OMP_NUM_THREADS (the entry point shares the cores among the ranks),
    dense with ``--threads 2`` over the harness's OMP_NUM_THREADS=1."""
    base = tmp_path_factory.mktemp("train")
    micro = base / "micro"
    dense = base / "dense"
    return {"micro": (micro, train(micro, "--compressor", "micro", "--tensorboard",
                                   env={"OMP_NUM_THREADS": None})),
            "dense": (dense, train(dense, "--compressor", "none", "--no-plots",
                                   "--threads", "2"))}


def test_each_rank_runs_its_share_of_the_cores(runs):
    """torch's default is a thread per core in every rank: 2 ranks on this host would put
    twice the cores' threads on them. Unset, each rank takes half the cores (at least 1);
    ``--threads`` sets it."""
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for name, want in (("micro", share), ("dense", 2)):
        out, _ = runs[name]
        ranks = [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("*.json"))]
        assert [r["torch_threads"] for r in ranks] == [want, want], name


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_micro_reaches_the_stated_accuracy_and_writes_everything(runs):
    out, log = runs["micro"]
    epochs = read(out / "epochs.jsonl")
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]
    assert epochs[-1]["test_accuracy"] >= ACCURACY
    iterations = read(out / "iterations.jsonl")
    assert len(iterations) == epochs[-1]["iterations"] == 4 * 23  # 1437 samples / 2 / 32
    for row in iterations:
        assert row["method"] == "micro" and row["target_density"] == 0.01
        assert row["threshold"] > 0 and row["residual_norm"] >= 0
        assert all(row[f] >= 0 for f in MAX_FIELDS + MEAN_FIELDS)
        assert row["total"] >= max(row["forward"], row["backward"])  # each: slowest rank
    mean_density = sum(r["density"] for r in iterations) / len(iterations)
    assert 0.002 < mean_density < 0.05
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["epoch"] == 4 and ckpt["world_size"] == 2 and len(ckpt["rank_states"]) == 2
    assert ckpt["rank_states"][0]["sparse"]["residual"].numel() == iterations[0]["numel"]
    for r, part in enumerate(ckpt["rank_states"]):  # each rank's own part, on the CPU
        assert (part["sparse"]["rank"], part["sparse"]["size"]) == (r, 2)
        assert part["sparse"]["residual"].device.type == "cpu"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] == epochs[-1]["test_accuracy"]
    assert summary["bytes_ratio"] < 0.2
    # What a dense fp32 ring allreduce would have sent on 2 ranks: 2 (n-1)/n * 4 N = 4 N.
    numel = iterations[0]["numel"]
    assert summary["dense_bytes_per_iteration"] == 4 * numel
    assert summary["dense_bytes_total"] == 4 * numel * len(iterations)
    assert summary["bytes_sent_total"] == sum(r["bytes_sent"] for r in iterations)
    assert "bytes in total  :" in log and "dense would have sent" in log
    # The one-screen summary and where the figures went, printed by rank 0 only.
    assert log.count("test accuracy   :") == 1 and "density         :" in log
    assert "time/iteration  :" in log and f"figures         : {out}/figures" in log
    for name in ("accuracy_vs_time", "density", "threshold_residual", "time_breakdown"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 1000


def test_tensorboard_events_hold_the_records(runs):
    """The event files read back by TensorBoard's own reader match the JSON records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = runs["micro"]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    epochs, iterations = read(out / "epochs.jsonl"), read(out / "iterations.jsonl")

    def scalars(tag):
        return {e.step: e.value for e in events.Scalars(tag)}

    assert scalars("epoch/test_accuracy") == pytest.approx(
        {e["epoch"]: e["test_accuracy"] for e in epochs})
    for key in ("density", "threshold", "bytes_sent"):
        assert scalars(f"iteration/{key}") == pytest.approx(
            {r["iteration"]: r[key] for r in iterations}, rel=1e-6), key
    assert scalars("epoch/bytes_sent") == pytest.approx(
        {e["epoch"]: sum(r["bytes_sent"] for r in iterations if r["epoch"] == e["epoch"])
         for e in epochs}, rel=1e-6)


def test_dense_with_the_same_recipe_reaches_it_too(runs):
    out, _ = runs["dense"]
    epochs = read(out / "epochs.jsonl")
    assert epochs[-1]["test_accuracy"] >= ACCURACY
    assert all(r["density"] == 1.0 for r in read(out / "iterations.jsonl"))


def test_plot_command_draws_several_runs(runs, tmp_path):
    micro, dense = runs["micro"][0], runs["dense"][0]
    # A method's runs (e.g. seeds) are one line: here micro twice, dense once.
    methods = group([Run(micro), Run(dense), Run(micro)])
    assert [(m.label, len(m.runs)) for m in methods] == [("micro d=0.01", 2), ("none", 1)]
    assert methods[0].color != methods[1].color
    paths = make_figures([micro, dense, micro], tmp_path, target=0.9)
    assert len(paths) == 4
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_resume_reproduces_the_uninterrupted_run(runs, tmp_path):
    straight, _ = runs["micro"]
    split = tmp_path / "split"
    train(split, "--epochs", "2", "--no-plots")
    log = train(split, "--resume", "--no-plots")  # to RECIPE's 4 epochs
    assert "epoch 1/4" not in log and "epoch 3/4" in log  # started at the third epoch
    a = torch.load(straight / "checkpoint.pt", weights_only=False)
    b = torch.load(split / "checkpoint.pt", weights_only=False)
    assert (a["epoch"], a["iteration"]) == (b["epoch"], b["iteration"]) == (4, 92)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for ra, rb in zip(a["rank_states"], b["rank_states"]):
        assert torch.equal(ra["sparse"]["residual"], rb["sparse"]["residual"])
        sa, sb = ra["sparse"]["compressor"], rb["sparse"]["compressor"]
        assert sa.keys() == sb.keys() == {"controller", "last"}  # the drift judge's ages
        assert sa["controller"] == sb["controller"]
        assert torch.equal(sa["last"], sb["last"])
        assert ra["sparse"]["iteration"] == rb["sparse"]["iteration"] == 92
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           b["optimizer"]["state"][key]["momentum_buffer"])
    # The resumed run's records continue the first part's without a gap or a repeat.
    assert [r["iteration"] for r in read(split / "iterations.jsonl")] == list(range(92))
    assert [e["epoch"] for e in read(split / "epochs.jsonl")] == [0, 1, 2, 3]


def test_a_diverging_run_still_records_its_epochs(tmp_path):
    """A learning rate far too large: the loss turns non-finite (a NaN mean over ranks is
    recorded as null), and the run still ends normally with its epoch records."""
    out = tmp_path / "diverged"
    output = train(out, "--compressor", "micro", "--lr", "1e6", "--epochs", "1",
                   "--max-iters-per-epoch", "20", "--no-plots")
    iterations = read(out / "iterations.jsonl")
    assert any(row["loss"] is None for row in iterations)
    (epoch,) = read(out / "epochs.jsonl")
    assert epoch["train_loss"] is None
    assert epoch["test_accuracy"] < 0.5
    assert "train loss not finite" in output
    assert json.loads((out / "summary.json").read_text())["iterations"] == 20


def test_fused_sgd_takes_the_same_steps(tmp_path):
    """``--fused-sgd`` swaps torch's SGD loop for its fused kernel, nothing else: a dense
    run ends with the loop's parameters (up to float rounding), and a MiCRO run steps
    through horovod_micro's wrapper with the fused kernel (the flag survives in the saved
    optimizer state)."""
    short = ["--epochs", "1", "--max-iters-per-epoch", "10", "--no-plots"]
    models = {}
    for label, flags in {"loop": [], "fused": ["--fused-sgd"]}.items():
        train(tmp_path / label, "--compressor", "none", *short, *flags)
        ckpt = torch.load(tmp_path / label / "checkpoint.pt", weights_only=False)
        assert ckpt["optimizer"]["param_groups"][0]["fused"] is (True if flags else None)
        momenta = [s["momentum_buffer"] for s in ckpt["optimizer"]["state"].values()]
        assert momenta and all(m.abs().sum() > 0 for m in momenta)  # the steps moved it
        models[label] = ckpt["model"]
    for key, value in models["loop"].items():
        assert torch.allclose(value, models["fused"][key], rtol=1e-4, atol=1e-6), key
    train(tmp_path / "micro", "--compressor", "micro", *short, "--fused-sgd")
    ckpt = torch.load(tmp_path / "micro" / "checkpoint.pt", weights_only=False)
    assert ckpt["optimizer"]["param_groups"][0]["fused"] is True
    iterations = read(tmp_path / "micro" / "iterations.jsonl")
    assert len(iterations) == 10 and all(r["loss"] is not None for r in iterations)
    assert all(r["method"] == "micro" and r["global_count"] > 0 for r in iterations)
