"""The pre-start check's policy: how many handshakes at once, how long a node may take to
answer, and what the answers (`Probe`s) allow: one `UserError` naming every node that cannot
run, or warnings for the ones that can (clock skew, a stale host list).

What the check asks about a node's hardware (launcher.core.prestart's statements) is judged above
core, by a `Verdict` the launch is given (launcher.health.prestart.prestart_verdict): core renders
the question into every node's program, and the package that judges the answers imports core,
never the other way round."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from launcher.core.holds import refuse_held
from launcher.core.program import SPOT_GRACE_MAX_S, SPOT_NOTICE_S
from launcher.core.transport import Transport
from launcher.core.types import Cluster, LaunchConfig, Node, SshConfig, UserError

__all__ = [
    "Probe",
    "Verdict",
    "DIRECT_CONCURRENCY",
    "through_gateway",
    "handshake_limit",
    "check_timeout",
    "clock_skew",
    "check_probes",
    "refuse_unreachable",
]


@dataclass
class Probe:
    """What the pre-flight learned about one node."""

    node: Node
    ok: bool
    error: str = ""
    facts: dict[str, str] = field(default_factory=dict)
    skew_s: float | None = None  # how far the node's clock is outside the probe's time window
    access: str | None = None  # why it would not let us in, when ssh's output says (launcher.core.access)


# A judgement of the check's answers beyond core's own: raise UserError naming every node that
# cannot run, or return warnings (launcher.health.prestart.prestart_verdict).
Verdict = Callable[[Cluster, Mapping[int, Probe], LaunchConfig], list[str]]


# Handshakes in flight when every connection goes to a different sshd (no bastion or proxy).
DIRECT_CONCURRENCY = 32


def through_gateway(transport: Transport, node: Node, ssh: SshConfig) -> bool:
    """Whether connections share one sshd on the way (IAP, ProxyJump, ProxyCommand from the
    options or ~/.ssh/config): then sshd's MaxStartups (default 10:30:100, sshd_config(5))
    applies to all of them together and `ssh.concurrency` (8) bounds them."""
    if ssh.iap:
        return True
    try:
        out = subprocess.run([*transport.ssh_base, "-G", node.host], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return True
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key in ("proxyjump", "proxycommand") and value.strip() not in ("", "none"):
            return True
    return False


def handshake_limit(cluster: Cluster, ssh: SshConfig, transport: Transport) -> int:
    """How many nodes may be mid-handshake at once. sshd's MaxStartups limits unauthenticated
    connections per sshd: through one gateway they all count against it (`ssh.concurrency`);
    going straight to the nodes, each node's sshd sees one connection from us, so more."""
    workers = ssh.concurrency
    if not transport.local and not through_gateway(transport, cluster.nodes[0], ssh):
        workers = max(workers, min(len(cluster.nodes), DIRECT_CONCURRENCY))
    return max(1, workers)


def check_timeout(ssh: SshConfig) -> float:
    """How long a node may take to pass its check: the handshake, plus the check itself
    (reading torch's version on a busy node)."""
    return ssh.connect_timeout + 20.0


def clock_skew(facts: dict[str, str], t0: float, t1: float) -> float | None:
    """How far the node's clock (its `time=` line) lies outside [t0, t1], when it was asked and
    when it answered: with agreeing clocks it falls inside, whatever the latency, so the distance
    outside is a lower bound on the skew."""
    try:
        remote = float(facts.get("time", ""))
    except ValueError:
        return None
    return remote - min(max(remote, t0), t1)


def check_probes(
    cluster: Cluster, probes: dict[int, Probe], config: LaunchConfig, verdict: Verdict | None = None
) -> list[str]:
    """Raise one UserError naming every node that cannot run; return warnings for the rest.
    `verdict` judges what launcher.core.prestart's statements reported (a missing GPU or NIC
    refuses, drift warns); a check whose nodes answered them must have one."""
    # Another account's job on some of the nodes comes first: it is why they may not answer well.
    refuse_held({r: p.node.label for r, p in probes.items()}, {r: p.facts for r, p in probes.items() if p.ok})
    refuse_unreachable(cluster, probes)
    _refuse_busy_port(probes, config)
    _refuse_missing_workdir(probes, config)
    _refuse_torch(probes, config)
    asked = any(p.ok and "smi_rc" in p.facts for p in probes.values())
    if asked and verdict is None:
        # A programming error, not the user's: the nodes' GPU answers would go unjudged.
        raise RuntimeError("the check asked the nodes about their GPUs but no verdict judges the answers")
    drift = verdict(cluster, probes, config) if verdict is not None else []
    return _clock_warnings(probes) + _hostname_warnings(cluster, probes) + drift + _spot_grace_warnings(probes, config)


