"""A simulated cluster of real nodes: one real OpenSSH sshd per node, each with its own address.

Used by the tests (through the `sim_cluster` fixture in conftest.py) and by bench/.

Two modes, picked automatically:
- ``netns`` (root with ``ip netns``): one network namespace per node, joined by veth pairs to a
  bridge in the root namespace. Inside its namespace every node has ``lo`` up and one interface
  named ``eth0`` (as on a COS GPU node), with its own address on a private /24; sshd listens on
  that address, port 22. The bridge holds the gateway address, so the launcher (in the root
  namespace) reaches every node, and nodes reach each other.
- ``loopback`` (otherwise): one sshd per node on 127.0.0.N, all on one free high port.

``bare=True`` (netns mode only) makes each node what `pulumi up` gives: its sshd runs in a mount
namespace of its own (``unshare --mount``, private propagation) entered with ``nsenter --net``
(not ``ip netns exec``, which remounts /sys and so leaves no cgroup mounts for a container
runtime), where /tmp and root's home are directories of the node's own (kept across a
`power_off`/`restart_sshd`, as a disk is), and this checkout, every venv, pip's configuration
files and the local wheel stores it names are covered by empty read-only mounts. Sessions get
sshd's own environment (no PIP_*), and the only python is the system's /usr/bin/python3 (with
venv). `index=WHEELS` adds one more namespace on the bridge serving WHEELS as a PEP 503 "simple"
index over HTTP (`package_index` is its URL): the cluster's package repository
(tests/simindex.py downloads the wheels once per machine). Without `bare`, nodes share this
machine's disk: its venv, checkout and pip configuration (the mode most tests use).

Each node has its own generated host key and the cluster writes a known_hosts file with them, so
the client verifies hosts for real (StrictHostKeyChecking=yes, never "no").

Every process a node's sshd starts for a session carries ``GPUFLEET_SIMNODE=<cluster>-<node>`` in
its environment (sshd's SetEnv), which is how `processes()` finds what a launch left behind
without matching on names. `stop()` kills those, every sshd, and removes every namespace, link
and the bridge, and is safe to call twice.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SimCluster", "SimNode", "netns_available", "leftovers", "hidden_paths", "bare_node_setup", "make_accounts"]

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
TAG = "GPUFLEET_SIMNODE"
NAME_PREFIX = "gfs"  # every namespace, bridge and veth we create starts with this
# A bare node's own sshd files, mounted here inside its namespace (an empty directory outside).
BARE_RUN = "/run/gpufleet-simnode"
# Where a bare node's whole disk is bound while its namespace is built (nothing there afterwards).
BARE_DISK = "/run/gpufleet-simnode-disk"
HOME = "/root"  # the sessions' user is root (User=root in ssh_options)
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's and Ubuntu's, with venv (python3-venv)
HOLDS_DIR = "/run/gpufleet-holds"  # gpufleet.contracts.HOLDS_DIR (this module imports no gpufleet)
LOCAL_SSD = "/mnt/localssd"  # an accounts cluster's local SSD (gpufleet.contracts.LOCAL_SSD_MOUNT, Ubuntu)
INDEX_PORT = 8080
REPO = Path(__file__).resolve().parent.parent


def hidden_paths(repo: Path = REPO) -> list[Path]:
    """What a bare node must not see: the checkout (this one unless told), every venv and python
    this process knows of (sys.prefix, sys.base_prefix), pip's configuration files and the local
    wheel stores they name (find-links and file:// indexes, from `pip config list`)."""
    out = {repo, Path(sys.prefix), Path(sys.base_prefix)}
    out |= {Path(p) for p in ("/etc/pip.conf", "/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more")}
    r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.split(".")[-1] in ("find-links", "extra-index-url", "index-url", "constraint", "requirement"):
            for item in value.strip("'\"").split():
                item = item.removeprefix("file://")
                if item.startswith("/"):
                    path = Path(item)
                    # A file:// index's "simple" directory: hide the store it lies in.
                    out.add(path.parent if path.name == "simple" else path)
    # Under root's home (mounted over), /usr (the system python's own) or a path already covered:
    # nothing to cover.
    return sorted(
        p
        for p in out
        if Path(HOME) not in [p, *p.parents] and not str(p).startswith("/usr") and not out & set(p.parents)
    )


def bare_node_setup(
    node_dir: Path, hidden: list[Path], first: tuple[str, ...] | list[str] = (), last: tuple[str, ...] | list[str] = ()
) -> str:
    """Make node_dir a bare node's disk (its home, its /tmp, its sshd files) and return the shell
    lines that build its mount namespace from it, run as root inside that namespace.

    Order matters wherever the checkout and node_dir lie (a clone under /tmp, a cluster's workdir
    inside the checkout): node_dir is first bound at BARE_DISK, so what is hidden next cannot take
    it away; every hidden path is covered while this machine's /tmp and home are still in place,
    so each exists to be mounted over; only then do the node's own /tmp and home go over this
    machine's (covering whatever of the hidden lay there), and BARE_DISK is let go. `first`: lines
    run before all that (a /run of the node's own, in which the mount points are made again);
    `last`: lines run while BARE_DISK is still there (mounts of more of the node's disk)."""
    for sub in ("home/.ssh", "tmp", "sshd"):
        (node_dir / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(node_dir / "tmp", 0o1777)
    for mount_point in (BARE_DISK, BARE_RUN):
        Path(mount_point).mkdir(parents=True, exist_ok=True)
    q = shlex.quote
    lines = [
        "set -e",
        *first,
        f"mount --bind {q(str(node_dir))} {BARE_DISK}",
        f"mount --bind {BARE_DISK}/sshd {BARE_RUN}",
    ]
    for path in hidden:
        if path.is_dir():
            lines.append(f"mount -t tmpfs -o ro,size=4k gfs-hidden {q(str(path))}")
        elif path.exists():
            lines.append(f"mount --bind /dev/null {q(str(path))}")
    lines += [
        f"mount --bind {BARE_DISK}/home {HOME}",
        f"mount --bind {BARE_DISK}/tmp /tmp",
        f"mount --bind {BARE_RUN}/hosts /etc/hosts",
        f"mount --bind {BARE_RUN}/resolv.conf /etc/resolv.conf",
        *last,
        f"umount {BARE_DISK}",
    ]
    return "\n".join(lines) + "\n"


def netns_available() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    probe = f"{NAME_PREFIX}probe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _run(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


def _tagged_pids(value_prefix: str) -> list[int]:
    """Pids whose initial environment has GPUFLEET_SIMNODE starting with value_prefix."""
    needle = f"{TAG}={value_prefix}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if any(var.startswith(needle) for var in env.split(b"\0")):
            pids.append(int(entry))
    return pids


def leftovers(cluster_id: str = "") -> dict[str, list[str]]:
    """What SimClusters (the one with `cluster_id`, or any) left on this machine: namespaces,
    links, sshd processes and session processes."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    sshds = subprocess.run(["pgrep", "-af", "gpufleet-sshd-"], capture_output=True, text=True).stdout
    mine = NAME_PREFIX + cluster_id
    return {
        "namespaces": [l.split()[0] for l in ns if l.startswith(mine)],
        "links": [
            l.split(":")[1].strip().split("@")[0]
            for l in links.splitlines()
            if l.split(":")[1].strip().startswith(mine)
        ],
        "sshd": [l for l in sshds.splitlines() if f"gpufleet-sshd-{cluster_id}" in l],
        "tagged": [str(p) for p in _tagged_pids(f"{cluster_id}-" if cluster_id else "") if _alive(p)],
    }


@dataclass
class SimNode:
    index: int
    address: str
    port: int
    iface: str  # the node's interface name, as the node sees it
    netns: str | None
    host_key_pub: str = ""
    sshd: subprocess.Popen | None = field(default=None, repr=False)
    host_link: str | None = None  # root-namespace end of the veth (netns mode)


class SimCluster:
    """Start `n` real sshd nodes. Use as a context manager, or call start()/stop()."""

    def __init__(
        self,
        n: int,
        mode: str | None = None,
        workdir: Path | None = None,
        node_env: dict[int, dict[str, str]] | None = None,
        hostnames: dict[int, str] | None = None,
        controller: bool = False,
        bare: bool = False,
        index: Path | None = None,
        accounts: tuple[str, ...] = (),
        own_pids: bool = False,
    ):
        """`node_env` adds environment variables to every session of the given nodes (sshd
        SetEnv): e.g. {2: {"LD_PRELOAD": libfaketime, "FAKETIME": "+600"}} skews node 2's clock;
        {0: {"HOME": d}} gives node 0 a home of its own (created, with its ~/.ssh/authorized_keys
        honoured by that node's sshd), so nothing passes by reading the client's files.

        `hostnames` gives the listed nodes a hostname of their own: their sshd starts in a new
        UTS namespace (`unshare --uts`), so `hostname` in every session there reports it. Nodes
        not listed share this machine's hostname, as before.

        `controller`: one more host, not a node, after the `n` nodes (`nodes[n]`, also
        `controller`): its own sshd, namespace and host key like a node's, and the hostfile names
        it on a `controller HOST` line, so detached jobs' controllers run there.

        `bare`: nodes that share nothing with this machine but the system python (module
        docstring); `index`: a directory of wheels served as the cluster's package index.

        `accounts` (bare only): users of this machine (made with useradd when missing:
        `make_accounts`) who log in to every node as themselves, as OS Login's accounts do: each
        node's /home is its own, holding each account's home (mode 0755, Debian's default), and
        each node has its own local SSD at LOCAL_SSD (a tmpfs, root's, mode 1777, as the startup
        script leaves the RAID) and its own /run, holding the holds registry HOLDS_DIR (both seen
        only from inside the node: `exec`). `account_flags(name)`:
        `launch` flags that connect as that account.

        `own_pids` (bare only): each node's sshd also starts in a PID namespace of its own
        (`unshare --pid --fork --mount-proc`, sshd its init), so a node's /proc lists its own
        processes only, as a real VM's does: what a node program scans there (a stop's reap of
        what carries its run's token) costs what it costs on a real node, not a sweep of every
        simulated node's processes. The pids the nodes report are then their own namespace's;
        this machine (`processes()`, `exec`) still sees every process under its pid here."""
        if n < 1:
            raise ValueError("a simulated cluster needs at least one node")
        self.bare = bare
        self.accounts = tuple(accounts)
        self.own_pids = own_pids
        if own_pids and not bare:
            raise RuntimeError("own_pids needs bare nodes (each node's own mount namespace holds its /proc)")
        if self.accounts and not bare:
            raise RuntimeError("accounts need bare nodes (each node's own /home and local SSD)")
        if self.accounts:
            make_accounts(self.accounts)
        self.index_wheels = index
        self._index_proc: subprocess.Popen | None = None
        self._index_ns: str | None = None
        self._index_link = ""
        self.n = n
        self.with_controller = controller
        self.mode = mode or ("netns" if netns_available() else "loopback")
        if (bare or index) and self.mode != "netns":
            raise RuntimeError("bare nodes and the package index need netns mode (root and ip netns)")
        self.id = f"{random.randrange(16**4):04x}"
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix=f"gpufleet-sim-{self.id}-"))
        self.nodes: list[SimNode] = []
        self.node_env = node_env or {}
        self.hostnames = hostnames or {}
        for i, name in self.hostnames.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}", name):
                raise ValueError(f"hostname {name!r} for node {i} is not a valid host name")
        self.bridge = f"{NAME_PREFIX}{self.id}br"
        # One /24 per cluster so clusters started by concurrent test runs never overlap.
        r = random.randrange(200 * 250)
        self.subnet = f"10.{50 + r // 250}.{r % 250}"
        self.gateway = f"{self.subnet}.1"
        self._started = False

    # ---- what the launcher consumes ----------------------------------------------------

    @property
    def hostfile(self) -> Path:
        return self.dir / "hostfile"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def client_key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def launch_flags(self) -> list[str]:
        """`ssh_options` as `launch` flags (--ssh-key, --ssh-option)."""
        out, opts = [], list(self.ssh_options)
        while opts:
            flag, value = opts.pop(0), opts.pop(0)
            out += ["--ssh-key", value] if flag == "-i" else ["--ssh-option", value]
        return out

    def account_flags(self, name: str) -> list[str]:
        """`launch_flags` for connecting as account `name` (SimCluster(..., accounts=...))."""
        if name not in self.accounts:
            raise ValueError(f"{name} is not one of this cluster's accounts {self.accounts}")
        return [f"User={name}" if f == "User=root" else f for f in self.launch_flags]

    @property
    def ssh_options(self) -> list[str]:
        opts = [
            "-i",
            str(self.client_key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "User=root",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
        ]
        if self.mode == "loopback":
            opts += ["-o", f"Port={self.nodes[0].port}"]
        return opts

    @property
    def addresses(self) -> list[str]:
        """The nodes' addresses (not the controller host's)."""
        return [n.address for n in self.nodes[: self.n]]

    @property
    def controller(self) -> SimNode:
        """The controller host (SimCluster(..., controller=True))."""
        if not self.with_controller:
            raise RuntimeError("this cluster has no controller host: SimCluster(n, controller=True)")
        return self.nodes[self.n]

    # ---- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> "SimCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "SimCluster":
        self._started = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        self.dir.mkdir(parents=True, exist_ok=True)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpufleet-sim", "-f", str(self.client_key))
        (self.dir / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        if self.mode == "netns":
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            port = 22
        else:
            port = self._free_port([f"127.0.0.{i + 2}" for i in range(self._hosts)])
        for i in range(self._hosts):
            self.nodes.append(self._make_node(i, port))
        if self.mode == "netns":
            self._write_name_service()
        if self.index_wheels is not None:
            self._start_index()
        lines = []
        for node in self.nodes:
            self._start_sshd(node)
            key_type, key_b64 = node.host_key_pub.split()[:2]
            host = node.address if node.port == 22 else f"[{node.address}]:{node.port}"
            lines.append(f"{host} {key_type} {key_b64}")
        self.known_hosts.write_text("\n".join(lines) + "\n")
        hostfile = "".join(f"{n.address}\n" for n in self.nodes[: self.n])
        if self.with_controller:
            hostfile += f"controller {self.controller.address}\n"
        self.hostfile.write_text(hostfile)
        for node in self.nodes:
            self._wait_listening(node)

    @property
    def _hosts(self) -> int:
        return self.n + (1 if self.with_controller else 0)

    def _make_node(self, i: int, port: int) -> SimNode:
        if self.mode == "netns":
            ns = f"{NAME_PREFIX}{self.id}n{i}"
            host_link = f"{NAME_PREFIX}{self.id}v{i}"
            address = f"{self.subnet}.{i + 2}"
            _run("ip", "netns", "add", ns)
            node = SimNode(i, address, port, "eth0", ns, host_link=host_link)
            _run("ip", "link", "add", host_link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", host_link, "master", self.bridge)
            _run("ip", "link", "set", host_link, "up")
            nsx = ("ip", "netns", "exec", ns)
            _run(*nsx, "ip", "link", "set", "lo", "up")  # a new namespace has lo down
            _run(*nsx, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            _run(*nsx, "ip", "link", "set", "eth0", "up")
            _run(*nsx, "ip", "route", "add", "default", "via", self.gateway)
            return node
        return SimNode(i, f"127.0.0.{i + 2}", port, "lo", None)

    def _write_name_service(self) -> None:
        """Give each namespace an /etc/hosts naming every node and a resolv.conf that fails at
        once (`ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*). c10d reverse-resolves
        every peer, also as an IPv4-mapped IPv6 address; with the machine's own resolv.conf each
        lookup waits 10 s for a nameserver no namespace can reach."""
        text = Path("/etc/hosts").read_text() + "".join(
            f"{n.address} simnode{n.index}\n::ffff:{n.address} simnode{n.index}\n" for n in self.nodes
        )
        for n in self.nodes:
            # A bare node binds them over its own /etc in its own mount namespace (_sshd_argv).
            d = self._node_dir(n) / "sshd" if self.bare else Path("/etc/netns") / str(n.netns)
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(text)
            (d / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    # ---- bare nodes -------------------------------------------------------------------------

    def _node_dir(self, node: SimNode) -> Path:
        return self.dir / f"node{node.index}"

    def node_path(self, i: int, path: str) -> Path:
        """Where node i's `path` (under its /tmp or root's home, the node's own disk) lies on this
        machine: e.g. node_path(0, "/root/.gpufleet") to look at what a launch left there."""
        if not self.bare:
            return Path(path)
        d = self._node_dir(self.nodes[i])
        places = [(Path(HOME), d / "home"), (Path("/tmp"), d / "tmp")]
        if self.accounts:
            places.append((Path("/home"), d / "users"))
        for inside, outside in places:
            p = Path(path)
            if p == inside or inside in p.parents:
                return outside / p.relative_to(inside)
        raise ValueError(f"{path} is not on node {i}'s own disk (/tmp, {HOME}, or an account's /home)")

    def _bare_setup(self, node: SimNode) -> str:
        """The shell lines that make node's mount namespace (run as root inside it, before sshd)."""
        d = self._node_dir(node)
        first, last = self._account_mounts(d)
        return bare_node_setup(d, hidden_paths(), first=first, last=last)

    def _account_mounts(self, d: Path) -> tuple[list[str], list[str]]:
        """The node's own /run (first, as bare_node_setup takes it), /home (each account's home in
        it, 0755) and local SSD (1777; last, from the node's disk at BARE_DISK)."""
        if not self.accounts:
            return [], []
        import pwd

        (d / "users").mkdir(exist_ok=True)
        Path(LOCAL_SSD).mkdir(parents=True, exist_ok=True)  # the mount point, empty outside
        for name in self.accounts:
            pw = pwd.getpwnam(name)
            home = d / "users" / name
            home.mkdir(exist_ok=True)
            os.chown(home, pw.pw_uid, pw.pw_gid)
            os.chmod(home, 0o755)
        # The SSD a file system of its own (a tmpfs: a mount point, as the RAID is), seen only
        # from inside the node (`exec`); a sim node's jobs build small environments. /run too
        # (sshd's directories made again in it), with the holds registry the startup script makes
        # (infra/templates/base.sh, make_holds_dir): each node's own, not this machine's.
        first = [
            "mount -t tmpfs -o mode=755,size=16m gfs-run /run",
            f"mkdir -p /run/sshd {BARE_RUN} {BARE_DISK}",
            f"install -d -o root -g root -m 1777 {HOLDS_DIR}",
        ]
        last = [
            f"mount --bind {BARE_DISK}/users /home",
            f"mount -t tmpfs -o mode=1777,size=512m gfs-localssd {LOCAL_SSD}",
        ]
        return first, last

    # ---- the package index --------------------------------------------------------------------

    @property
    def index_address(self) -> str:
        return f"{self.subnet}.251"

    @property
    def package_index(self) -> str:
        """The index's URL (pip's --index-url), when the cluster has one."""
        if self.index_wheels is None:
            raise RuntimeError("this cluster has no package index: SimCluster(n, index=WHEELS)")
        return f"http://{self.index_address}:{INDEX_PORT}/simple/"

    def _start_index(self) -> None:
        from tests.simindex import write_simple_tree

        root = self.dir / "index"
        write_simple_tree(Path(self.index_wheels), root)
        ns, link = f"{NAME_PREFIX}{self.id}ix", f"{NAME_PREFIX}{self.id}vx"
        _run("ip", "netns", "add", ns)
        self._index_ns, self._index_link = ns, link
        _run("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", link, "master", self.bridge)
        _run("ip", "link", "set", link, "up")
        nsx = ("nsenter", f"--net=/run/netns/{ns}")
        _run(*nsx, "ip", "link", "set", "lo", "up")
        _run(*nsx, "ip", "addr", "add", f"{self.index_address}/24", "dev", "eth0")
        _run(*nsx, "ip", "link", "set", "eth0", "up")
        log = open(self.dir / "index.log", "ab")
        self._index_proc = subprocess.Popen(
            [*nsx, SYSTEM_PYTHON, "-I", "-m", "http.server", "--bind", self.index_address, str(INDEX_PORT)],
            cwd=root,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection((self.index_address, INDEX_PORT), timeout=0.5):
                    return
            except OSError:
                if self._index_proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "index.log").read_text()
                    raise RuntimeError(f"the package index did not start: {log}") from None
                time.sleep(0.05)

    def _start_sshd(self, node: SimNode) -> None:
        key = self.dir / f"host_key_{node.index}"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"node{node.index}", "-f", str(key))
        node.host_key_pub = Path(f"{key}.pub").read_text().strip()
        # A node given its own HOME (node_env) also reads that home's ~/.ssh/authorized_keys, as
        # a real node reads its user's: a key authorized there (the cluster key) works.
        keys = f"{self.dir}/authorized_keys"
        home = self.node_env.get(node.index, {}).get("HOME")
        if home:
            Path(home, ".ssh").mkdir(parents=True, exist_ok=True)
            keys += f" {home}/.ssh/authorized_keys"
        cfg = self.dir / f"gpufleet-sshd-{self.id}-{node.index}.conf"  # leftovers() greps this name
        if self.bare:
            # The node sees its own files only: the key and configuration are copied to the
            # directory its namespace mounts at BARE_RUN (the cluster's dir may be hidden there).
            d = self._node_dir(node) / "sshd"
            d.mkdir(parents=True, exist_ok=True)
            for suffix in ("", ".pub"):
                shutil.copy(f"{key}{suffix}", d / f"host_key{suffix}")
            shutil.copy(self.dir / "authorized_keys", d / "authorized_keys")
            key = Path(BARE_RUN) / "host_key"
            keys = f"{BARE_RUN}/authorized_keys .ssh/authorized_keys"
        cfg.write_text(
            f"# gpufleet-simnode {self.id}-{node.index}\n"
            f"ListenAddress {node.address}\nPort {node.port}\nHostKey {key}\n"
            f"AuthorizedKeysFile {keys}\n"
            "PidFile none\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
            "LogLevel ERROR\nMaxStartups 100:30:200\nMaxSessions 100\n"
            f"SetEnv {TAG}={self.id}-{node.index}"
            + "".join(f" {k}={v}" for k, v in self.node_env.get(node.index, {}).items())
            + "\n"
        )
        if self.bare:
            shutil.copy(cfg, self._node_dir(node) / "sshd" / cfg.name)
        self._spawn_sshd(node)

    def _sshd_argv(self, node: SimNode) -> list[str]:
        cfg = self.dir / f"gpufleet-sshd-{self.id}-{node.index}.conf"
        if self.bare:
            # sshd re-executes itself per connection and reads its files then: inside the node, under
            # the same name (leftovers() finds the listener by it).
            argv = [SSHD, "-D", "-e", "-f", f"{BARE_RUN}/{cfg.name}"]
            return [
                "env",
                "-i",
                "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                "nsenter",
                f"--net=/run/netns/{node.netns}",
                "unshare",
                "--mount",
                "--propagation",
                "private",
                # pid 1 there is sshd (sh execs it), which reaps the orphans a session leaves.
                *(["--pid", "--fork", "--mount-proc"] if self.own_pids else []),
                *(["--uts"] if self.hostnames.get(node.index) else []),
                "sh",
                "-c",
                self._bare_setup(node)
                + (f"hostname {self.hostnames[node.index]}\n" if self.hostnames.get(node.index) else "")
                + 'exec "$@"',
                "sh",
                *argv,
            ]
        argv = [SSHD, "-D", "-e", "-f", str(cfg)]
        if node.netns and Path(HOME, ".bashrc").exists():
            # `ip netns exec` gives sshd a mount namespace of its own (a slave of this one): there a
            # fleet node's ~/.bashrc goes over this machine's. bash reads ~/.bashrc in every session
            # sshd starts (bash(1), INVOCATION), and root's here runs `pyenv init` (0.13 s of CPU a
            # session, some 2,500 sessions a suite) and puts pyenv's shims first on PATH, which a
            # node does not have. Debian's /etc/skel/.bashrc returns at once when not interactive.
            quiet = self.dir / "node-bashrc"
            quiet.write_text(
                "# a node's ~/.bashrc: nothing for a non-interactive session\ncase $- in *i*) ;; *) return;; esac\n"
            )
            argv = ["sh", "-c", f'mount --bind {shlex.quote(str(quiet))} {HOME}/.bashrc && exec "$@"', "sh", *argv]
        name = self.hostnames.get(node.index)
        if name:
            # unshare and sh both exec in place, so the Popen pid stays the sshd listener's.
            argv = ["unshare", "--uts", "sh", "-c", f"hostname {name} && exec \"$@\"", "sh", *argv]
        if node.netns:
            argv = ["ip", "netns", "exec", node.netns] + argv
        return argv

    def _spawn_sshd(self, node: SimNode) -> None:
        log = open(self.dir / f"sshd_{node.index}.log", "ab")
        # `ip netns exec`, nsenter, unshare and sh -c 'exec' all exec in place: the Popen pid is
        # the sshd listener itself (with own_pids: unshare, which forks sshd and waits for it).
        node.sshd = subprocess.Popen(self._sshd_argv(node), stdout=log, stderr=log, start_new_session=True)
        log.close()

    def _wait_listening(self, node: SimNode, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if node.sshd and node.sshd.poll() is not None:
                log = (self.dir / f"sshd_{node.index}.log").read_text()
                raise RuntimeError(f"sshd of node {node.index} exited: {log.strip()}")
            try:
                with socket.create_connection((node.address, node.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd of node {node.index} ({node.address}) not listening after {timeout}s")

    @staticmethod
    def _free_port(addresses: list[str]) -> int:
        for _ in range(200):
            port = random.randrange(20000, 60000)
            try:
                for a in addresses:
                    with socket.socket() as s:
                        s.bind((a, port))
                return port
            except OSError:
                continue
        raise RuntimeError("no free port on the loopback addresses")

    def stop(self) -> None:
        if not self._started:
            return
        for pid in _tagged_pids(f"{self.id}-"):
            self._kill(pid)
        for node in self.nodes:
            if node.sshd and node.sshd.poll() is None:
                try:
                    os.killpg(node.sshd.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                node.sshd.wait(timeout=10)
        # Session processes that outlived their sshd (reparented to init) still carry the tag.
        for pid in _tagged_pids(f"{self.id}-"):
            self._kill(pid)
        if self._index_proc is not None:
            if self._index_proc.poll() is None:
                os.killpg(self._index_proc.pid, signal.SIGKILL)
            self._index_proc.wait(timeout=10)
            self._index_proc = None
        if self._index_ns:
            subprocess.run(["ip", "netns", "del", self._index_ns], capture_output=True)
            subprocess.run(["ip", "link", "del", self._index_link], capture_output=True)
            self._index_ns = None
        if self.mode == "netns":
            for node in self.nodes:
                if node.netns:
                    subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
                    shutil.rmtree(Path("/etc/netns") / node.netns, ignore_errors=True)
                if node.host_link:
                    subprocess.run(["ip", "link", "del", node.host_link], capture_output=True)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self._started = False

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # ---- inspecting and breaking nodes -----------------------------------------------------

    def exec(self, i: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run argv as node i sees the world (inside its namespace), not over SSH."""
        node = self.nodes[i]
        if self.bare:  # its network and its own mounts: enter the listener's namespaces
            if not node.sshd or node.sshd.poll() is not None:
                raise RuntimeError(f"node {i} is off: restart_sshd({i}) first, or read node_path({i}, PATH)")
            full = ["nsenter", "-t", str(node.sshd.pid), "-m", "-n", *argv]
        else:
            full = (["ip", "netns", "exec", node.netns] if node.netns else []) + list(argv)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(full, **kw)

    def processes(self, i: int | None = None) -> list[int]:
        """Pids started through node i's sshd (every node when i is None) that are still alive."""
        prefix = f"{self.id}-" if i is None else f"{self.id}-{i}"
        pids = _tagged_pids(prefix)
        if i is not None:  # "-1" must not match "-10"
            exact = f"{TAG}={self.id}-{i}".encode()
            pids = [p for p in pids if exact in _environ(p).split(b"\0")]
        return [p for p in pids if _alive(p)]

    def assert_nothing_left(self, within: float = 10.0) -> None:
        """Wait up to `within` s for every process started through any node's sshd to be gone;
        raise AssertionError naming what is still running on which node."""
        deadline = time.monotonic() + within
        left: dict[int, list[int]] = {}
        while time.monotonic() < deadline:
            left = {i: self.processes(i) for i in range(len(self.nodes))}
            if not any(left.values()):
                return
            time.sleep(0.2)
        raise AssertionError(f"processes left on nodes: {left}")

    def kill_sessions(self, i: int) -> None:
        """Node i "disappears": its SSH sessions and everything they started die at once."""
        node = self.nodes[i]
        victims = set(self.processes(i))
        if node.sshd:
            victims |= set(_descendants(node.sshd.pid))
        # All stopped first, then killed: one by one, a shell that outlived its command would
        # report the kill (exit 137) through an sshd not yet killed, where a vanished node says
        # nothing at all.
        for pid in victims:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        for pid in victims:
            self._kill(pid)

    def new_host_key(self, i: int) -> None:
        """Node i's sshd comes back with a new host key (a rebuilt node, or someone in between):
        sessions already open go on; new connections are offered the new key. The cluster's
        known_hosts keeps the old one."""
        node = self.nodes[i]
        if node.sshd:
            node.sshd.terminate()  # the listener only: open connections are children it leaves
            node.sshd.wait(timeout=10)
        for suffix in ("", ".pub"):
            (self.dir / f"host_key_{i}{suffix}").unlink(missing_ok=True)
        self._start_sshd(node)
        self._wait_listening(node)

    def preempt(self, i: int, save_s: float = 10.0) -> None:
        """Node i is preempted, as Compute Engine stops a Spot VM: its training workers (the
        processes torchrun started, which carry LOCAL_RANK) get SIGTERM and up to `save_s` to
        save and exit; then the node goes away: its sshd and every process started through it
        are killed at once. `restart_sshd(i)` brings it back, with its disk (and host key)."""
        workers = [p for p in self.processes(i) if any(v.startswith(b"LOCAL_RANK=") for v in _environ(p).split(b"\0"))]
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + save_s
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.05)
        self.power_off(i)

    def power_off(self, i: int) -> None:
        """Node i goes away at once: its sshd listener, its sessions and everything they started
        are killed (nothing answers on its address until `restart_sshd(i)`)."""
        node = self.nodes[i]
        victims = set(self.processes(i))
        if node.sshd:
            victims |= set(_descendants(node.sshd.pid)) | {node.sshd.pid}
        # sshd first (the listener and each session's sshd), then the rest: a VM that goes away
        # takes its connections with it, so no client hears an exit status from a session whose
        # shell saw its job's processes die a moment before the network did.
        for pid in sorted(victims, key=lambda p: not _comm(p).startswith("sshd")):  # sshd-session too
            self._kill(pid)
        if node.sshd:
            node.sshd.wait(timeout=10)
        for pid in self.processes(i):  # reparented session processes still carry the tag
            self._kill(pid)

    def restart_sshd(self, i: int) -> None:
        """Node i boots again: its sshd starts with the same host key and configuration."""
        node = self.nodes[i]
        if node.sshd and node.sshd.poll() is None:
            raise RuntimeError(f"node {i}'s sshd is still running")
        self._spawn_sshd(node)
        self._wait_listening(node)

    def block(self, i: int) -> None:
        """Cut node i off the network (its sshd keeps running but nothing reaches it)."""
        node = self.nodes[i]
        if node.host_link:
            _run("ip", "link", "set", node.host_link, "down")
        elif node.sshd:
            os.kill(node.sshd.pid, signal.SIGSTOP)

    def unblock(self, i: int) -> None:
        node = self.nodes[i]
        if node.host_link:
            _run("ip", "link", "set", node.host_link, "up")
        elif node.sshd:
            os.kill(node.sshd.pid, signal.SIGCONT)

    def throttle(self, i: int, rate: str = "20mbit") -> None:
        """Throttle node i's link both ways with a token bucket (netns mode only)."""
        node = self.nodes[i]
        if not node.host_link:
            raise RuntimeError("throttling needs netns mode")
        tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
        _run("tc", "qdisc", "replace", "dev", node.host_link, "root", *tbf)
        _run("ip", "netns", "exec", node.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf)

    def unused_address(self) -> str:
        """An address in the cluster's range where no node listens."""
        if self.mode == "netns":
            return f"{self.subnet}.250"
        return "127.0.0.250"


def make_accounts(names: tuple[str, ...]) -> None:
    """Users of this machine for SimCluster(..., accounts=...), made when missing: home
    /home/NAME (made on each node, not here), bash, no password but not locked (`*`: sshd, with
    UsePAM no, refuses an account whose password starts with `!`)."""
    import pwd

    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            _run("useradd", "--no-create-home", "--home-dir", f"/home/{name}", "--shell", "/bin/bash", "-p", "*", name)


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _comm(pid: int) -> str:
    """The process's command name, "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    todo, seen = _children(pid), []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen
