"""The python-text dataset (horovod_micro_train/data.py): byte sequences of the running
interpreter's standard library, split by file, for the scaling benchmark's language model."""

import sysconfig
from pathlib import Path

import pytest
import torch

from horovod_micro_train.data import (
    TEXT_CONTEXT,
    TEXT_TEST_SEQUENCES,
    TEXT_TRAIN_SEQUENCES,
    build_datasets,
    python_text_datasets,
    python_text_files,
)


@pytest.fixture(scope="module")
def files():
    return python_text_files()


def test_every_tenth_file_is_held_out_and_the_splits_are_disjoint(files):
    train, test = files
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(train) > 300 and len(test) > 30
    assert not set(train) & set(test)
    merged = sorted(train + test, key=lambda f: f.relative_to(root).as_posix())
    assert test == merged[::10]
    for f in merged:
        parts = f.relative_to(root).parts
        assert f.suffix == ".py" and not {"test", "idlelib", "site-packages"} & set(parts)


def test_sequences_are_deterministic_shifted_windows_of_their_split(files):
    first = build_datasets("python-text", seed=3)
    again = build_datasets("python-text", seed=3)
    other = build_datasets("python-text", seed=4)
    assert (first.num_classes, first.image_size) == (256, TEXT_CONTEXT)
    for a, b in zip(first.train.tensors + first.test.tensors,
                    again.train.tensors + again.test.tensors):
        assert torch.equal(a, b)
    # The seed draws the training sequences; the validation set stays fixed.
    assert not torch.equal(first.train.tensors[0], other.train.tensors[0])
    assert torch.equal(first.test.tensors[0], other.test.tensors[0])

    train_bytes, test_bytes = (b"".join(f.read_bytes() for f in split) for split in files)
    for data, size, source in ((first.train, TEXT_TRAIN_SEQUENCES, train_bytes),
                               (first.test, TEXT_TEST_SEQUENCES, test_bytes)):
        x, y = data.tensors
        assert x.shape == y.shape == (size, TEXT_CONTEXT) and x.dtype == torch.long
        assert 0 <= int(x.min()) and int(x.max()) < 256
        assert torch.equal(x[:, 1:], y[:, :-1])  # the target is the input shifted by one
        # No sequence is drawn twice; each is a window of its own split's bytes.
        assert len({tuple(row) for row in x[:500].tolist()}) == 500
        for i in (0, 1, size - 1):
            assert bytes(x[i].tolist() + y[i, -1:].tolist()) in source


def test_small_tree_and_sizes(tmp_path):
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_bytes(bytes([i]) * 200)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_bytes(b"x" * 200)
    train, test = python_text_files(tmp_path)
    assert [f.name for f in test] == ["m00.py", "m10.py"] and len(train) == 18
    data = python_text_datasets(seed=0, root=tmp_path, train_size=40, test_size=5, context=9)
    x, y = data.train.tensors
    assert x.shape == (40, 9) and not {0, 10} & set(x.unique().tolist())
    assert set(data.test.tensors[0].unique().tolist()) <= {0, 10}
    with pytest.raises(ValueError, match="available"):
        python_text_datasets(root=tmp_path, train_size=10_000, test_size=5, context=9)
