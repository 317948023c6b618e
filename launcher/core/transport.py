"""How the launcher reaches a node: OpenSSH (one known_hosts file per cluster under the launcher's
state directory, one ControlPath directory per cluster under `control_dir()`; with --iap, each node
through an IAP tunnel to its instance), or bash on this machine for `--local`."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from launcher.core.ssh import iap_tunnel, remote_command, ssh_argv, ssh_base_argv
from launcher.core.types import Cluster, ControllerHost, Node, SshConfig, UserError

__all__ = [
    "Transport",
    "make_transport",
    "state_dir",
    "control_dir",
    "iap_instance",
    "cluster_slug",
    "known_hosts_path",
    "user_decides_host_keys",
]

log = logging.getLogger("launcher")


def state_dir() -> Path:
    """Where per-cluster known_hosts files live (GPUFLEET_STATE_DIR, else ~/.cache/gpufleet)."""
    base = os.environ.get("GPUFLEET_STATE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpufleet"
    )
    return Path(base)


def cluster_slug(cluster: Cluster) -> str:
    """The cluster's file name under the state directory: its name's last part (a hostfile
    cluster is named by the file's absolute path) plus a short hash of the whole name, project
    and zone, so two files called `hosts` are two clusters."""
    key = hashlib.sha256(f"{cluster.name}|{cluster.project}|{cluster.zone}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(cluster.name).name) or "cluster"
    return f"{stem}-{key}"


def known_hosts_path(cluster: Cluster, known_hosts: Path | None = None) -> Path:
    """The cluster's known_hosts file: `--known-hosts`, else one per cluster under the state dir."""
    return Path(known_hosts) if known_hosts else state_dir() / "known_hosts" / cluster_slug(cluster)


def control_dir(create: bool = True) -> Path:
    """Where the ssh control sockets live: `$XDG_RUNTIME_DIR/gpufleet-ssh` (the user's own runtime
    directory, https://specifications.freedesktop.org/basedir-spec/latest/), else
    `$TMPDIR/gpufleet-ssh-UID` (/tmp by default), which anyone could have made first: it must be
    a directory of this user's, writable by no one else (a too-open one of this user's own, as
    older versions made it, is made 0700). UserError otherwise. `create`: make it (not in a dry run)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "gpufleet-ssh" if runtime else Path(tempfile.gettempdir()) / f"gpufleet-ssh-{os.getuid()}"
    if create:
        try:
            base.mkdir(mode=0o700)
        except FileExistsError:
            pass
        _check_private(base)
    return base


def _check_private(d: Path) -> None:
    st = os.lstat(d)
    fix = "remove it, or set XDG_RUNTIME_DIR to a directory of your own"
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"SSH control directory {d} is not a directory (a link or a file); {fix}")
    if st.st_uid != os.getuid():
        raise UserError(
            f"SSH control directory {d} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): another user "
            f"made it and could reach your connections through it; {fix}"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UserError(
            f"SSH control directory {d} has mode {mode:04o}: others may write in it and could have put "
            f"anything there; {fix} (a new one is made 0700)"
        )
    if mode != 0o700:
        os.chmod(d, 0o700)  # this user's own, nobody else could write in it: only made private


def iap_instance(host: Node | ControllerHost) -> str:
    """The instance an --iap tunnel goes to: the node's instance name (stack outputs, --label),
    or a hostfile's host when it is a name; a hostfile's address is refused (one line)."""
    if host.name:
        return host.name
    name = host.host.rsplit("@", 1)[-1]
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return name
    raise UserError(
        f"{host.label}: --iap tunnels to an instance by its name, and {name} is an address; write the "
        "instance names in the hostfile, or use --stack, --outputs or --label, which know them"
    )


@dataclass
class Transport:
    """Turns a node-side bash program into an argv: ssh to the node, or bash here (--local).
    `iap_zone`: --iap, each node through an IAP tunnel to its instance in that zone."""

    local: bool
    ssh_base: list[str] = field(default_factory=list)
    iap_zone: str | None = None
    port: int = 22
    tunnel_dir: Path | None = None  # where each node's tunnel writes gcloud's errors (the control dir)

    def argv(self, node: Node, script: str) -> list[str]:
        if self.local:
            return ["bash", "--norc", "--noprofile", "-c", script]
        log = self.tunnel_log(node)
        return ssh_argv(self.ssh_base, node, remote_command(script), self.tunnel(node, errors=log))

    def tunnel(self, node: Node | ControllerHost, port: str = "%p", errors: Path | None = None) -> str | None:
        """The node's ProxyCommand with --iap, else None."""
        if not self.iap_zone:
            return None
        return iap_tunnel(iap_instance(node), self.iap_zone, port, str(errors) if errors else None)

    def tunnel_log(self, node: Node | ControllerHost) -> Path | None:
        """The file the node's IAP tunnel writes gcloud's errors to (why it could not open), or None.
        One per launching process: two launches on one cluster at once share the control directory,
        and must not read each other's errors."""
        if not self.iap_zone or self.tunnel_dir is None:
            return None
        return self.tunnel_dir / f"iap-{re.sub(r'[^A-Za-z0-9_.-]', '_', iap_instance(node))}-{os.getpid()}.err"

    def display(self, node: Node, script: str) -> str:
        """The exact command that would run over SSH (for --dry-run)."""
        return script if self.local else remote_command(script)

    def route(self, node: Node | ControllerHost) -> str:
        """How a dry run says the node is reached, when not straight: `through IAP: gcloud ...`."""
        return f"through IAP: {self.tunnel(node, str(self.port))}" if self.iap_zone else ""


def _sweep_tunnel_logs(control: Path) -> None:
    """Remove the IAP error files (Transport.tunnel_log) of launching processes that have ended:
    one is written per node and process, and only a live process reads its own."""
    for f in control.glob("iap-*-*.err"):
        pid = f.stem.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            f.unlink(missing_ok=True)
        except OSError:  # alive, another account's process: not ours to judge
            pass


def make_transport(cluster: Cluster, ssh: SshConfig, dry_run: bool = False) -> Transport:
    """The transport for `cluster` with the ssh options `ssh`; creates its known_hosts and
    ControlPath directories unless this is a dry run."""
    if cluster.local:
        return Transport(local=True)
    if ssh.iap and not ssh.zone:
        raise UserError("--iap needs the nodes' zone: pass --zone (stack outputs carry it)")
    if ssh.iap:  # every node (and the controller host) by name, or one line before anything
        for host in (*cluster.nodes, *([cluster.controller] if cluster.controller else [])):
            iap_instance(host)
    key = cluster_slug(cluster).rsplit("-", 1)[1]
    known = known_hosts_path(cluster, ssh.known_hosts)
    # ControlPath must fit a unix socket path (108 bytes): keep it short, per user and cluster.
    control = control_dir(create=not dry_run) / key
    if not dry_run:
        Path(known).parent.mkdir(parents=True, exist_ok=True)
        control.mkdir(exist_ok=True, mode=0o700)
        _say_trust_on_first_use(cluster, ssh, Path(known))
        if ssh.iap:
            _sweep_tunnel_logs(control)
    ports = [int(o.split("=", 1)[1]) for o in ssh.options if o.lower().startswith("port=")]
    return Transport(
        local=False,
        ssh_base=ssh_base_argv(ssh, str(control), str(known)),
        iap_zone=ssh.zone if ssh.iap else None,
        port=ports[0] if ports else 22,
        tunnel_dir=None if dry_run else control,
    )


def user_decides_host_keys(ssh: SshConfig) -> bool:
    """`--ssh-option StrictHostKeyChecking=...` or `UserKnownHostsFile=...`: the user's choice wins."""
    return bool({opt.split("=", 1)[0].lower() for opt in ssh.options} & {"stricthostkeychecking", "userknownhostsfile"})


def _say_trust_on_first_use(cluster: Cluster, ssh: SshConfig, known: Path) -> None:
    """Once per cluster (when its known_hosts file is new): a cluster whose host keys nothing
    publishes (a hostfile) trusts them on first use."""
    if ssh.host_key_checking != "accept-new" or user_decides_host_keys(ssh) or known.exists():
        return
    known.touch(mode=0o600)
    log.info(
        "%s: host keys are trusted on first use (StrictHostKeyChecking=accept-new) and kept in %s; a changed key "
        "is refused. A stack's or --label cluster's keys are checked against what each VM publishes",
        cluster.name,
        known,
    )
