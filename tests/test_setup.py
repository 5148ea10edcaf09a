"""What the set-up installs and leaves running.

``make test`` runs ``tools/setup.sh`` with the test machine's packages (``HVM_CLUSTER_TOOLS=1``:
an SSH server and SLURM for the emulated cluster and the single-node SLURM test) before this
suite, so by the time these tests run that set-up has happened on this machine. The tests
start their own daemons; the system's services must be left off. ``make run`` asks for none
of those packages.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SYSTEM_UNITS = ("ssh.service", "ssh.socket", "sshd.service", "slurmctld.service",
                "slurmd.service", "munge.service")


def _enabled_links() -> list[str]:
    """The unit links under /etc/systemd/system/*.wants that start one of SYSTEM_UNITS at
    boot (what ``systemctl enable`` writes; read here without systemd)."""
    root = Path("/etc/systemd/system")
    if not root.is_dir():
        return []
    return sorted(str(link) for wants in root.glob("*.wants") for link in wants.iterdir()
                  if link.name in SYSTEM_UNITS)


def _system_daemons() -> list[str]:
    """Running SSH, SLURM or munge daemons that read the system's configuration: the
    tests' own daemons are always given theirs with ``-f``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or not a process
            continue
        name = Path(args[0].decode(errors="replace")).name if args and args[0] else ""
        if name in ("sshd", "slurmctld", "slurmd", "munged") and b"-f" not in args:
            found.append(" ".join(a.decode(errors="replace") for a in args if a))
    return found


def test_the_test_machines_services_are_left_off():
    assert Path("/usr/sbin/sshd").exists() and Path("/usr/sbin/slurmctld").exists(), (
        "make test installs them")
    assert _enabled_links() == []
    assert _system_daemons() == []


NO_STARTS = REPO / "tools" / "no_service_starts.sh"
ASK = '"$HVM_POLICY_RC" ssh start; echo "answer $?"'


def _no_starts(policy: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(NO_STARTS), *command], text=True, capture_output=True,
                          env={**os.environ, "HVM_POLICY_RC": str(policy)}, timeout=60)


def test_installs_run_with_every_service_start_forbidden(tmp_path):
    """The install runs under a policy that forbids every start (101), and leaves no policy
    behind where the machine had none."""
    policy = tmp_path / "policy-rc.d"
    proc = _no_starts(policy, "sh", "-c", ASK)
    assert proc.returncode == 0 and "answer 101" in proc.stdout, proc.stderr
    assert not policy.exists()


def test_a_machines_own_policy_is_set_aside_and_put_back(tmp_path):
    """A policy that allows starts is not trusted during the install, and comes back as it
    was, mode included, also when the install fails."""
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 0\n")
    policy.chmod(0o750)
    proc = _no_starts(policy, "sh", "-c", ASK)
    assert "answer 101" in proc.stdout, proc.stderr
    assert policy.read_text() == "#!/bin/sh\nexit 0\n" and policy.stat().st_mode & 0o777 == 0o750
    failed = _no_starts(policy, "sh", "-c", ASK + "; exit 7")
    assert failed.returncode == 7 and "answer 101" in failed.stdout
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-rc.d"]


def test_a_policy_left_aside_by_a_killed_run_is_reported_not_overwritten(tmp_path):
    policy = tmp_path / "policy-rc.d"
    kept = tmp_path / "policy-rc.d.horovod-micro-kept"
    kept.write_text("#!/bin/sh\nexit 0\n")
    proc = _no_starts(policy, "true")
    assert proc.returncode == 1 and str(kept) in proc.stderr and "put it back" in proc.stderr
    assert kept.read_text() == "#!/bin/sh\nexit 0\n" and not policy.exists()


def _setup_trace(cluster_tools: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HVM_CLUSTER_TOOLS"}
    if cluster_tools is not None:
        env["HVM_CLUSTER_TOOLS"] = cluster_tools
    proc = subprocess.run(["bash", "-x", "tools/setup.sh"], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600, check=True)
    return proc.stderr


def test_make_run_asks_for_no_test_machine_package():
    """``make run``'s set-up (the variable unset) never looks at the SSH server or SLURM:
    its trace holds none of step 1c's checks; ``make test``'s does."""
    plain = _setup_trace(None)
    assert "/usr/sbin/sshd" not in plain and "slurmctld" not in plain
    assert "HVM_CLUSTER_TOOLS=1" not in subprocess.run(
        ["make", "-n", "run"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "HVM_CLUSTER_TOOLS=1" in subprocess.run(
        ["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    with_tools = _setup_trace("1")
    assert "/usr/sbin/sshd" in with_tools and "missing=()" in with_tools


def test_ci_checks_the_set_up_in_a_fresh_container():
    """What ``make run`` installs on a fresh Debian machine is checked for real, in a fresh
    container (docker/test-setup-packages.sh), by CI's ``make image-test``."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "make image-test" in ci
    recipe = subprocess.run(["make", "-n", "image-test"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    assert "docker/test-setup-packages.sh" in recipe
    script = (REPO / "docker" / "test-setup-packages.sh").read_text()
    for package in ("openssh-server", "slurm-wlm", "slurmctld", "slurmd"):
        assert package in script
