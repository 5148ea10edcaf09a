"""A stock Horovod script switched to MiCRO by changing the optimizer line (and adding the
import) runs to completion on 2 ranks, Gloo and MPI."""

import difflib
import sys
from pathlib import Path

from multirank import run_script

STOCK = Path(__file__).parent / "scripts" / "synthetic_benchmark.py"
WRAP = "optimizer = hvd.DistributedOptimizer("


def switch_to_micro(text: str) -> str:
    lines = text.splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith(WRAP)]
    lines[i] = ("optimizer = hvm.DistributedOptimizer(optimizer, named_parameters="
                "model.named_parameters(), compression=hvm.Compression.micro(density=0.01))")
    (j,) = [n for n, line in enumerate(lines) if line == "import horovod.torch as hvd"]
    lines.insert(j + 1, "import horovod_micro as hvm")
    return "\n".join(lines) + "\n"


def test_stock_script_switched_by_one_line(tmp_path, backend):
    stock = STOCK.read_text()
    switched = switch_to_micro(stock)
    changed = [d for d in difflib.unified_diff(stock.splitlines(), switched.splitlines(),
                                               lineterm="", n=0)
               if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    assert len(changed) == 3  # the wrapper line replaced, the import added
    script = tmp_path / "synthetic_micro.py"
    script.write_text(switched)
    out = run_script([sys.executable, str(script)], np=2, backend=backend)
    assert "Img/sec per rank:" in out
    assert "method=micro" in out and "iteration=4" in out  # 1 warm-up + 2 x 2 steps
