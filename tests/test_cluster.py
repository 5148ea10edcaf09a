"""hvm_testbed.cluster: emulated hosts that horovodrun reaches over ssh, with real
rate limits.

Real Horovod over real namespaces, veths, tbf and sshd: 2-rank allreduces through
``horovodrun -H`` and ``--hostfile`` on Gloo and MPI (their traffic crosses the emulated
links), a TCP stream's rate against the configured one, what tbf's bucket lets through
free, teardown leaving nothing (also
after a SIGKILL of the owner, through the watchdog, and from a new process with
``down``), and a clear refusal without root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hvm_testbed.cluster import STATE_ROOT, Cluster, ClusterError
from hvm_testbed.launch import horovodrun

REPO = Path(__file__).resolve().parent.parent
CLUSTER_PY = REPO / "hvm_testbed" / "cluster.py"
ALLREDUCE = REPO / "tests" / "scripts" / "cluster_allreduce.py"
RATE_TOOL = REPO / "bench" / "link_rate.py"
RATE = 40e6  # bits/s: "40mbit" below


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in out.stdout.splitlines()}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_gone(c: Cluster, pids: list[int]) -> None:
    """Nothing of cluster ``c`` is left: namespaces, hosts files, state, processes."""
    assert not any(ns.startswith(f"hvmc-{c.cid}-") for ns in netns_names())
    assert not list(Path("/etc/netns").glob(f"hvmc-{c.cid}-*"))
    assert not (STATE_ROOT / c.cid).exists()
    assert not [p for p in pids if alive(p)], "processes of the cluster survived"


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate`` (a hang guard for the watchdog, not a speed bound)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster():
    links = root_links()
    with Cluster.up(2, rate="40mbit") as c:
        yield c
    assert_gone(c, list(c.sshd_pids.values()))
    assert root_links() == links, "the root namespace's links changed"


def tc_bytes(c: Cluster) -> int:
    """Bytes the switch has sent to all hosts (its tbf qdiscs' counters)."""
    total = 0
    for k in range(1, len(c.hosts) + 1):
        out = subprocess.run(["tc", "-s", "-n", c.switch, "qdisc", "show", "dev", f"p{k}"],
                             capture_output=True, text=True, check=True).stdout
        total += sum(int(n) for n in re.findall(r"Sent (\d+) bytes", out))
    return total


@pytest.mark.parametrize("backend,hosts_by", [("gloo", "-H"), ("mpi", "-H"),
                                              ("gloo", "--hostfile"), ("mpi", "--hostfile")])
def test_two_rank_allreduce_across_hosts(cluster, tmp_path, backend, hosts_by):
    if hosts_by == "-H":
        hosts = ["-H", cluster.slots()]
    else:
        hosts = ["--hostfile", str(cluster.hostfile(tmp_path / "hosts"))]
    cmd = [horovodrun(), "-np", "2", *hosts, f"--{backend}", "--network-interfaces", "eth0",
           sys.executable, str(ALLREDUCE)]
    before = tc_bytes(cluster)
    out = cluster.run("hvm1", cmd, 240, cwd=tmp_path).stdout
    untagged = re.sub(r"\[[\d,]+\]<std(out|err)>:", "", out)  # horovodrun's/mpirun's tags
    results = sorted(line.split("RESULT ")[1].split() for line in untagged.splitlines()
                     if "RESULT " in line)
    assert [r[:3] for r in results] == [["0", "2", "hvm1"], ["1", "2", "hvm2"]], out
    for r in results:  # 1 + 2 in every one of the 2**20 elements
        assert float(r[3]) == float(r[4]) == 3.0, out
    # The 4 MB tensor's reduction crossed the emulated links (at least a quarter of it).
    assert tc_bytes(cluster) - before > 1 << 20


def test_hosts_resolve_and_ssh_needs_no_user_files(cluster):
    home_ssh = Path.home() / ".ssh"
    existed = home_ssh.exists()
    out = cluster.run("hvm1", ["sh", "-c", "hostname; getent hosts hvm2; ssh hvm2 hostname"],
                      60).stdout.split()
    assert out == ["hvm1", "198.18.0.2", "hvm2", "hvm2"]
    assert home_ssh.exists() == existed


def qdiscs(c: Cluster, host: str) -> list[str]:
    """``tc qdisc show`` of both ends of ``host``'s link: its ``eth0`` and the switch's port."""
    return [subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                           text=True, check=True).stdout
            for ns, dev in [(c.netns(host), "eth0"), (c.switch, f"p{c.hosts.index(host) + 1}")]]


