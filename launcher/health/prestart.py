"""The launch's pre-start verdict: what launcher.core.prestart's statements reported about every
node's GPUs, NICs and receive-datapath manager, judged with `launch doctor`'s own checks
(launcher.health.checks). A node without its GPUs or NICs must not start a job that would hang
or crawl, so a missing one refuses the launch, naming the node; drift across nodes warns.

Launch takes it as its `verdict` (launcher.core.preflight.Verdict): core renders the statements
into every node's check, and this package, which imports core, judges the answers.
"""

from __future__ import annotations

from collections.abc import Mapping

from launcher.core.preflight import Probe
from launcher.core.prestart import expectation
from launcher.core.types import Cluster, LaunchConfig, UserError
from launcher.health.checks import CHECKS, Check, NodeReport, judge_drift, judge_gpus, nic_problems, rxdm_problem

__all__ = ["prestart_verdict"]


def prestart_verdict(cluster: Cluster, probes: Mapping[int, Probe], config: LaunchConfig) -> list[str]:
    """The launch's pre-start judgement of what launcher.core.prestart's statements reported (the
    check's probes, by rank): raise one UserError naming every node with a
    GPU or NIC missing (nothing was started); return warnings for the rest (drift of the driver,
    ECC errors, a wrong MTU). Nothing to say when the check did not run them (no machine type)."""
    facts = {r: p.facts for r, p in probes.items() if p.ok and "smi_rc" in p.facts}
    if not facts or cluster.machine_type is None:
        return []
    expect = expectation(cluster.machine_type, config.image_os)
    errors: list[str] = []
    warnings: list[str] = []
    reports = []
    for node in cluster.nodes:
        f = facts.get(node.rank)
        if f is None:
            continue
        r = NodeReport(node.rank, node.host, node.name, reachable=True)
        r.checks = {k: Check() for k in CHECKS}
        judge_gpus(r, f, expect)
        reports.append(r)
        errors += [f"{node.label}: {p}" for p in r.checks["gpus"].problems]
        for kind, p in nic_problems(f, expect)[1]:
            (warnings if kind == "mtu" else errors).append(f"{node.label}: {p}")
        if expect.rxdm and "rxdm_rc" in f:
            problem = rxdm_problem(f, expect.net_stack)
            if problem:
                errors.append(f"{node.label}: {problem}")
    judge_drift(reports, expect)
    for r in reports:
        warnings += [
            f"{r.label}: {p}" for col in ("driver", "cuda", "ecc", "persistence") for p in r.checks[col].problems
        ]
    if errors:
        raise UserError(
            f"{'; '.join(errors)}; nothing was started. `launch doctor` checks every node in full; "
            "fix the node or --exclude it"
        )
    return warnings
