"""The CIFAR path of ``train`` on small CIFAR-format files written by the test.

The files have the real archive's layout and pickle format; torchvision's own CIFAR10/100
classes load them, verifying their md5 against the checksums the test lists through
torchvision's class attributes (see tests/ranks_train.py). Real data keeps the real
checksums: the last tests show a file that is not the official one is refused, and missing
data is reported with the expected layout.
"""

import hashlib
import pickle

import numpy as np
import pytest
from multirank import run_ranks

from horovod_micro_train.data import build_datasets

PER_FILE = 6  # images per CIFAR-10 batch file


def _write(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def write_cifar(root, seed=0):
    """Tiny CIFAR-10 and CIFAR-100 trees in the official layout; returns file -> md5."""
    rng = np.random.default_rng(seed)

    def images(n):
        return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)

    c10 = root / "cifar-10-batches-py"
    c10.mkdir(parents=True)
    for i in range(1, 6):
        _write(c10 / f"data_batch_{i}", {"data": images(PER_FILE),
                                         "labels": rng.integers(0, 10, PER_FILE).tolist()})
    _write(c10 / "test_batch", {"data": images(5), "labels": rng.integers(0, 10, 5).tolist()})
    _write(c10 / "batches.meta", {"label_names": [f"class{i}" for i in range(10)]})
    c100 = root / "cifar-100-python"
    c100.mkdir()
    for name, n in (("train", 16), ("test", 5)):
        _write(c100 / name, {"data": images(n), "fine_labels": rng.integers(0, 100, n).tolist(),
                             "coarse_labels": rng.integers(0, 20, n).tolist()})
    _write(c100 / "meta", {"fine_label_names": [f"fine{i}" for i in range(100)]})
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest()
            for d in (c10, c100) for p in d.iterdir()}


RUNS = [["cifar10", "resnet18"], ["cifar10", "googlenet"], ["cifar10", "senet18"],
        ["cifar100", "resnet18"]]
#: (train samples, test samples, classes) of the files written by write_cifar.
SIZES = {"cifar10": (5 * PER_FILE, 5, 10), "cifar100": (16, 5, 100)}


def test_each_model_one_step_on_two_ranks(tmp_path):
    """All three CIFAR models on CIFAR-10 (and ResNet-18 on CIFAR-100), one job."""
    md5 = write_cifar(tmp_path)
    results = run_ranks("ranks_train:one_step", np=2, backend="gloo",
                        kwargs={"root": str(tmp_path), "md5": md5, "runs": RUNS})
    for rank_result in results:
        assert [[r["dataset"], r["model"]] for r in rank_result.value] == RUNS
        for r in rank_result.value:
            classes = SIZES[r["dataset"]][2]
            assert (r["train_len"], r["test_len"], r["classes"]) == SIZES[r["dataset"]]
            assert r["batch"] == [4, 3, 32, 32] and r["labels"] == [4]
            assert r["logits"] == [4, classes]
            assert r["size"] == 2 and r["rows"] == 1 and r["method"] == "micro"
            assert r["global_count"] > 0 and r["numel"] == r["weights"]  # every gradient
            assert r["changed"] > 0  # the step moved the weights
    # Both ranks applied the same aggregated update.
    for a, b in zip(results[0].value, results[1].value):
        assert a["checksum"] == b["checksum"]


def test_files_that_are_not_the_official_archive_are_refused(tmp_path):
    write_cifar(tmp_path)
    with pytest.raises(RuntimeError, match="md5 check"):
        build_datasets("cifar10", tmp_path)


def test_missing_data_names_the_expected_layout(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-100-python.*--download") as info:
        build_datasets("cifar100", tmp_path / "nowhere")
    assert "train, test, meta" in str(info.value)
