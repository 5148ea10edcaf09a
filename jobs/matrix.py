"""The MiCRO paper's experiment matrix as ``horovodrun`` commands (shared by the launchers).

    python jobs/matrix.py --launcher local --data-dir /data --out-dir /runs --dry-run

builds one ``python -m horovod_micro_train`` run per (dataset, model, compressor, density,
worker count) and either prints the commands (``--dry-run``) or runs them one after another. The
launchers in this folder are thin wrappers around it: ``single_node.sh`` (``-H
localhost:N``), ``multi_node.sh`` (``-H host1:8,host2:8`` or ``--hostfile``),
``submit_slurm.sh`` (``--submit``: one SLURM array task per configuration) and
``slurm.sbatch`` (one array task: configuration ``$SLURM_ARRAY_TASK_ID`` inside its
allocation, with ``horovodrun`` or ``srun``). Anything after ``--`` is appended to every
training command (e.g. ``-- --epochs 1 --resume``).

Configurations are numbered 0..N-1 in a fixed order (``--list``, ``--count``); ``--index I``
runs or prints configuration I only. The numbering does not depend on the hosts: with no
``--np``, a SLURM matrix has one worker count (all slots of the allocation), so the array
submitted from a login node and the tasks inside their allocations agree.

Only the standard library is needed. Every training command is checked with the real
parser (``horovod_micro_train.cli.parse_args``) before anything runs, when
``horovod_micro_train`` can be imported.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PAPER_MODELS = ("resnet18", "googlenet", "senet18")
PAPER_DATASETS = ("cifar10", "cifar100")
# The MiCRO paper's comparison: MiCRO and the baselines it measured; "none" is Horovod's
# dense allreduce. A fact of the paper, not the list of methods: --compressors takes any
# registered method (the training parser checks the names against the registry).
PAPER_COMPRESSORS = ("micro", "topk", "cltk", "threshold", "randomk", "gtopk", "none")
PAPER_DENSITIES = (0.001, 0.01)
DENSE = ("none", "fp16")  # no density: one run per method, not one per density

# Environment variables forwarded into the printed/ran commands when set (multi-node
# networking; see docs/jobs.md, "Several nodes"). horovodrun passes the environment on to
# every rank.
NETWORK_ENV = ("NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "NCCL_IB_DISABLE", "NCCL_IB_HCA",
               "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL", "NCCL_DEBUG", "NCCL_P2P_DISABLE",
               "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")


@dataclass
class Run:
    """One training run: its name, worker count and ``python -m horovod_micro_train`` arguments."""
    name: str
    np: int
    train_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    launch: list[str] = field(default_factory=list)

    @property
    def argv(self) -> list[str]:
        return self.launch + self.train_args

    def shell(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        return f"{prefix} {cmd}" if prefix else cmd


def csv(kind):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        try:
            return [kind(t) for t in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jobs/matrix.py", allow_abbrev=False,
        description="The MiCRO paper's experiment matrix as horovodrun commands. Arguments "
                    "after -- are appended to every `python -m horovod_micro_train` command.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--launcher", choices=("local", "hosts", "slurm"), default="local",
                   help="local: -H localhost:N; hosts: --hosts/--hostfile; slurm: inside an "
                        "allocation (--hosts from the node list, or srun)")
    p.add_argument("--data-dir", required=True, help="passed as --data-dir (CIFAR root)")
    p.add_argument("--out-dir", required=True,
                   help="root of the runs; each run writes OUT_DIR/<dataset>/<model>/"
                        "<compressor>[-d<density>]/np<N>")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands (with --submit: the sbatch command), run nothing")
    p.add_argument("--index", type=int, default=None, metavar="I",
                   help="only configuration I (0-based, see --list); inside a SLURM array "
                        "task slurm.sbatch passes $SLURM_ARRAY_TASK_ID")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--count", action="store_true",
                      help="print the number of configurations and exit")
    mode.add_argument("--list", action="store_true",
                      help="print 'INDEX NAME' for every configuration and exit (npALL: "
                           "all slots of an allocation not known yet)")
    mode.add_argument("--submit", action="store_true",
                      help="slurm: sbatch --array=0-(N-1) jobs/slurm.sbatch with these "
                           "options, one array task per configuration")
    p.add_argument("--sbatch-args", default="",
                   help="with --submit: extra sbatch options, one string, e.g. "
                        "\"--nodes=4 --partition=gpu\" (a single one: --sbatch-args=--qos=x)")
    p.add_argument("--max-parallel", type=int, default=None, metavar="M",
                   help="with --submit: at most M array tasks at once (--array=0-(N-1)%%M)")
    p.add_argument("--models", type=csv(str), default=list(PAPER_MODELS))
    p.add_argument("--datasets", type=csv(str), default=list(PAPER_DATASETS))
    p.add_argument("--compressors", type=csv(str), default=list(PAPER_COMPRESSORS))
    p.add_argument("--densities", type=csv(float), default=list(PAPER_DENSITIES))
    p.add_argument("--np", type=csv(int), default=None,
                   help="worker counts (default: local 2,4,8; hosts/slurm: all slots)")
    p.add_argument("--hosts", default=None, help="host1:8,host2:8 (launcher hosts/slurm)")
    p.add_argument("--hostfile", default=None,
                   help="horovodrun hostfile, lines 'host slots=8' (launcher hosts)")
    p.add_argument("--slots-per-host", type=int, default=None,
                   help="slots of a --hosts entry given without ':N'")
    p.add_argument("--backend", choices=("gloo", "mpi", "auto"), default="gloo",
                   help="horovodrun controller (GPU tensors go over NCCL either way)")
    p.add_argument("--slurm-launch", choices=("horovodrun", "srun"), default="horovodrun",
                   help="slurm: horovodrun over the allocation's nodes (needs ssh between "
                        "them) or srun --mpi=pmix (Horovod's MPI controller via PMIx)")
    p.add_argument("--iface", default=None,
                   help="network interface for every rank: sets NCCL_SOCKET_IFNAME, "
                        "HOROVOD_GLOO_IFACE and horovodrun --network-interfaces")
    p.add_argument("--launcher-args", default="",
                   help="extra arguments for horovodrun/srun, one string, e.g. "
                        "\"--mpi-args='--mca btl_tcp_if_include eth0'\"")
    p.add_argument("--horovodrun", default=os.environ.get("HOROVODRUN", "horovodrun"))
    p.add_argument("--python", default=os.environ.get("PYTHON") or default_python())
    p.add_argument("--keep-going", action="store_true", help="go on after a failed run")
    p.add_argument("--no-check", action="store_true",
                   help="do not check the training arguments with horovod_micro_train.cli first")
    return p


def default_python() -> str:
    return "python" if shutil.which("python") else "python3"


def parse_hosts(hosts: str, slots_default: int | None) -> list[tuple[str, int]]:
    out = []
    for entry in hosts.split(","):
        entry = entry.strip()
        if not entry:
            continue
        host, _, slots = entry.partition(":")
        if slots:
            out.append((host, int(slots)))
        elif slots_default:
            out.append((host, slots_default))
        else:
            raise SystemExit(f"host {host!r} has no slot count: write {host}:8 or pass "
                             "--slots-per-host")
    if not out:
        raise SystemExit("--hosts is empty")
    return out


def hostfile_slots(path: str) -> int:
    total = 0
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        total += int(slots[0]) if slots else 1
    return total


def train_args(dataset: str, model: str, compressor: str, density: float | None,
               data_dir: str, out: str, extra: list[str]) -> list[str]:
    args = ["--dataset", dataset, "--model", model, "--data-dir", data_dir,
            "--compressor", compressor]
    if density is not None:
        args += ["--density", repr(density)]
    return args + ["--out", out] + extra


def matrix(opts, extra: list[str]) -> list[tuple[str, list[str], int | None]]:
    """(name, training args without the launcher, np) for every cell of the matrix, in the
    order that numbers them (``--index``). ``np`` None: all slots, not known here."""
    runs = []
    for dataset, model, compressor in itertools.product(opts.datasets, opts.models,
                                                        opts.compressors):
        densities = [None] if compressor in DENSE else opts.densities
        for density, np in itertools.product(densities, opts.np):
            method = compressor if density is None else f"{compressor}-d{density:g}"
            name = f"{dataset}/{model}/{method}/np{np or 'ALL'}"
            out = str(Path(opts.out_dir) / name)
            runs.append((name, train_args(dataset, model, compressor, density,
                                          opts.data_dir, out, extra), np))
    return runs


def launch_prefix(opts, np: int, hosts: list[tuple[str, int]] | None) -> list[str]:
    if opts.launcher == "slurm" and opts.slurm_launch == "srun":
        return ["srun", f"--ntasks={np}", "--mpi=pmix", "--kill-on-bad-exit=1",
                *shlex.split(opts.launcher_args)]
    cmd = [opts.horovodrun, "-np", str(np)]
    if opts.launcher == "local":
        cmd += ["-H", f"localhost:{np}"]
    elif opts.hostfile:
        cmd += ["--hostfile", opts.hostfile]
    else:
        cmd += ["-H", ",".join(f"{h}:{s}" for h, s in hosts)]
    if opts.backend != "auto":
        cmd.append(f"--{opts.backend}")
    if opts.iface:
        cmd += ["--network-interfaces", opts.iface]
    return cmd + shlex.split(opts.launcher_args)


def network_env(opts) -> dict[str, str]:
    env = {k: os.environ[k] for k in NETWORK_ENV if os.environ.get(k)}
    if opts.iface:
        env.setdefault("NCCL_SOCKET_IFNAME", opts.iface)
        env.setdefault("HOROVOD_GLOO_IFACE", opts.iface)
    return env


def build_runs(opts, extra: list[str], need_slots: bool = True) -> list[Run]:
    """Every configuration as a :class:`Run`. ``need_slots=False`` (counting, listing,
    submitting a SLURM array from outside an allocation): a slurm matrix whose slots are not
    known yet gets runs without a launch command (``np`` None when no ``--np``)."""
    hosts, total = None, None
    unknown = False
    if opts.launcher == "local":
        if opts.hosts or opts.hostfile:
            raise SystemExit("--hosts/--hostfile need --launcher hosts or slurm")
        opts.np = opts.np or [2, 4, 8]
    elif opts.hostfile:
        total = hostfile_slots(opts.hostfile)
    elif opts.hosts:
        hosts = parse_hosts(opts.hosts, opts.slots_per_host)
        total = sum(s for _, s in hosts)
    elif opts.launcher == "slurm" and opts.slurm_launch == "srun":
        total = int(os.environ.get("SLURM_NTASKS", "0")) or None
        if not (opts.np or total):
            if need_slots:
                raise SystemExit("no --np and no SLURM_NTASKS: run inside an allocation")
            unknown = True
    elif opts.launcher == "slurm" and not need_slots:
        unknown = True  # horovodrun's -H comes from the allocation, in slurm.sbatch
    else:
        raise SystemExit(f"--launcher {opts.launcher} needs --hosts or --hostfile")
    opts.np = opts.np or [total]
    if total is not None and max(opts.np) > total:
        raise SystemExit(f"--np {max(opts.np)} exceeds the {total} slots available")
    env = network_env(opts)
    runs = []
    for name, args, np in matrix(opts, extra):
        launch = [] if unknown else [*launch_prefix(opts, np, hosts), opts.python, "-m",
                                     "horovod_micro_train"]
        runs.append(Run(name=name, np=np, train_args=args, env=env, launch=launch))
    return runs


def check(runs: list[Run]) -> None:
    """Parse every run's training arguments with the real parser (exits on an error)."""
    sys.path.insert(0, str(REPO))
    try:
        from horovod_micro_train.cli import compressor_names, parse_args
    except ImportError:
        print("note: train is not importable here; training arguments not checked",
              file=sys.stderr)
        return
    for run in runs:
        args = parse_args(run.train_args)
        if args.compressor not in compressor_names():
            raise SystemExit(f"{run.name}: unknown compressor {args.compressor!r}; choose "
                             f"from {', '.join(compressor_names())}")


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def forwarded_options(own: list[str]) -> list[str]:
    """``own`` without the options that only concern the submission (what the array tasks
    get: the matrix's options, in the order given)."""
    submission = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--submit", "--dry-run"):
        submission.add_argument(flag, action="store_true")
    for option in ("--launcher", "--index", "--sbatch-args", "--max-parallel"):
        submission.add_argument(option)
    return submission.parse_known_args(own)[1]


