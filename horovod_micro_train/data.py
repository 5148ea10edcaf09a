"""Datasets and loaders: sklearn's digits (embedded default), Fashion-MNIST, CIFAR-10/100,
synthetic, and ``python-text`` (byte sequences of the standard library's sources, for the
scaling benchmark's language model).

CIFAR goes through torchvision's own ``CIFAR10``/``CIFAR100`` classes, which verify every
file's md5 against the real archive. Tests run the same classes on small CIFAR-format files
they write, through torchvision's documented class attributes (``train_list``,
``test_list``, ``meta``: file names with their md5): a test subclass lists its own files'
checksums and passes itself as ``cifar_classes`` to :func:`build_datasets`. Real data never
skips the check.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from . import fashion_mnist
from .cli import DataNotFoundError, TrainError

# Per-channel mean/std of the training images (the usual CIFAR normalisation constants).
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
CIFAR_LAYOUT = {
    "cifar10": ("cifar-10-batches-py",
                ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                 "data_batch_5", "test_batch", "batches.meta"]),
    "cifar100": ("cifar-100-python", ["train", "test", "meta"]),
}
#: python-text: tokens per sequence, training sequences (a subsample fixed by the seed),
#: validation sequences (fixed), and the folders of the standard library left out.
TEXT_CONTEXT = 64
TEXT_TRAIN_SEQUENCES = 32_768
TEXT_TEST_SEQUENCES = 2_000
TEXT_EXCLUDED = frozenset({"test", "tests", "idlelib", "site-packages"})


@dataclass
class Datasets:
    """Train and test sets plus what the model needs to know about them."""

    train: Dataset
    test: Dataset
    num_classes: int
    in_channels: int
    image_size: int


def _default_cifar_classes() -> dict[str, type]:
    from torchvision.datasets import CIFAR10, CIFAR100
    return {"cifar10": CIFAR10, "cifar100": CIFAR100}


def build_datasets(name: str, data_dir: str | os.PathLike | None = None,
                   download: bool = False, seed: int = 0, synthetic_size: int = 4096,
                   cifar_classes: dict[str, type] | None = None,
                   cache_dir: str | os.PathLike | None = None) -> Datasets:
    """The horovod_micro_train/test :class:`Datasets` called ``name`` (digits, fashion-mnist,
    cifar10,
    cifar100, synthetic, python-text). ``data_dir`` defaults to ``data`` for CIFAR and to Debian's
    location for Fashion-MNIST. ``cifar_classes`` replaces torchvision's classes (tests
    only); ``cache_dir`` replaces Fashion-MNIST's decompressed cache (default
    ``~/.cache/horovod-micro``)."""
    if name == "digits":
        return digits_datasets()
    if name == "synthetic":
        return synthetic_datasets(synthetic_size, seed)
    if name == "fashion-mnist":
        return fashion_mnist_datasets(Path(data_dir or fashion_mnist.DEBIAN_DIR), cache_dir)
    if name == "python-text":
        return python_text_datasets(seed, data_dir)
    if name in CIFAR_LAYOUT:
        classes = cifar_classes or _default_cifar_classes()
        return cifar_datasets(name, Path(data_dir or "data"), download, classes[name])
    raise ValueError(f"unknown dataset {name!r}")


def digits_datasets() -> Datasets:
    """scikit-learn's bundled 8x8 digits (1797 images, no network): a fixed stratified
    80/20 split, pixels scaled to [0, 1] and standardised with the training mean/std."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(range(len(labels)), test_size=0.2, random_state=0,
                                           stratify=bunch.target)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return Datasets(TensorDataset(images[train_idx], labels[train_idx]),
                    TensorDataset(images[test_idx], labels[test_idx]), 10, 1, 8)


def fashion_mnist_datasets(source: Path, cache_dir: str | os.PathLike | None = None
                           ) -> Datasets:
    """Fashion-MNIST (60,000 + 10,000 28x28 grey images, 10 classes) read by torchvision from
    the four idx ``.gz`` files in ``source`` (see :mod:`horovod_micro_train.fashion_mnist`);
    pixels scaled to [0, 1] and standardised with the training mean/std. Held as tensors: a
    per-sample PIL transform would cost more than the MLPs' own step."""
    splits = fashion_mnist.load(source, cache_dir)
    train_x = splits["train"][0].float().unsqueeze(1) / 255.0
    mean, std = train_x.mean(), train_x.std()
    sets = [TensorDataset((x.float().unsqueeze(1) / 255.0 - mean) / std, y)
            for x, y in (splits["train"], splits["test"])]
    return Datasets(sets[0], sets[1], 10, 1, 28)


