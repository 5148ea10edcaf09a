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


def test_the_test_machines_services_are_left_off():
    assert Path("/usr/sbin/sshd").exists() and Path("/usr/sbin/slurmctld").exists(), (
        "make test installs them")
    assert _enabled_links() == []


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
    assert "/usr/sbin/sshd" in with_tools and "systemctl is-enabled" in with_tools
