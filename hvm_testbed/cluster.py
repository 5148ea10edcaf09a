"""An emulated multi-host cluster on this machine: H hosts with sshd and one slow link each.

    python -m hvm_testbed.cluster up 2 --rate 1gbit   # hosts hvm1, hvm2, stays up
    python -m hvm_testbed.cluster up 3 --owner-pid $$ # torn down when the shell exits
    python -m hvm_testbed.cluster exec hvm1 horovodrun -np 2 -H hvm1:1,hvm2:1 \
        python train.py
    python -m hvm_testbed.cluster status
    python -m hvm_testbed.cluster down                # every cluster (or --id ID)

Why: the benchmarks need what a real cluster has and one loopback device has not: a
full-duplex link per host, so that each host's traffic queues on its own link, and ranks
started by ``horovodrun -H``/``--hostfile`` (or ``mpirun``) over ssh. Each host is:

* a network namespace with one veth ``eth0`` (198.18.0.K/24, RFC 2544's benchmark range)
  whose peer sits on a bridge in a separate "switch" namespace, so this machine's root
  namespace gets no address, link or route;
* rate-limited in both directions: a tbf qdisc on ``eth0`` (upload) and one on its peer in
  the switch (download), latency 1s, burst 1mb unless ``--burst`` sets another. A message
  that finds the bucket full passes at memory speed, so with 1 MB most of a sparse method's
  messages (under about 1 MB, after a quiet moment) cost no wire time; ``--burst 64kb``
  charges them (the veth's MTU is 1500, so every packet fits a small bucket);
* an ``sshd`` in that namespace and in its own UTS namespace (``hostname`` is ``hvmK``),
  with a throwaway host key and a throwaway client key under ``/run/hvm-cluster/ID``;
  ``/etc/netns/NS/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts``) resolves
  ``hvm1..hvmH``. Commands run in a host as ssh sessions there do: ``exec`` enters the
  namespaces of that host's sshd.

ssh without touching ``~/.ssh`` or ``/etc/ssh``: ``exec`` puts ``ID/bin`` first on ``PATH``;
its ``ssh`` runs ``/usr/bin/ssh -F ID/ssh_config``. horovodrun (Gloo and its ssh checks)
calls ``ssh`` from ``PATH``; Open MPI gets the same wrapper through
``OMPI_MCA_plm_rsh_agent`` (and no tree spawn, so only the launcher host runs ssh).

Teardown (``down``, the context manager's exit, or the watchdog): kill every process in
the host namespaces, delete the namespaces (their veths go with them), remove
``/etc/netns/NS`` and ``/run/hvm-cluster/ID``. With an owner (the Python API always; the
CLI with ``--owner-pid``), a watchdog process in its own session polls the owner and tears
the cluster down when it dies, even by SIGKILL. Needs root; otherwise it refuses.
Standard library only, so it also runs as a plain script.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_ROOT = Path("/run/hvm-cluster")
SUBNET = "198.18.0"  # RFC 2544 benchmark range, only ever on the emulated bridge
IFACE = "eth0"
TBF_LATENCY = ("latency", "1s")
#: tbf's bucket unless a cluster sets another (see the module docstring)
DEFAULT_BURST = "1mb"
SSH = "/usr/bin/ssh"
SSHD = "/usr/sbin/sshd"
MAX_HOSTS = 200


class ClusterError(RuntimeError):
    """The cluster cannot be built, found or used (the message says why)."""


def require_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError(
            "hvm_testbed.cluster needs root: it creates network namespaces, veth "
            "links and tc qdiscs and runs sshd in each host; run it as root (e.g. with sudo)")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (tells a live owner from a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass
class Cluster:
    """One emulated cluster of hosts ``hvm1..hvmH`` (root only): ``Cluster.up(3, "1gbit")``
    builds it and, used as a context manager, tears it down; :meth:`run` runs a command in a
    host. Its fields are what the cluster's ``state.json`` holds."""

    cid: str
    hosts: list[str]
    rate: str | None
    sshd_pids: dict[str, int] = field(default_factory=dict)
    owner: list[int] | None = None  # (pid, start time) of the process it lives for
    watchdog_pid: int | None = None
    burst: str = DEFAULT_BURST  # tbf's bucket on every link

    # -- names and addresses -------------------------------------------------------
    @property
    def workdir(self) -> Path:
        return STATE_ROOT / self.cid

    @property
    def switch(self) -> str:
        return f"hvmc-{self.cid}-sw"

    def netns(self, host: str) -> str:
        return f"hvmc-{self.cid}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def slots(self, per_host: int = 1, count: int | None = None) -> str:
        """``hvm1:1,hvm2:1,...`` for horovodrun ``-H`` (the first ``count`` hosts)."""
        return ",".join(f"{h}:{per_host}" for h in self.hosts[:count])

    def hostfile(self, path: Path, per_host: int = 1, count: int | None = None) -> Path:
        """Write a horovodrun/mpirun hostfile (``hvmK slots=N`` lines) to ``path``."""
        path.write_text("".join(f"{h} slots={per_host}\n" for h in self.hosts[:count]))
        return path

    # -- running commands in a host ------------------------------------------------
    def env(self, base: dict | None = None) -> dict[str, str]:
        """The environment of a command in a host: the ssh wrapper first on ``PATH``,
        Open MPI told to use it (from the launcher host only) and allowed to run as root."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.workdir / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
        env.update({"OMPI_MCA_plm_rsh_agent": str(self.workdir / "bin" / "ssh"),
                    "OMPI_MCA_plm_rsh_no_tree_spawn": "1",
                    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
        return env

    def command(self, host: str, argv: list[str], cwd: str | Path | None = None) -> list[str]:
        """``argv`` run inside ``host`` (its network, UTS and mount namespaces), in ``cwd``
        (default: the current directory; entering a mount namespace would reset it to /)."""
        if host not in self.hosts:
            raise ClusterError(f"no host {host!r} in cluster {self.cid} "
                               f"(hosts: {', '.join(self.hosts)})")
        return ["nsenter", "-t", str(self.sshd_pids[host]), "-n", "-u", "-m",
                f"--wd={Path(cwd or os.getcwd()).resolve()}", "--", *argv]

    def run(self, host: str, argv: list[str], timeout: float, *, env: dict | None = None,
            cwd: str | Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``host``, bounded (``hvm_testbed.launch.run_bounded``)."""
        try:
            from hvm_testbed.launch import run_bounded
        except ImportError:  # run as a script (python hvm_testbed/cluster.py): its sibling
            from launch import run_bounded
        return run_bounded(self.command(host, argv, cwd), timeout, base_env=self.env(), env=env,
                           cwd=cwd, check=check, label=f"[{host}] {' '.join(argv)}")

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in ``host`` without waiting (its own session)."""
        kwargs.setdefault("env", self.env())
        return subprocess.Popen(self.command(host, argv, kwargs.get("cwd")),
                                start_new_session=True, **kwargs)

    # -- life cycle ----------------------------------------------------------------
    @classmethod
    def up(cls, n_hosts: int, rate: str | None = "1gbit", *, owner_pid: int | None = None,
           watchdog: bool = True, burst: str = DEFAULT_BURST) -> Cluster:
        """Build ``n_hosts`` hosts; tied to ``owner_pid`` (default: this process)."""
        require_root()
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ClusterError(f"the number of hosts must be 1..{MAX_HOSTS}, got {n_hosts}")
        for tool in ("ip", "tc", "nsenter", "unshare", "ssh-keygen", SSH, SSHD):
            if shutil.which(tool) is None:
                raise ClusterError(f"{tool} not found: install iproute2, util-linux and "
                                   "openssh-server/-client (tools/setup.sh does)")
        owner_pid = os.getpid() if owner_pid is None else owner_pid
        start = _start_time(owner_pid)
        if start is None:
            raise ClusterError(f"owner pid {owner_pid} does not exist")
        cluster = cls(secrets.token_hex(3), [f"hvm{k}" for k in range(1, n_hosts + 1)],
                      rate, owner=[owner_pid, start] if watchdog else None, burst=burst)
        STATE_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
        cluster.workdir.mkdir(mode=0o700)
        cluster.save()  # first, so that a failure below still tears down what was made
        try:
            if watchdog:
                cluster.watchdog_pid = _spawn_watchdog(cluster)
                cluster.save()
            cluster._build_network()
            cluster._write_ssh_files()
            for host in cluster.hosts:
                cluster.sshd_pids[host] = cluster._start_sshd(host)
            cluster.save()
            cluster._wait_for_sshd()
        except BaseException:
            teardown(cluster.cid)
            raise
        return cluster

    def down(self) -> None:
        teardown(self.cid)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def save(self) -> None:
        tmp = self.workdir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.workdir / "state.json")

    @classmethod
    def load(cls, cid: str) -> Cluster:
        try:
            return cls(**json.loads((STATE_ROOT / cid / "state.json").read_text()))
        except FileNotFoundError:
            raise ClusterError(f"no cluster {cid!r} is up") from None

    # -- building ------------------------------------------------------------------
    def _build_network(self) -> None:
        sw = self.switch
        _sh("ip", "netns", "add", sw)
        _sh("ip", "-n", sw, "link", "set", "lo", "up")
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(h)} {h}\n" for h in self.hosts)
        for k, host in enumerate(self.hosts, 1):
            ns = self.netns(host)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            port = f"p{k}"
            _sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", IFACE,
                "netns", ns)
            _sh("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", IFACE)
            _sh("ip", "-n", ns, "link", "set", IFACE, "up")
            if self.rate:  # both directions: host -> switch on eth0, switch -> host on pK
                _sh("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", "tbf", "rate",
                    self.rate, "burst", self.burst, *TBF_LATENCY)
                _sh("tc", "-n", sw, "qdisc", "add", "dev", port, "root", "tbf", "rate",
                    self.rate, "burst", self.burst, *TBF_LATENCY)

    def _write_ssh_files(self) -> None:
        wd = self.workdir
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hvm-cluster-{self.cid}",
            "-f", str(wd / "id_client"))
        shutil.copy(wd / "id_client.pub", wd / "authorized_keys")
        known = []
        for host in self.hosts:
            key = wd / f"host_{host}"
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host, "-f", str(key))
            pub = " ".join(Path(f"{key}.pub").read_text().split()[:2])
            known.append(f"{host},{self.address(host)} {pub}\n")
            (wd / f"sshd_{host}.conf").write_text(
                f"ListenAddress {self.address(host)}\nPort 22\nHostKey {key}\n"
                f"PidFile none\nAuthorizedKeysFile {wd / 'authorized_keys'}\n"
                "StrictModes no\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                "X11Forwarding no\nPrintMotd no\nMaxStartups 100:30:200\nMaxSessions 100\n"
                "LogLevel INFO\n")
        (wd / "known_hosts").write_text("".join(known))
        user = os.environ.get("USER") or "root"
        (wd / "ssh_config").write_text(
            f"Host *\n  User {user}\n  IdentityFile {wd / 'id_client'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {wd / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n"
            "  ConnectTimeout 20\n  ServerAliveInterval 30\n")
        (wd / "bin").mkdir()
        wrapper = wd / "bin" / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {SSH} -F {wd / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)

    def _start_sshd(self, host: str) -> int:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        log = open(self.workdir / f"sshd_{host}.log", "ab")  # noqa: SIM115  (kept by sshd)
        # ip netns exec and unshare exec (no fork): the pid is sshd's, and sshd holds the
        # host's namespaces (network, UTS with its hostname, mount with /etc/hosts).
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns(host), "unshare", "--uts", "--", "sh", "-c",
             f'hostname {host} && exec {SSHD} -D -e -f "$0"',
             str(self.workdir / f"sshd_{host}.conf")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        return proc.pid

    def _wait_for_sshd(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        pending = set(self.hosts)
        while pending:
            for host in sorted(pending):
                log = (self.workdir / f"sshd_{host}.log").read_text(errors="replace")
                if "Server listening" in log:
                    pending.discard(host)
                elif _start_time(self.sshd_pids[host]) is None or time.monotonic() > deadline:
                    raise ClusterError(f"sshd of {host} did not start: {log.strip()[-2000:]}")
            time.sleep(0.1)


# -- teardown and watchdog -----------------------------------------------------------
def _lock():
    STATE_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle = open(STATE_ROOT / ".lock", "w")  # noqa: SIM115
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def _netns_pids(ns: str) -> list[int]:
    proc = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _kill_all(pids: list[int], grace: float = 3.0) -> None:
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":  # our own child: reap it
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return True


def teardown(cid: str) -> bool:
    """Remove cluster ``cid`` entirely; False when it was not there. Idempotent."""
    with _lock():
        try:
            cluster = Cluster.load(cid)
        except (ClusterError, json.JSONDecodeError, TypeError):
            cluster = Cluster(cid, [], None)  # a half-written state: remove by name
        existing = set(_sh("ip", "netns", "list").stdout.split())
        prefix = f"hvmc-{cid}-"
        spaces = sorted(ns for ns in existing if ns.startswith(prefix))
        pids = [p for ns in spaces for p in _netns_pids(ns)]
        _kill_all(pids + [p for p in cluster.sshd_pids.values() if _alive(p)])
        for ns in spaces:
            _sh("ip", "netns", "del", ns, check=False)
        for etc in Path("/etc/netns").glob(f"{prefix}*"):
            shutil.rmtree(etc, ignore_errors=True)
        found = bool(spaces) or cluster.workdir.exists()
        shutil.rmtree(cluster.workdir, ignore_errors=True)
    return found


def _spawn_watchdog(cluster: Cluster) -> int:
    log = open(cluster.workdir / "watchdog.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "_watchdog", cluster.cid,
         str(cluster.owner[0]), str(cluster.owner[1])],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    log.close()
    return proc.pid


def watchdog(cid: str, owner_pid: int, owner_start: int, poll: float = 0.5) -> None:
    """Poll the owner; when it is gone (or its pid reused), tear the cluster down."""
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the owner's end or the cluster's ends it
    while (STATE_ROOT / cid).exists():
        if _start_time(owner_pid) != owner_start:
            teardown(cid)
            return
        time.sleep(poll)


def clusters() -> list[str]:
    return sorted(p.name for p in STATE_ROOT.glob("*") if (p / "state.json").exists()) \
        if STATE_ROOT.exists() else []


def _pick(cid: str | None) -> Cluster:
    if cid:
        return Cluster.load(cid)
    ids = clusters()
    if len(ids) != 1:
        raise ClusterError("no cluster is up" if not ids else
                           f"several clusters are up ({', '.join(ids)}): pass --id")
    return Cluster.load(ids[0])


# -- command line --------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvm_testbed.cluster",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="build H hosts hvm1..hvmH; prints the cluster id")
    p_up.add_argument("hosts", type=int)
    p_up.add_argument("--rate", default="1gbit",
                      help="tc rate per host and direction (100mbit, 1gbit) or none")
    p_up.add_argument("--burst", default=DEFAULT_BURST,
                      help="tbf bucket per link (default 1mb; 64kb charges small messages "
                      "their wire time)")
    p_up.add_argument("--owner-pid", type=int,
                      help="tear down when this process exits (default: stay up until down)")
    p_down = sub.add_parser("down", help="tear down a cluster (default: all)")
    p_down.add_argument("--id")
    sub.add_parser("status", help="the clusters that are up")
    p_exec = sub.add_parser("exec", help="run a command in a host")
    p_exec.add_argument("--id")
    p_exec.add_argument("host")
    p_exec.add_argument("argv", nargs=argparse.REMAINDER)
    p_wd = sub.add_parser("_watchdog")
    p_wd.add_argument("cid")
    p_wd.add_argument("owner_pid", type=int)
    p_wd.add_argument("owner_start", type=int)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "_watchdog":
            watchdog(args.cid, args.owner_pid, args.owner_start)
            return 0
        if args.cmd == "status":
            for cid in clusters():
                c = Cluster.load(cid)
                alive = [h for h in c.hosts if _alive(c.sshd_pids.get(h, -1))]
                link = f"{c.rate} (tbf burst {c.burst})" if c.rate else "unlimited"
                print(f"{cid}: {len(c.hosts)} hosts, rate {link}, "
                      f"sshd up on {len(alive)}/{len(c.hosts)}, owner "
                      f"{c.owner[0] if c.owner else 'none (until down)'}")
                for h in c.hosts:
                    print(f"  {h} {c.address(h)} netns {c.netns(h)}")
            return 0
        require_root()
        if args.cmd == "up":
            rate = None if args.rate == "none" else args.rate
            c = Cluster.up(args.hosts, rate, owner_pid=args.owner_pid,
                           watchdog=args.owner_pid is not None, burst=args.burst)
            print(c.cid)
            return 0
        if args.cmd == "down":
            for cid in [args.id] if args.id else clusters():
                if not teardown(cid):
                    raise ClusterError(f"no cluster {cid!r} is up")
            return 0
        c = _pick(args.id)
        if not args.argv:
            raise ClusterError("exec needs a command")
        cmd = c.command(args.host, args.argv)
        os.execvpe(cmd[0], cmd, c.env())
    except ClusterError as error:
        print(f"hvm_testbed.cluster: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