def submit(opts, own: list[str], extra: list[str], count: int) -> int:
    """``sbatch --array=0-(N-1) jobs/slurm.sbatch OPTIONS``: one array task per
    configuration, each in its own allocation; a failed task does not stop the others."""
    array = str(opts.index) if opts.index is not None else f"0-{count - 1}"
    if opts.max_parallel:
        array += f"%{opts.max_parallel}"
    script = REPO / "jobs" / "slurm.sbatch"
    cmd = ["sbatch", f"--array={array}", *shlex.split(opts.sbatch_args), str(script),
           *forwarded_options(own), *(["--", *extra] if extra else [])]
    # sbatch runs a copy of slurm.sbatch; HVM_REPO (exported to the tasks) finds matrix.py.
    job = Run(name="submit", np=0, train_args=[], launch=cmd,
              env={"HVM_REPO": os.environ.get("HVM_REPO") or str(REPO)})
    if opts.dry_run:
        print(job.shell())
        return 0
    print(f"[jobs] {count if opts.index is None else 1} array task(s): {job.shell()}",
          flush=True)
    return subprocess.call(job.argv, env={**os.environ, **job.env})


def main(argv: list[str] | None = None) -> int:
    own, extra = split_extra(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    opts = parser.parse_args(own)
    if opts.submit and opts.launcher != "slurm":
        parser.error("--submit needs --launcher slurm")
    if opts.index is not None and (opts.count or opts.list):
        parser.error("--index selects one configuration; --count and --list describe all")
    runs = build_runs(opts, extra, need_slots=not (opts.count or opts.list or opts.submit))
    if opts.index is not None and not 0 <= opts.index < len(runs):
        raise SystemExit(f"--index {opts.index}: the matrix has {len(runs)} configurations "
                         f"(0..{len(runs) - 1})")
    if not opts.no_check:
        check(runs)
    if opts.count:
        print(len(runs))
        return 0
    if opts.list:
        for i, run in enumerate(runs):
            print(f"{i} {run.name}")
        return 0
    if opts.submit:
        return submit(opts, own, extra, len(runs))
    selected = list(enumerate(runs)) if opts.index is None else [(opts.index, runs[opts.index])]
    if opts.dry_run:
        for _, run in selected:
            print(run.shell())
        return 0
    if opts.launcher == "slurm" and opts.index is None:
        raise SystemExit("one configuration per SLURM array task: submit the matrix with "
                         "jobs/submit_slurm.sh (sbatch --array=0-(N-1)), or pass --index I "
                         "(jobs/matrix.py --list numbers them)")
    failed = []
    for i, run in selected:
        print(f"[jobs] {i + 1}/{len(runs)} (index {i}) {run.name}\n[jobs] $ {run.shell()}",
              flush=True)
        start = time.time()
        rc = subprocess.call(run.argv, env={**os.environ, **run.env})
        print(f"[jobs] {run.name}: exit {rc} after {time.time() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(run.name)
            if not opts.keep_going:
                break
    if failed:
        print(f"[jobs] failed: {' '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
