"""The scaling model (``bench.model``) runs on the stored measurements and projects every
registered method that takes a density."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import horovod_micro as hvm
from horovod_micro.compression import takes_density
from horovod_micro.compressors import registry

ROOT = Path(__file__).resolve().parent.parent


def test_projects_every_method_from_the_stored_inputs(tmp_path):
    out = tmp_path / "model.json"
    done = subprocess.run([sys.executable, "-m", "bench.model", "--json", str(out),
                           "--figure", str(tmp_path / "model.png")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    model = json.loads(out.read_text())
    methods = {m for m in registry.names() if takes_density(getattr(hvm.Compression, m))}
    assert methods <= set(model["projection"]["this CPU's compute|1gbit"])
    for scenario, times in model["projection"].items():
        # A sparse exchange of d = 0.001 beats a dense allreduce of 11.2M weights at 1 and
        # 10 Gbit/s, and adds to the compute (the stored one; a GPU's: 30 ms by default).
        compute = model["compute"] if scenario.startswith("this CPU") else 0.030
        assert all(compute < m < d for m, d in zip(times["micro"], times["none"]))
    assert (tmp_path / "model.png").read_bytes()[:4] == b"\x89PNG"