def _spot_grace_warnings(probes: dict[int, Probe], config: LaunchConfig) -> list[str]:
    """A --term-grace longer than a Spot VM's notice allows (launcher.core.program.SPOT_NOTICE_S)."""
    spot = [p.node.label for p in probes.values() if p.ok and p.facts.get("preemptible") == "TRUE"]
    if not spot or config.stop_grace_s <= SPOT_GRACE_MAX_S:
        return []
    return [
        f"--term-grace {config.stop_grace_s:g} s on Spot nodes ({', '.join(spot)}): a preemption gives "
        f"{SPOT_NOTICE_S} s from notice to stop, so the ranks may be killed with the VM before their grace "
        f"ends; give at most {SPOT_GRACE_MAX_S:g}s (https://cloud.google.com/compute/docs/instances/spot)"
    ]


def refuse_unreachable(cluster: Cluster, probes: dict[int, Probe]) -> None:
    """One line naming every node that cannot be reached; where they all failed for one reason
    of access (an IAP permission, its firewall rule, an unregistered key), that reason alone."""
    bad = [p for p in probes.values() if not p.ok]
    reasons = {p.access for p in bad}
    if bad and len(reasons) == 1 and None not in reasons:
        who = "every node" if len(bad) == len(cluster.nodes) else ", ".join(p.node.label for p in bad)
        raise UserError(f"{reasons.pop()} ({who}; nothing was started)")
    if bad:
        listed = "; ".join(f"{p.node.label}: {p.error}" for p in bad)
        raise UserError(
            f"{len(bad)} of {len(cluster.nodes)} nodes cannot be reached, nothing was "
            f"started: {listed}. Check the address, --ssh-user/--ssh-key, or --exclude them"
        )


def _refuse_busy_port(probes: dict[int, Probe], config: LaunchConfig) -> None:
    head = probes.get(0)
    if head and head.facts.get("port", "free").startswith("busy"):
        other = head.facts["port"].partition(":")[2] or "unknown"
        raise UserError(
            f"rendezvous port {config.rdzv_port} on {head.node.label} is in use by "
            f"another launch (job {other}); nothing was started. Wait for it, or pass "
            "--rdzv-port with a free port"
        )


def _refuse_missing_workdir(probes: dict[int, Probe], config: LaunchConfig) -> None:
    missing = [p.node.label for p in probes.values() if p.facts.get("workdir") == "missing"]
    if missing:
        raise UserError(
            f"--workdir {config.workdir!r} does not exist on {', '.join(missing)}; nothing "
            "was started. Create it there or pass another --workdir"
        )


def _refuse_torch(probes: dict[int, Probe], config: LaunchConfig) -> None:
    torch = {r: p.facts["torch"] for r, p in probes.items() if "torch" in p.facts}
    no_torch = [probes[r].node.label for r, v in torch.items() if v == "missing"]
    if no_torch:
        raise UserError(
            f"torch is not installed for {config.python!r} on {', '.join(no_torch)}; nothing "
            "was started. Name it in --requirements FILE (or the --sync directory's requirements.txt) and the "
            "nodes build it, or pass --python with an interpreter that has it"
        )
    if len(set(torch.values())) > 1:
        by = "; ".join(f"{probes[r].node.label}: {v}" for r, v in sorted(torch.items()))
        raise UserError(
            f"torch versions differ across nodes ({by}); nothing was started. Every node must run the same version"
        )


def _clock_warnings(probes: dict[int, Probe]) -> list[str]:
    # Beyond a couple of seconds, log timestamps and timeouts stop lining up across nodes.
    return [
        f"{probes[r].node.label}: clock differs from this machine by {p.skew_s:+.1f} s (check chrony/NTP on the node)"
        for r, p in sorted(probes.items())
        if p.skew_s is not None and abs(p.skew_s) > 2.0
    ]


def _hostname_warnings(cluster: Cluster, probes: dict[int, Probe]) -> list[str]:
    warnings = []
    for _, p in sorted(probes.items()):
        host = p.facts.get("host", "")
        expect = p.node.name or ("" if _is_ip(p.node.address) or cluster.local else p.node.host)
        if expect and host and host.split(".")[0] != expect.split(".")[0].split("@")[-1]:
            warnings.append(f"{p.node.label}: hostname is {host!r}, expected {expect!r} (is the host list stale?)")
    hosts = [p.facts.get("host") for p in probes.values()]
    if not cluster.local and len(hosts) > 1 and len(set(hosts)) == 1 and cluster.machine_type:
        warnings.append(f"every node reports the same hostname {hosts[0]!r}: are they one machine?")
    return warnings


def _is_ip(a: str) -> bool:
    return a.replace(".", "").isdigit() or ":" in a
