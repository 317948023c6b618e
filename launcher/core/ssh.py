"""The ssh command line that carries a node program: OpenSSH's options (the user's first), the
node, and the remote command that hands the program to bash. Pure functions: they build argv.

Everything that crosses a shell goes through `shlex.quote`."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from launcher.core.types import Node, SshConfig

__all__ = ["remote_command", "python_source_command", "ssh_base_argv", "ssh_argv", "iap_tunnel"]


def remote_command(script: str) -> str:
    """What goes on the ssh command line: the remote login shell runs bash with our program.

    `--norc`: bash started by sshd reads ~/.bashrc (bash(1), INVOCATION: "run by the remote
    shell daemon"); the login shell already did, and a second pass (pyenv, conda...) costs a
    noticeable part of a short command's time on every node."""
    return f"exec bash --norc --noprofile -c {shlex.quote(script)}"


def python_source_command(source: str, args: str, replace: bool = False, var: str | None = None) -> str:
    """A node's statement that runs a standard-library-only program from its source text (a node
    has nothing of gpufleet yet): the node's own python3, isolated (-I: no PYTHON* variables, no
    user site, no script directory on sys.path; -S: no site-packages). `args`: its arguments,
    quoted already; `replace`: `exec`, the shell's last statement; `var`: the source is in that
    shell variable already (a program that runs it twice carries it once)."""
    code = f'"${var}"' if var else shlex.quote(source)
    return f"{'exec ' if replace else ''}python3 -I -S -c {code} {args}"


def ssh_base_argv(ssh: SshConfig, control_dir: str, known_hosts: str) -> list[str]:
    """ssh and its options. The user's options come first: OpenSSH keeps the first value it
    obtains for each option (ssh_config(5)), so `--ssh-option` wins over our defaults."""
    argv = ["ssh"]
    for opt in ssh.options:
        argv += ["-o", opt]
    if ssh.user:
        argv += ["-l", ssh.user]
    if ssh.key:
        argv += ["-i", str(ssh.key)]
    if ssh.iap and not ssh.zone:
        raise ValueError("--iap needs the zone")
    # --iap: each node's own ProxyCommand, by its instance name (ssh_argv).
    argv += [
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={ssh.connect_timeout}",
        # Keep-alives: a node that vanished is noticed within 3 x 2 s.
        "-o",
        "ServerAliveInterval=2",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        # "yes": the keys the Compute Engine API publishes are there already; "accept-new": first
        # contact records the key. Either way a changed key is refused. Never "no".
        "-o",
        f"StrictHostKeyChecking={ssh.host_key_checking}",
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={control_dir}/%C",
        "-o",
        f"ControlPersist={ssh.control_persist}",
        "-o",
        "LogLevel=ERROR",
        "-T",
    ]
    return argv


def iap_tunnel(instance: str, zone: str, port: str = "%p", errors: str | None = None) -> str:
    """The command that carries one SSH connection through Identity-Aware Proxy to `instance`:
    `gcloud compute start-iap-tunnel INSTANCE_NAME INSTANCE_PORT --listen-on-stdin --zone ZONE`
    (https://cloud.google.com/sdk/gcloud/reference/compute/start-iap-tunnel; it takes an instance
    name, an IP address only with --network and --region). `%p`: ssh's own port token.

    `errors`: a file for gcloud's stderr. With ControlPersist, ssh sends a ProxyCommand's stderr
    to /dev/null (openssh-portable sshconnect.c, ssh_proxy_connect), and that is where IAP says
    why a tunnel cannot open; ssh runs the command with `$SHELL -c "exec ..."`, so the
    redirection is the shell's."""
    cmd = f"gcloud compute start-iap-tunnel {shlex.quote(instance)} {port} --listen-on-stdin --zone {shlex.quote(zone)}"
    return f"{cmd} 2>{shlex.quote(errors)}" if errors else cmd


def ssh_argv(base: Sequence[str], node: Node, command: str, tunnel: str | None = None) -> list[str]:
    """`tunnel`: the node's ProxyCommand (iap_tunnel), after the user's options, which win."""
    proxy = ["-o", f"ProxyCommand={tunnel}"] if tunnel else []
    return [*base, *proxy, node.host, "--", command]
