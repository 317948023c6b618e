"""How the launcher reaches a node: OpenSSH (one known_hosts file and one ControlPath directory
per cluster, under the launcher's state directory), or bash on this machine for `--local`."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from launcher.core.ssh import remote_command, ssh_argv, ssh_base_argv
from launcher.core.types import Cluster, LaunchConfig, Node, SshConfig, UserError

__all__ = ["Transport", "make_transport", "state_dir", "cluster_slug", "known_hosts_path", "user_decides_host_keys"]

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


@dataclass
class Transport:
    """Turns a node-side bash program into an argv: ssh to the node, or bash here (--local)."""

    local: bool
    ssh_base: list[str] = field(default_factory=list)

    def argv(self, node: Node, script: str) -> list[str]:
        if self.local:
            return ["bash", "--norc", "--noprofile", "-c", script]
        return ssh_argv(self.ssh_base, node, remote_command(script))

    def display(self, node: Node, script: str) -> str:
        """The exact command that would run over SSH (for --dry-run)."""
        return script if self.local else remote_command(script)


def make_transport(cluster: Cluster, config: LaunchConfig) -> Transport:
    """The transport for `cluster`; creates its known_hosts and ControlPath directories unless
    this is a dry run."""
    if cluster.local:
        return Transport(local=True)
    ssh = config.ssh
    if ssh.iap and not ssh.zone:
        raise UserError("--iap needs the nodes' zone: pass --zone (stack outputs carry it)")
    key = cluster_slug(cluster).rsplit("-", 1)[1]
    known = known_hosts_path(cluster, ssh.known_hosts)
    # ControlPath must fit a unix socket path (108 bytes): keep it short, per user and cluster.
    control = Path(f"/tmp/gpufleet-ssh-{os.getuid()}") / key
    if not config.dry_run:
        Path(known).parent.mkdir(parents=True, exist_ok=True)
        control.mkdir(parents=True, exist_ok=True, mode=0o700)
        _say_trust_on_first_use(cluster, ssh, Path(known))
    return Transport(local=False, ssh_base=ssh_base_argv(ssh, str(control), str(known)))


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