def stream_rate(c: Cluster, src: str, dst: str, total: int, skip: int = 0,
                settle: float = 0.0) -> float:
    """bit/s of a ``total``-byte TCP stream from ``src`` to ``dst``, measured at the
    receiver past its first ``skip`` bytes (``bench/link_rate.py``'s two ends), the sender
    starting ``settle`` seconds after the receiver listens."""
    addr = c.address(dst)
    receiver = c.popen(dst, [sys.executable, str(RATE_TOOL), "recv", addr, "5001", str(skip),
                             str(total)], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "LISTENING"
        time.sleep(settle)
        c.run(src, [sys.executable, str(RATE_TOOL), "send", addr, "5001", str(total)], 120)
        out, _ = receiver.communicate(timeout=120)
    finally:
        receiver.kill()
    return float(out.split()[1])


@pytest.mark.parametrize("src,dst", [("hvm2", "hvm1"), ("hvm1", "hvm2")])
def test_link_rate_is_the_configured_rate(cluster, src, dst):
    for qdisc in qdiscs(cluster, dst):
        assert "tbf" in qdisc and "rate 40Mbit" in qdisc, qdisc
    rate = stream_rate(cluster, src, dst, 8 << 20, skip=2 << 20)
    # 6 MB past the burst at 40 Mbit/s: the limit holds and the link is not starved.
    assert 0.5 * RATE < rate < 1.25 * RATE, rate


def test_a_small_bucket_charges_a_small_message_its_wire_time(cluster):
    """tbf's bucket: with the default 1 MB a 512 KB message after a quiet moment passes far
    faster than the link's rate (sparse methods' messages are that size: the benchmarks say
    so); ``burst="64kb"`` holds it to the rate. The sender waits 1 s, in which 40 Mbit/s
    refills a 1 MB bucket five times over."""
    free = stream_rate(cluster, "hvm2", "hvm1", 512 << 10, settle=1.0)
    links = root_links()
    with Cluster.up(2, rate="40mbit", burst="64kb") as small:
        for qdisc in qdiscs(small, "hvm1"):
            assert "rate 40Mbit burst 64Kb" in qdisc, qdisc
        charged = stream_rate(small, "hvm2", "hvm1", 512 << 10, settle=1.0)
        status = subprocess.run([sys.executable, str(CLUSTER_PY), "status"],
                                capture_output=True, text=True, check=True).stdout
        assert f"{small.cid}: 2 hosts, rate 40mbit (tbf burst 64kb), sshd up" in status
    assert_gone(small, list(small.sshd_pids.values()))
    assert root_links() == links
    assert free > 3 * RATE, free
    assert 0.5 * RATE < charged < 1.25 * RATE, charged


def test_link_rate_benchmark_measures_links_with_the_bucket_it_is_given():
    """``bench.link_rate --burst``: its own cluster, built with that tbf bucket, measures each
    scenario at the rate (one stream and both directions at once each near the rate, two
    senders into one host sharing it: neither above the rate, the slower near half; they
    start a moment apart, so the faster may have had the link alone for a while), says which
    bucket it used, and leaves nothing."""
    links = root_links()
    out = subprocess.run([sys.executable, "-m", "bench.link_rate", "--rate", "40mbit",
                          "--burst", "64kb", "--megabytes", "8"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rate"] == "40mbit" and result["burst"] == "64kb"
    rates = {name: [r * 1e6 for r in got] for name, got in result["mbit_per_s"].items()}
    assert len(rates["one stream hvm2->hvm1"]) == 1 and len(rates["full duplex hvm1<->hvm2"]) == 2
    for rate in rates["one stream hvm2->hvm1"] + rates["full duplex hvm1<->hvm2"]:
        assert 0.5 * RATE < rate < 1.25 * RATE, rates
    shared = rates["hvm2+hvm3 -> hvm1"]
    assert len(shared) == 2 and max(shared) < 1.25 * RATE, rates
    assert 0.2 * RATE < min(shared) < 0.65 * RATE, rates
    assert root_links() == links


def test_cli_up_status_exec_down_from_new_processes():
    cli = [sys.executable, str(CLUSTER_PY)]
    cid = subprocess.run([*cli, "up", "2", "--rate", "none"], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    c = Cluster.load(cid)
    try:
        status = subprocess.run([*cli, "status"], capture_output=True, text=True,
                                check=True).stdout
        assert f"{cid}: 2 hosts, rate unlimited, sshd up on 2/2" in status
        hostname = subprocess.run([*cli, "exec", "--id", cid, "hvm2", "hostname"],
                                  capture_output=True, text=True, check=True).stdout
        assert hostname.strip() == "hvm2"
        # A process left running in a host goes with the cluster.
        sleeper = c.popen("hvm2", ["sleep", "600"])
        bad = subprocess.run([*cli, "exec", "--id", cid, "hvm9", "true"],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and "no host 'hvm9'" in bad.stderr
    finally:
        subprocess.run([*cli, "down", "--id", cid], check=True, timeout=120)
    sleeper.wait(timeout=30)
    assert_gone(c, [*c.sshd_pids.values(), sleeper.pid])
    again = subprocess.run([*cli, "down", "--id", cid], capture_output=True, text=True)
    assert again.returncode == 2 and "no cluster" in again.stderr


def test_watchdog_tears_down_after_sigkill_of_the_owner():
    script = ("import sys, time\nfrom hvm_testbed.cluster import Cluster\n"
              "c = Cluster.up(2, rate='1gbit')\nprint(c.cid, flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        cid = owner.stdout.readline().strip()
        c = Cluster.load(cid)
        assert {c.netns(h) for h in c.hosts} <= netns_names()
        assert all(alive(p) for p in c.sshd_pids.values())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    wait_for(lambda: not (STATE_ROOT / cid).exists(), "the watchdog's teardown")
    assert_gone(c, [*c.sshd_pids.values(), c.watchdog_pid])


def test_bad_host_count_is_refused():
    with pytest.raises(ClusterError, match="number of hosts"):
        Cluster.up(0)


def test_refuses_without_root():
    runuser = shutil.which("setpriv")
    assert runuser, "setpriv (util-linux) is needed to drop root"
    folder = Path(tempfile.mkdtemp(prefix="hvm-cluster-nobody-"))
    try:
        folder.chmod(0o755)
        script = Path(shutil.copy(CLUSTER_PY, folder / "cluster.py"))
        before = json.dumps(sorted(netns_names()))
        proc = subprocess.run([runuser, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                               "/usr/bin/python3", str(script), "up", "2"],
                              capture_output=True, text=True, timeout=60, cwd=folder)
    finally:
        shutil.rmtree(folder)
    assert proc.returncode == 2, proc.stderr
    assert "hvm_testbed.cluster needs root" in proc.stderr
    assert json.dumps(sorted(netns_names())) == before
