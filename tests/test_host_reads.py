"""bench/host_reads.py on 2 real Gloo ranks: the host reads of a MiCRO step on the torch
path (what a GPU would wait for), counted with a TorchDispatchMode and a counter on
``Tensor.tolist``.

The count may only go down. Today: the gathered header, as one ``tolist()``: 1 per step.
The selection is decided on the device and written into the exchange's slots
(``nonzero_static``), so neither its size nor the ladder's counts are read; the squared
norm, the status word, the scale and the thresholds stay on the device; the aggregate's
finiteness is proven from the ranks' norms (the status word's bounded flag) instead of
read. The residual's norm and the threshold are not among them: a statistic is computed
when read.
"""

import json
import sys

from hvm_testbed.launch import horovodrun_cmd, run_bounded

READS_NOW = 1.0


def test_a_micro_step_reads_the_host_once(tmp_path):
    out = tmp_path / "census.json"
    run_bounded(horovodrun_cmd(2, "gloo", [sys.executable, "-m", "bench.host_reads",
                                          "--steps", "20", "--json", str(out)]), 300)
    census = json.loads(out.read_text())
    assert census["ranks"] == 2 and census["steps"] == 20
    assert census["reads_per_step"] <= READS_NOW, census["by_site"]
    # The gathered header is pulled to the host once per step, as one tolist().
    header = {site: n for site, n in census["by_site"].items() if "exchange.py" in site}
    assert sum(header.values()) == 1.0, census["by_site"]
    # The aggregate is proven finite, not read; no selection waits for its size; the
    # norm, status, scale and the selection's counts are not read.
    assert not [site for site in census["by_site"]
                if any(name in site for name in ("layout.py", "reducer.py", "compressor.py",
                                                 "selection.py", "part_controller.py",
                                                 "device_choice.py"))
                or "nonzero" in site], census["by_site"]
    # Statistics are computed when read: no read in the residual's norm.
    assert not [site for site in census["by_site"]
                if "_norm" in site or "_sum_of_squares" in site], census["by_site"]