def synthetic_datasets(size: int, seed: int, num_classes: int = 10) -> Datasets:
    """Random 3x32x32 images with random labels, the same on every rank: for throughput
    (accuracy stays at chance)."""
    gen = torch.Generator().manual_seed(seed)

    def make(n: int) -> TensorDataset:
        return TensorDataset(torch.randn(n, 3, 32, 32, generator=gen),
                             torch.randint(0, num_classes, (n,), generator=gen))
    return Datasets(make(size), make(max(size // 8, 1)), num_classes, 3, 32)


def python_text_files(root: str | os.PathLike | None = None) -> tuple[list[Path], list[Path]]:
    """The ``.py`` files under ``root`` (default: the running interpreter's standard library,
    ``sysconfig.get_paths()['stdlib']``), sorted by relative path, outside folders named
    in :data:`TEXT_EXCLUDED`; split by file: every 10th (0th, 10th, ...) is held out for
    validation. Returns (training files, validation files)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in TEXT_EXCLUDED]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    files = sorted(found, key=lambda path: path.relative_to(base).as_posix())
    if not files:
        raise DataNotFoundError(f"python-text: no .py files under {base}")
    return ([f for i, f in enumerate(files) if i % 10], files[::10])


def byte_sequences(files: list[Path], count: int, context: int,
                   generator: torch.Generator) -> TensorDataset:
    """``count`` (input, target) pairs of ``context`` bytes (int64 token ids), target = input
    shifted by one: the files' bytes concatenated in order, cut into non-overlapping
    windows of ``context + 1`` bytes, of which ``count`` are drawn without replacement."""
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)),
                            dtype=torch.uint8)
    windows = data[:len(data) // (context + 1) * (context + 1)].view(-1, context + 1)
    if count > len(windows):
        raise ValueError(f"python-text: {count} sequences asked, {len(windows)} available")
    chosen = windows[torch.randperm(len(windows), generator=generator)[:count]].long()
    return TensorDataset(chosen[:, :-1].contiguous(), chosen[:, 1:].contiguous())


def python_text_datasets(seed: int = 0, root: str | os.PathLike | None = None,
                         train_size: int = TEXT_TRAIN_SEQUENCES,
                         test_size: int = TEXT_TEST_SEQUENCES,
                         context: int = TEXT_CONTEXT) -> Datasets:
    """Byte-level language modelling on Python's own sources (:func:`python_text_files`):
    ``train_size`` training sequences drawn with ``seed`` from the training files, and a
    fixed ``test_size`` validation sequences (drawn with seed 0, whatever ``seed``) from the
    held-out files. Vocabulary 256 (``num_classes``); ``in_channels`` 1 and
    ``image_size`` the context length."""
    train_files, test_files = python_text_files(root)
    train = byte_sequences(train_files, train_size, context,
                           torch.Generator().manual_seed(seed))
    test = byte_sequences(test_files, test_size, context, torch.Generator().manual_seed(0))
    return Datasets(train, test, 256, 1, context)


def cifar_datasets(name: str, root: Path, download: bool, cls: type) -> Datasets:
    """torchvision's CIFAR class ``cls`` with the standard augmentation (random crop 32 with
    padding 4, horizontal flip) and per-channel normalisation."""
    from torchvision import transforms

    folder, files = CIFAR_LAYOUT[name]
    if download:
        # One download per machine; the other local ranks wait, then verify.
        if hvd.local_rank() == 0:
            cls(root, train=True, download=True)
            cls(root, train=False, download=True)
        hvd.barrier()
    missing = [f for f in files if not (root / folder / f).is_file()]
    if missing:
        raise DataNotFoundError(
            f"{name} not found: expected {root / folder}/ holding {', '.join(files)} "
            f"(missing: {', '.join(missing)}). This is the layout of the official python "
            f"archive extracted into --data-dir {root}; pass --download to fetch it.")
    mean, std = CIFAR_STATS[name]
    normalize = transforms.Normalize(mean, std)
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   normalize])
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    try:
        train = cls(root, train=True, transform=train_tf)
        test = cls(root, train=False, transform=test_tf)
    except RuntimeError as error:
        raise TrainError(f"{name} in {root / folder} failed torchvision's md5 check ("
                           f"{error}); remove it and pass --download, or replace the files "
                           "with the official archive's") from error
    return Datasets(train, test, len(train.classes), 3, 32)


def train_loader(dataset: Dataset, batch_size: int, workers: int, seed: int,
                 pin_memory: bool = False) -> tuple[DataLoader, DistributedSampler]:
    """Shuffled per-rank shards (call ``sampler.set_epoch(e)`` every epoch)."""
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=pin_memory)
    return loader, sampler


def eval_loader(dataset: Dataset, batch_size: int, workers: int,
                pin_memory: bool = False) -> DataLoader:
    """Rank r evaluates samples r, r+n, r+2n, ...: every sample exactly once in total
    (DistributedSampler would pad with duplicates and bias the accuracy)."""
    shard = Subset(dataset, range(hvd.rank(), len(dataset), hvd.size()))
    return DataLoader(shard, batch_size=batch_size, shuffle=False, num_workers=workers,
                      pin_memory=pin_memory)
