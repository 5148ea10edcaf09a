"""The README's complete script runs as the README says, under horovodrun on 2 ranks (Gloo and
MPI), and differs from a plain Horovod script only by the import and the wrapper line: put
``hvd.DistributedOptimizer`` back and drop the import, and it trains with Horovod's own
optimizer."""

import re
import sys
from pathlib import Path

from multirank import run_script

README = Path(__file__).resolve().parent.parent / "README.md"


def example() -> str:
    text = README.read_text()
    section = text[text.index("## Switching a Horovod script"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_names_its_launch_line():
    section = README.read_text().split("## Switching a Horovod script")[1].split("## ")[0]
    assert "horovodrun -np 2 -H localhost:2 python example.py" in section
    assert "hvd.init()" in example()


def test_the_readme_script_runs_on_two_ranks(tmp_path, backend):
    script = tmp_path / "example.py"
    script.write_text(example())
    out = run_script([sys.executable, str(script)], np=2, backend=backend)
    found = dict(re.findall(r"rank (\d): done, actual density ([0-9.]+)", out))
    assert set(found) == {"0", "1"}, out[-2000:]
    for density in found.values():  # the wrapped compressor's density, 0.01, held
        assert 0.005 <= float(density) <= 0.012, out[-2000:]


def test_the_readme_script_is_horovods_but_for_two_lines(tmp_path):
    lines = example().splitlines()
    micro = [n for n, line in enumerate(lines) if "hvm" in line]
    assert len(micro) == 3  # the import and the wrapper (2 lines)
    lines = [line for line in lines if line != "import horovod_micro as hvm"]
    (wrap,) = [n for n, line in enumerate(lines) if line.startswith("opt = hvm.")]
    lines[wrap:wrap + 2] = ["opt = hvd.DistributedOptimizer("
                            "opt, named_parameters=model.named_parameters())"]
    lines = [re.sub(r", actual density .*\"\)", '")', line) for line in lines]
    assert not any("hvm" in line for line in lines)
    script = tmp_path / "stock.py"
    script.write_text("\n".join(lines) + "\n")
    out = run_script([sys.executable, str(script)], np=2)
    assert "rank 0: done" in out and "rank 1: done" in out, out[-2000:]
