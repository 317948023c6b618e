"""How the launcher reaches a node: OpenSSH (one known_hosts file and one ControlPath directory
per cluster, under the launcher's state directory), or bash on this machine for `--local`."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from launcher.core.ssh import remote_command, ssh_argv, ssh_base_argv
from launcher.core.types import Cluster, LaunchConfig, Node, UserError

__all__ = ["Transport", "make_transport", "state_dir"]


def state_dir() -> Path:
    """Where per-cluster known_hosts files live (GPUFLEET_STATE_DIR, else ~/.cache/gpufleet)."""
    base = os.environ.get("GPUFLEET_STATE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpufleet"
    )
    return Path(base)


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
    key = hashlib.sha256(f"{cluster.name}|{cluster.project}|{cluster.zone}".encode()).hexdigest()[:10]
    known = ssh.known_hosts or state_dir() / "known_hosts" / f"{cluster.name}-{key}"
    # ControlPath must fit a unix socket path (108 bytes): keep it short, per user and cluster.
    control = Path(f"/tmp/gpufleet-ssh-{os.getuid()}") / key
    if not config.dry_run:
        Path(known).parent.mkdir(parents=True, exist_ok=True)
        control.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Transport(local=False, ssh_base=ssh_base_argv(ssh, str(control), str(known)))
