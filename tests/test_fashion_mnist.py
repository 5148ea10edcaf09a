"""Fashion-MNIST from idx files (train/data.py): Debian's package, or --data-dir."""

import gzip

import pytest
import torch

from train.cli import TrainError, parse_args
from train.data import FASHION_MNIST_DIR, build_datasets, read_idx


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(),
                    reason="dataset-fashion-mnist not installed (tools/setup.sh installs it)")
def test_debian_package_is_read_and_normalised():
    data = build_datasets("fashion-mnist", data_dir="/nonexistent")
    x, y = data.train.tensors
    assert x.shape == (60_000, 1, 28, 28) and len(data.test) == 10_000
    assert sorted(y.unique().tolist()) == list(range(10))
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1.0) < 1e-3
    assert parse_args(["--dataset", "fashion-mnist"]).model == "fmnist_mlp"


def test_idx_files_round_trip_and_bad_headers_are_refused(tmp_path):
    images = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    header = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in images.shape)
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + images.numpy().tobytes()))
    assert torch.equal(read_idx(path), images)
    path.write_bytes(gzip.compress(bytes([0, 0, 13, 1, 0, 0, 0, 1, 0])))
    with pytest.raises(TrainError, match="idx"):
        read_idx(path)
