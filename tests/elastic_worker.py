"""One worker of an Elastic Horovod job (run by tests/test_elastic.py under ``horovodrun
--min-np/--max-np --host-discovery-script``): a small model trained with
``hvm.DistributedOptimizer`` inside ``hvd.elastic.run`` with ``hvd.elastic.TorchState``.

Faults are real: the worker started on host ``--kill-host`` SIGKILLs itself at iteration
``--kill-at``, after its backward pass, while the others are already in the exchange's
collectives; rank 0 rewrites the hosts file the discovery script reads at ``--add-at``, and
the job then waits (committing, not training) until a new worker has joined. Every worker
appends one JSON line per iteration to ``OUT/<pid>.jsonl`` and, at the end, its final state
to ``OUT/final-<pid>.json``; the test judges those.

    python tests/elastic_worker.py '{"method": "micro", "out": "...", ...}'

The elastic-reset figures of BENCHMARKS.md ran it by hand, with ``el/hosts.txt`` holding
``localhost:2`` and ``127.0.0.1:1`` and ``el/disc.sh`` printing it::

    CFG='{"method":"micro","density":0.05,"steps":60,"commit_every":5,"kill_at":17,
          "kill_host":"127.0.0.1","add_at":30,"final_size":3,"hosts_file":"el/hosts.txt",
          "add_hosts":"localhost:3\\n127.0.0.1:1\\n","out":"el/out"}'
    HOROVOD_GLOO_TIMEOUT_SECONDS=20 PYTHONPATH=. .venv/bin/horovodrun -np 3 --min-np 2 \\
        --max-np 3 --host-discovery-script el/disc.sh --gloo .venv/bin/python \\
        tests/elastic_worker.py "$CFG"

(the reference run: ``"kill_at": -1, "add_at": -1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.nn import functional as F  # noqa: N812

import horovod_micro as hvm

# How long the job may wait for a new worker before it fails (a bound, not a test).
JOIN_LIMIT_S = 180.0


def build(method: str, density: float):
    torch.manual_seed(0)  # the same initial weights everywhere (sync broadcasts anyway)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 10))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if method == "none":
        compression = hvm.Compression.none
    else:
        compression = getattr(hvm.Compression, method)(density=density)
    optimizer = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                         compression=compression)
    return model, optimizer


def batch(iteration: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and iteration-specific data from a fixed linear teacher."""
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    x = torch.randn(64, 32, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(32, 10, generator=teacher)
    return x, (x @ w).argmax(1)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main(cfg: dict) -> None:
    hvd.init()
    out = Path(cfg["out"])
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    model, optimizer = build(cfg["method"], cfg["density"])
    log = (out / f"{os.getpid()}.jsonl").open("a")

    @hvd.elastic.run
    def train(state):
        state.resets += 1
        waited = 0.0
        while state.iteration < cfg["steps"]:
            it = state.iteration
            if it >= cfg["add_at"] >= 0 and hvd.size() != cfg["final_size"]:
                if hvd.rank() == 0 and not state.hosts_rewritten:
                    Path(cfg["hosts_file"]).write_text(cfg["add_hosts"])
                state.hosts_rewritten = True
                if waited > JOIN_LIMIT_S:
                    raise RuntimeError("the set of workers did not change within the limit")
                time.sleep(0.2)
                waited += 0.2
                state.commit()  # raises HostsUpdatedInterrupt once the driver saw it
                continue
            optimizer.zero_grad()
            x, y = batch(it, hvd.rank())
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if it == cfg["kill_at"] and host == cfg["kill_host"]:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.step()
            stats = optimizer.last_stats
            log.write(json.dumps({
                "pid": os.getpid(), "host": host, "rank": hvd.rank(), "size": hvd.size(),
                "iteration": it, "loss": float(loss.detach()), "density": stats.density,
                "target": stats.target_density, "residual_norm": stats.residual_norm,
                "resets": state.resets}) + "\n")
            log.flush()
            state.iteration += 1
            if state.iteration % cfg["commit_every"] == 0:
                state.commit()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, iteration=0, resets=0,
                                   hosts_rewritten=False)
    train(state)
    sparse = getattr(optimizer, "reducer", None)
    final = {"pid": os.getpid(), "host": host, "rank": hvd.rank(), "size": hvd.size(),
             "iteration": state.iteration, "weights": digest(model),
             "controller": (json.dumps(sparse.shared_state(), sort_keys=True,
                                        default=lambda t: t.tolist())
                            if sparse is not None else None)}
    (out / f"final-{os.getpid()}.json").write_text(json.dumps(final))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
