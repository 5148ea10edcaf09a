"""jobs/multi_node.sh launched for real across emulated hosts (hvm_testbed/cluster.py).

A short MiCRO training (digits, 2 iterations) through ``horovodrun -H`` and through
``--hostfile``, on Gloo and on MPI, started from host hvm1 as a user would start it on a
cluster's first node. Every host must have run a rank (each rank's own file names its
hostname), the ranks must end with the same parameters (their hashes agree, and equal a
hash the test computes itself from rank 0's checkpoint), and the run's records
(``run.json``) must name every host.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from hvm_testbed.cluster import Cluster
from hvm_testbed.launch import LaunchError, horovodrun

REPO = Path(__file__).resolve().parent.parent
TRAIN_ARGS = ["--epochs", "1", "--max-iters-per-epoch", "2", "--no-plots", "--progress",
              "none"]


@pytest.fixture(scope="module")
def cluster():
    with Cluster.up(3, rate="1gbit") as c:
        yield c


def own_hash(checkpoint: Path) -> str:
    """SHA-256 of the checkpoint's parameters, computed here from the saved weights."""
    from horovod_micro_train.models import build_model

    model = build_model("digits_cnn", 10)
    model.load_state_dict(torch.load(checkpoint, weights_only=False)["model"])
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        tensor = param.detach().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("n_hosts,backend,hosts_by", [(2, "gloo", "-H"),
                                                      (2, "mpi", "--hostfile"),
                                                      (3, "mpi", "-H")])
def test_multi_node_job_runs_on_every_host(cluster, tmp_path, n_hosts, backend, hosts_by):
    hosts = cluster.hosts[:n_hosts]
    if hosts_by == "-H":
        where = ["--hosts", cluster.slots(count=n_hosts)]
    else:
        where = ["--hostfile", str(cluster.hostfile(tmp_path / "hosts", count=n_hosts))]
    out = tmp_path / "runs"
    cmd = ["bash", str(REPO / "jobs" / "multi_node.sh"), *where, "--iface", "eth0",
           "--backend", backend, "--data-dir", str(tmp_path / "data"), "--out-dir", str(out),
           "--datasets", "digits", "--models", "digits_cnn", "--compressors", "micro",
           "--densities", "0.01", "--", *TRAIN_ARGS]
    try:
        output = cluster.run(hosts[0], cmd, 480, cwd=REPO, env={
            "PYTHON": sys.executable, "HOROVODRUN": horovodrun()}).stdout
    except LaunchError as error:
        pytest.fail(str(error))
    name = f"digits/digits_cnn/micro-d0.01/np{n_hosts}"
    assert f"[jobs] {name}: exit 0" in output, output
    run_dir = out / name
    ranks = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text())
             for r in range(n_hosts)]
    assert sorted(r["hostname"] for r in ranks) == hosts, "a host ran no rank"
    assert all(r["size"] == n_hosts for r in ranks)
    hashes = {r["parameters_sha256"] for r in ranks}
    assert hashes == {own_hash(run_dir / "checkpoint.pt")}, "the ranks' weights differ"
    config = json.loads((run_dir / "run.json").read_text())
    assert config["world_size"] == n_hosts
    assert config["hosts"] == [r["hostname"] for r in ranks]
    epochs = (run_dir / "epochs.jsonl").read_text().splitlines()
    assert len(epochs) == 1 and json.loads(epochs[0])["iterations"] == 2
