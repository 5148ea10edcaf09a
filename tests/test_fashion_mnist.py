"""Fashion-MNIST through torchvision's FashionMNIST (horovod_micro_train/fashion_mnist.py,
horovod_micro_train/data.py).

The tests write small idx files of their own (gzip-compressed, the format Debian's
dataset-fashion-mnist installs) and compare what the loader returns with what they wrote;
one test reads the installed package itself (tools/setup.sh installs it).
"""

import gzip
import os
import sys

import pytest
import torch

from horovod_micro_train import fashion_mnist
from horovod_micro_train.cli import DataNotFoundError, TrainError, parse_args
from horovod_micro_train.data import build_datasets
from horovod_micro_train.fashion_mnist import FILES, DamagedDataError
from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def idx_bytes(tensor: torch.Tensor) -> bytes:
    """``tensor`` (uint8) in the idx format: magic 0x0000_08_<ndim>, big-endian sizes."""
    header = bytes([0, 0, 8, tensor.dim()])
    header += b"".join(int(d).to_bytes(4, "big") for d in tensor.shape)
    return header + tensor.contiguous().numpy().tobytes()


def write_split(folder, split, images, labels):
    folder.mkdir(parents=True, exist_ok=True)
    image_name, label_name = FILES[split]
    (folder / image_name).write_bytes(gzip.compress(idx_bytes(images)))
    (folder / label_name).write_bytes(gzip.compress(idx_bytes(labels)))


def write_dataset(folder, seed=0, train=12, test=5):
    """Random Fashion-MNIST-shaped files; returns what was written, by split."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for split, n in (("train", train), ("test", test)):
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=gen)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=gen)
        write_split(folder, split, images, labels)
        written[split] = (images, labels)
    return written


def expected_tensors(written):
    """The loader's contract, computed here: pixels / 255, standardised with the training
    images' mean and std, one channel; int64 labels."""
    train = written["train"][0].double() / 255.0
    mean, std = train.mean(), train.std()
    return {split: ((x.double() / 255.0 - mean) / std, y.long())
            for split, (x, y) in written.items()}


def test_written_files_are_read_through_torchvision(tmp_path):
    written = write_dataset(tmp_path / "src")
    data = build_datasets("fashion-mnist", data_dir=tmp_path / "src",
                          cache_dir=tmp_path / "cache")
    expected = expected_tensors(written)
    for dataset, split in ((data.train, "train"), (data.test, "test")):
        x, y = dataset.tensors
        assert x.shape == (len(written[split][1]), 1, 28, 28) and x.dtype == torch.float32
        assert torch.allclose(x.squeeze(1).double(), expected[split][0], atol=1e-5)
        assert torch.equal(y, expected[split][1])
    assert (data.num_classes, data.in_channels, data.image_size) == (10, 1, 28)
    # torchvision's own layout under the cache: FashionMNIST/raw/<name without .gz>.
    (root,) = (tmp_path / "cache" / "fashion-mnist").iterdir()
    for split, (images, labels) in FILES.items():
        raw = root / "FashionMNIST" / "raw"
        assert (raw / images.removesuffix(".gz")).read_bytes() == idx_bytes(written[split][0])
        assert (raw / labels.removesuffix(".gz")).read_bytes() == idx_bytes(written[split][1])


def test_cache_is_reused_while_the_source_is_unchanged_and_rebuilt_when_it_changes(tmp_path):
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_dataset(src, seed=0)
    first = fashion_mnist.prepare_root(src, cache)
    stamp = (first / fashion_mnist.RAW / "train-images-idx3-ubyte").stat().st_mtime_ns
    assert fashion_mnist.prepare_root(src, cache) == first
    assert (first / fashion_mnist.RAW / "train-images-idx3-ubyte").stat().st_mtime_ns == stamp
    written = write_dataset(src, seed=1, train=7)
    for path in src.iterdir():  # a new modification time even on a coarse clock
        os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    data = build_datasets("fashion-mnist", data_dir=src, cache_dir=cache)
    assert len(data.train) == 7
    assert torch.equal(data.train.tensors[1], written["train"][1].long())
    assert len(list((cache / "fashion-mnist").iterdir())) == 2  # no half-built copies left
    # A copy damaged by hand is replaced, not trusted.
    (root,) = [p for p in (cache / "fashion-mnist").iterdir() if p != first]
    (root / fashion_mnist.RAW / "t10k-labels-idx1-ubyte").unlink()
    assert fashion_mnist.prepare_root(src, cache) == root
    assert (root / fashion_mnist.RAW / "t10k-labels-idx1-ubyte").read_bytes() == idx_bytes(
        written["test"][1])


