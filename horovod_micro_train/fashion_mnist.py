"""Fashion-MNIST read by torchvision's own ``FashionMNIST`` class from Debian's files.

Debian's package ``dataset-fashion-mnist`` installs the four idx files gzip-compressed under
``/usr/share/datasets/fashion-mnist``; torchvision's class reads them decompressed from
``<root>/FashionMNIST/raw/`` (it only decompresses what it downloaded itself, and this code
never downloads). The bridge is a cache, ``~/.cache/horovod-micro/fashion-mnist/<key>/``
(``$XDG_CACHE_HOME`` is honoured), decompressed with torchvision's ``extract_archive``. The
key is a digest of each source file's resolved path, size and modification time, so another
``--data-dir`` or a changed file gets a fresh copy instead of a stale one.

A cache is built in a private temporary directory and renamed into place, so ranks that
start together on one machine never read a half-written copy, and need no collective.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch

from .cli import DataNotFoundError, TrainError

#: Where Debian's dataset-fashion-mnist puts the files (tools/setup.sh installs it).
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
PACKAGE = "dataset-fashion-mnist"
#: The four files, by split: (images, labels).
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
#: Where torchvision's FashionMNIST looks for the decompressed files, under its root.
RAW = Path("FashionMNIST") / "raw"


class DamagedDataError(TrainError, ValueError):
    """A Fashion-MNIST file is truncated or is not what its name says."""


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/horovod-micro`` (default ``~/.cache/horovod-micro``)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "horovod-micro"


def source_files(source: Path) -> list[Path]:
    """The four ``.gz`` files in ``source``; a missing one is an error naming the package."""
    names = [name for pair in FILES.values() for name in pair]
    missing = [name for name in names if not (source / name).is_file()]
    if missing:
        raise DataNotFoundError(
            f"Fashion-MNIST not found in {source} (missing: {', '.join(missing)}). Install "
            f"Debian's package {PACKAGE} (apt-get install {PACKAGE}, which puts the four idx "
            f".gz files in {DEBIAN_DIR}; tools/setup.sh does it), or pass --data-dir DIR "
            "holding the four files.")
    return [source / name for name in names]


def cache_key(files: list[Path]) -> str:
    """A digest of the files' resolved paths, sizes and modification times."""
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def prepare_root(source: Path, cache: Path) -> Path:
    """A torchvision root whose ``FashionMNIST/raw/`` holds ``source``'s files decompressed
    (built on first use, reused while the source files are unchanged)."""
    from torchvision.datasets.utils import extract_archive

    files = source_files(source)
    root = cache / "fashion-mnist" / cache_key(files)
    if _complete(root):
        return root
    # Copies only appear complete (renamed into place), so a partial one was damaged by
    # hand: replace it.
    shutil.rmtree(root, ignore_errors=True)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=".build-", dir=root.parent))
    except OSError as error:
        raise TrainError(f"cannot write Fashion-MNIST's decompressed copy under {cache} "
                         f"({error}); point XDG_CACHE_HOME at a writable directory") from error
    try:
        raw = build / RAW
        raw.mkdir(parents=True)
        for path in files:
            try:
                extract_archive(str(path), str(raw))
            except (EOFError, gzip.BadGzipFile, zlib.error) as error:
                raise DamagedDataError(
                    f"{path} is truncated or damaged ({error}); reinstall {PACKAGE} "
                    "(apt-get install --reinstall) or replace the file") from error
        try:
            os.rename(build, root)
        except OSError:
            if not _complete(root):  # else another rank's identical copy won the race
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return root


def _complete(root: Path) -> bool:
    return all((root / RAW / name.removesuffix(".gz")).is_file()
               for pair in FILES.values() for name in pair)


def load(source: Path, cache: Path | None = None
         ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train": (images, labels), "test": (images, labels)}`` as torchvision's
    ``FashionMNIST`` reads them from ``source``: uint8 ``N x 28 x 28`` images, int64
    labels. ``cache`` defaults to :func:`cache_home`."""
    from torchvision.datasets import FashionMNIST

    source = Path(source)
    root = prepare_root(source, Path(cache) if cache else cache_home())
    splits = {}
    for split, (images, labels) in FILES.items():
        names = f"{source / images} and {source / labels}"
        try:
            dataset = FashionMNIST(str(root), train=split == "train", download=False)
        except (RuntimeError, ValueError, TypeError, AssertionError) as error:
            raise DamagedDataError(
                f"torchvision cannot read Fashion-MNIST's {split} split from {names} "
                f"({type(error).__name__}: {error}): a file is truncated or not an idx "
                "file") from error
        if len(dataset.data) != len(dataset.targets) or dataset.data.dim() != 3:
            raise DamagedDataError(
                f"{names} disagree: {len(dataset.data)} images of shape "
                f"{tuple(dataset.data.shape[1:])}, {len(dataset.targets)} labels")
        splits[split] = (dataset.data, dataset.targets)
    return splits
