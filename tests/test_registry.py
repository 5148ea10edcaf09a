"""One registry is the single list of methods: a method added in one file (the fixture
tests/plugin_compressor.py, found through HOROVOD_MICRO_PLUGINS) runs through the
optimizer on real ranks, the train CLI's parser and the job matrix's dry run, and every
built-in method has an independent simulation in the tests."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from multirank import run_ranks
from simulation import rank_gradient
from test_baselines import ALL_METHODS, BASELINES

from horovod_micro.compressors import registry

REPO = Path(__file__).resolve().parent.parent
PLUGIN_ENV = {"HOROVOD_MICRO_PLUGINS": "plugin_compressor",
              "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}


def test_every_builtin_method_is_registered_and_simulated():
    # MiCRO (both exchanges) and PowerSGD have simulations of their own (simulation.py,
    # simulation_powersgd.py); the rest are the baselines' table.
    simulated = set(BASELINES) | {"micro", "micro_ahead", "powersgd"}
    assert {spec["method"] for spec in ALL_METHODS} == set(BASELINES)  # each one runs
    assert set(registry.names()) == simulated
    assert "cyclicblock" not in registry.names()  # only where the plugin is imported


def simulate_cyclic_block(n, numel, steps, density):
    """n workers with error feedback, written from the fixture's definition."""
    k = int(density * numel)
    residuals = [torch.zeros(numel) for _ in range(n)]
    out = []
    for t in range(steps):
        chosen = (torch.arange(k) + t * k) % numel
        for r in range(n):
            residuals[r] += rank_gradient(r, t, numel, seed=4)
        grad = torch.zeros(numel)
        grad[chosen] = sum(res[chosen] for res in residuals) / n
        for res in residuals:
            res[chosen] = 0.0
        out.append(grad)
    return out


def check_cyclic_block_on_ranks(env: dict) -> None:
    """The fixture method, found as ``env`` makes it, on 2 real ranks: the gradients equal
    its simulation and every step's bytes its byte model."""
    numel, steps, density = 300, 4, 0.1
    results = run_ranks("ranks_registry:plugin_steps", np=2, env=env,
                        kwargs={"numel": numel, "steps": steps, "density": density})
    expected = simulate_cyclic_block(2, numel, steps, density)
    for r in results:
        assert r.value["method"] == "cyclicblock"
        for got, want in zip(r.value["grads"], expected):
            torch.testing.assert_close(torch.tensor(got), want)
        assert r.value["sent"] == [r.value["modeled"]] * steps  # its byte model holds


def test_plugin_method_runs_through_the_optimizer():
    check_cyclic_block_on_ranks(PLUGIN_ENV)


def _python(code_or_args: list[str], plugin: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, **(PLUGIN_ENV if plugin else {})}
    if not plugin:
        env.pop("HOROVOD_MICRO_PLUGINS", None)
    return subprocess.run([sys.executable, *code_or_args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_plugin_method_reaches_the_train_parser_and_the_job_matrix():
    parse = ["-c", "from horovod_micro_train.cli import parse_args; "
             "print(parse_args(['--compressor', 'cyclicblock', '--density', '0.01']).compressor)"]
    assert _python(parse, plugin=True).stdout.strip() == "cyclicblock"
    refused = _python(parse, plugin=False)
    assert refused.returncode == 2 and "invalid choice: 'cyclicblock'" in refused.stderr

    matrix = ["jobs/matrix.py", "--dry-run", "--data-dir", "/data", "--out-dir", "/runs",
              "--compressors", "cyclicblock", "--densities", "0.01", "--models", "resnet18",
              "--datasets", "cifar10", "--np", "2"]
    done = _python(matrix, plugin=True)
    assert done.returncode == 0, done.stderr
    assert "--compressor cyclicblock --density 0.01" in done.stdout
    assert _python(matrix, plugin=False).returncode != 0


def test_local_selection_of_each_rule():
    """Top-k picks the k largest magnitudes, MiCRO |x| >= its threshold in the part the rank
    owns, Random-k the same coordinates on every rank."""
    numel, n = 200, 2
    results = run_ranks("ranks_registry:local_selection", np=n, kwargs={"numel": numel})
    for r in results:
        x = torch.tensor(r.value["x"])
        flat = x.reshape(-1)
        for name, got in ((k, r.value[k]) for k in ("topk", "micro", "randomk")):
            idx = torch.tensor(got["indices"], dtype=torch.long)
            assert len(set(idx.tolist())) == len(idx) and (idx >= 0).all() and (idx < numel).all()
            if name == "topk":  # the 20 largest magnitudes
                assert set(idx.tolist()) == set(flat.abs().topk(20).indices.tolist())
            if name == "micro":  # |x| >= threshold in the part rank r owns at iteration 1
                part = (1 + r.rank) % n
                lo, hi = part * numel // n, (part + 1) * numel // n
                want = [i for i in range(lo, hi) if abs(flat[i]) >= got["threshold"]]
                assert sorted(idx.tolist()) == want and want
        # Random-k: the same coordinates on every rank (shared seed).
        assert r.value["randomk"]["indices"] == results[0].value["randomk"]["indices"]


def test_threads_asking_at_once_all_see_every_method():
    """The first use of the registry imports every method's module; threads that ask
    meanwhile (n loopback ranks building their compressors at once) wait for the whole
    list instead of reading the part imported so far. A fresh interpreter, since
    discovery happens once per process; 8 threads released by a barrier, 5 times."""
    code = """
import threading
from horovod_micro.compressors import registry
barrier, seen = threading.Barrier(8), []
def ask():
    barrier.wait()
    seen.append(registry.names())
threads = [threading.Thread(target=ask) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(sorted(set(seen)))
"""
    for _ in range(5):
        proc = _python(["-c", code], plugin=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == str([tuple(sorted({*registry.names(), "cyclicblock"}))])


def test_a_builtin_method_is_one_library_file_plus_its_simulation(tmp_path):
    """The fixture method dropped into a copy of the package as one more module of
    ``horovod_micro/compressors`` (no plugin variable, no other file touched) is
    discovered as a built-in and runs through the optimizer on real ranks, equal to its
    simulation (:func:`simulate_cyclic_block`)."""
    package = tmp_path / "horovod_micro"
    shutil.copytree(REPO / "horovod_micro", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "tests" / "plugin_compressor.py",
                package / "compressors" / "cyclicblock.py")
    path = os.pathsep.join([str(tmp_path), str(REPO / "tests"), str(REPO)])
    names = subprocess.run(
        [sys.executable, "-c", "import horovod_micro as hvm; "
         "from horovod_micro.compressors import registry; "
         "print(hvm.__file__, ' '.join(registry.names()))"],
        cwd=tmp_path, env={**{k: v for k, v in os.environ.items()
                              if k != "HOROVOD_MICRO_PLUGINS"}, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=120)
    assert names.returncode == 0, names.stderr
    where, *methods = names.stdout.split()
    assert where.startswith(str(tmp_path)) and "cyclicblock" in methods
    check_cyclic_block_on_ranks({"PYTHONPATH": path})