def test_absent_files_name_the_debian_package(tmp_path):
    write_dataset(tmp_path / "src")
    (tmp_path / "src" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataNotFoundError, match="dataset-fashion-mnist") as error:
        build_datasets("fashion-mnist", data_dir=tmp_path / "src", cache_dir=tmp_path / "c")
    assert "t10k-labels-idx1-ubyte.gz" in str(error.value)
    assert not (tmp_path / "c").exists()


def test_a_truncated_file_is_named(tmp_path):
    src = tmp_path / "src"
    write_dataset(src, train=40)
    path = src / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DamagedDataError, match="train-images-idx3-ubyte.gz.*truncated"):
        build_datasets("fashion-mnist", data_dir=src, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "fashion-mnist").iterdir()] == []


def test_fewer_bytes_than_the_header_says_is_refused(tmp_path):
    src = tmp_path / "src"
    write_dataset(src)
    images = torch.zeros(4, 28, 28, dtype=torch.uint8)
    short = idx_bytes(images)[:-100]  # complete gzip stream, idx payload cut short
    (src / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(short))
    with pytest.raises(DamagedDataError, match="t10k-images-idx3-ubyte.gz"):
        build_datasets("fashion-mnist", data_dir=src, cache_dir=tmp_path / "cache")


def test_labels_and_images_that_disagree_are_refused(tmp_path):
    src = tmp_path / "src"
    write_dataset(src)
    write_split(src, "test", torch.zeros(5, 28, 28, dtype=torch.uint8),
                torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(DamagedDataError, match="5 images of shape .28, 28., 4 labels"):
        build_datasets("fashion-mnist", data_dir=src, cache_dir=tmp_path / "cache")


def test_debian_package_is_the_default_and_is_read_in_full(tmp_path):
    assert parse_args([]).dataset == "fashion-mnist" and parse_args([]).data_dir is None
    data = build_datasets("fashion-mnist", cache_dir=tmp_path / "cache")
    x, y = data.train.tensors
    assert x.shape == (60_000, 1, 28, 28) and data.test.tensors[0].shape[0] == 10_000
    assert torch.bincount(y).tolist() == [6000] * 10  # Fashion-MNIST is balanced
    assert torch.bincount(data.test.tensors[1]).tolist() == [1000] * 10
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1.0) < 1e-3


def test_the_command_reports_absent_data_on_two_ranks(tmp_path):
    """``python -m horovod_micro_train`` on 2 Gloo ranks: every rank stops before training, rank
    0 names the package in one error line, no rank prints a traceback, a non-zero exit."""
    argv = [sys.executable, "-m", "horovod_micro_train", "--data-dir", str(tmp_path), "--out",
            str(tmp_path / "run"), "--progress", "none"]
    proc = run_bounded(horovodrun_cmd(2, "gloo", argv), 300, cwd=REPO, check=False,
                       env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode != 0
    (line,) = [x for x in proc.stdout.splitlines() if "python -m horovod_micro_train: error:" in x]
    assert "dataset-fashion-mnist" in line and "t10k-images-idx3-ubyte.gz" in line
    rank_lines = [x for x in proc.stdout.splitlines() if x.startswith(("[0]", "[1]"))]
    assert not any("Traceback" in x for x in rank_lines)  # horovodrun's own may follow
    assert not (tmp_path / "run" / "epochs.jsonl").exists()


def test_an_unwritable_cache_is_reported(tmp_path):
    write_dataset(tmp_path / "src")
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(TrainError, match="XDG_CACHE_HOME"):
        build_datasets("fashion-mnist", data_dir=tmp_path / "src",
                       cache_dir=tmp_path / "not-a-dir" / "cache")
