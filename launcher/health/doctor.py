"""The `launch doctor` run: every node's program (launcher.health.script) in one SSH session per
node, all at once (the launch's own check sessions, ended after the check), the answers judged
(launcher.health.report), and the rank order a launch would use. The CLI (launcher.cli.cmd_doctor)
parses the flags into the `Cluster` and `LaunchConfig` and renders what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.cluster.topology import RankOrder, rank_order
from launcher.core.env import node_env
from launcher.core.prestart import Expectation, expectation
from launcher.core.program import env_stdin, stdin_env
from launcher.core.types import Cluster, LaunchConfig
from launcher.health.report import Report, judge
from launcher.health.script import node_script

__all__ = ["Doctor", "doctor_programs", "run_doctor", "to_json"]


@dataclass(frozen=True)
class Doctor:
    """What `launch doctor` found: the report on every node, and the rank order a launch would use."""

    report: Report
    order: RankOrder


def doctor_programs(cluster: Cluster, config: LaunchConfig, image_os: str | None) -> dict[int, str]:
    """Each node's program, by rank (what --dry-run prints). The --env values are not in it: each
    program reads them on stdin first (launcher.core.program.env_stdin)."""
    return _programs(cluster, config, _expect(cluster, config, image_os))


def run_doctor(
    cluster: Cluster, config: LaunchConfig, image_os: str | None, min_free_gb: float, mode: str | None
) -> Doctor:
    """Check every node and judge the answers; `mode` "given" keeps the given rank order."""
    # Imported here: building the programs and judging need no sessions (and --dry-run opens none).
    from launcher.core.launch import Launch

    expect = _expect(cluster, config, image_os)
    probes = Launch(cluster, config).ask(_programs(cluster, config, expect), env_stdin(config))
    report = judge(
        cluster.nodes,
        {r: (p.facts if p.ok else None) for r, p in probes.items()},
        expect,
        errors={r: p.error for r, p in probes.items() if not p.ok},
        skews={r: p.skew_s for r, p in probes.items()},
        min_free_gb=min_free_gb,
    )
    hosts = {n.host: n.physical_host for n in report.nodes}
    order = rank_order(cluster, hosts, "given" if mode == "given" else None, "the metadata server")
    return Doctor(report, order)


def _expect(cluster: Cluster, config: LaunchConfig, image_os: str | None) -> Expectation:
    """The catalog's entry, with the plugin directory the launch's environment points NCCL at."""
    return expectation(cluster.machine_type, image_os, node_env(cluster, config))


def _programs(cluster: Cluster, config: LaunchConfig, expect: Expectation) -> dict[int, str]:
    env = stdin_env(config)
    return {n.rank: node_script(n, expect, config.python, config.workdir, env) for n in cluster.nodes}


def to_json(found: Doctor) -> dict:
    """The report as one JSON document (`launch doctor --json`), with the rank order."""
    doc = found.report.to_json()
    order = found.order
    doc["rank_order"] = {
        "topology": order.reordered,
        "message": order.message,
        "hosts": [n.host for n in order.cluster.nodes],
    }
    return doc
