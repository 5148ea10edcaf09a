"""The example training scripts of ``train/``: plain Horovod PyTorch scripts, one per
experiment, each switched to MiCRO by one line. Each runs here on 2 Gloo ranks for a few
iterations (the CIFAR-10 ones on synthetic images of CIFAR's shape, since no CIFAR archive
is on the machine), as a user would launch it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "fashion_mnist.py": ["--epochs", "1", "--max-iters", "6"],
    "cifar10_resnet18.py": ["--synthetic", "--epochs", "1", "--max-iters", "2",
                            "--batch-size", "8"],
    "cifar10_googlenet.py": ["--synthetic", "--epochs", "1", "--max-iters", "2",
                             "--batch-size", "8"],
    "cifar10_senet18.py": ["--synthetic", "--epochs", "1", "--max-iters", "2",
                           "--batch-size", "8"],
}


def _launch(script: str, extra: list[str]) -> str:
    argv = [sys.executable, str(REPO / "train" / script), *extra]
    return run_bounded(horovodrun_cmd(2, "gloo", argv), 600, cwd=REPO,
                       env={"OMP_NUM_THREADS": "1"}, label=script).stdout


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_script_trains_with_micro_under_horovodrun(script):
    out = _launch(script, SCRIPTS[script])
    done = [line for line in out.splitlines() if "done: micro" in line]
    assert len(done) == 1 and "on 2 ranks" in done[0], out[-3000:]
    assert "epoch 0: test accuracy" in out, out[-3000:]


def test_the_switch_is_one_line_of_a_plain_horovod_script():
    """Every script (or the module it runs) calls hvd.init() and builds the optimizer
    with Horovod's or MiCRO's DistributedOptimizer; --dense runs Horovod's own."""
    for name in ("fashion_mnist.py", "cifar10.py"):
        text = (REPO / "train" / name).read_text()
        assert "hvd.init()" in text and "hvd.DistributedOptimizer(" in text
        assert text.count("hvm.DistributedOptimizer(") == 1
    out = _launch("fashion_mnist.py", ["--epochs", "1", "--max-iters", "6", "--dense"])
    assert "done: dense on 2 ranks" in out, out[-3000:]
