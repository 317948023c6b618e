"""What `--dry-run` shows of a launch's plan (launcher.runner.plan.LaunchPlan): for a person,
one short block per node (`text`), and whole, as JSON (`as_json`). Pure: it formats, it
connects to nothing and prints nothing (launcher.cli.render prints).

A node's block says who it is and which ranks it runs, the command, the container (image,
mounts, devices), the environment the launch adds (an --env value is hidden: it travels on
stdin), the checks before the start, the prepare steps and how the run stops. The nodes after
node 0 are usually node 0 again with their own address, node rank and ranks: those are folded
into one line each under "as node 0", so a 16-node dry run stays a page."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from typing import Any

from gpufleet.node_plan import (
    SCHEMA_VERSION,
    Check,
    CheckKind,
    EnvSource,
    EnvVar,
    NodePlan,
    PrepareKind,
    PrepareStep,
    PrologueKind,
    PrologueStep,
)
from launcher.core.program import stdin_env
from launcher.runner.plan import LaunchPlan

__all__ = ["text", "as_json", "node_block", "fold"]

_INDENT = "  "
_WIDTH = 100  # the env line wraps here


def text(p: LaunchPlan) -> list[str]:
    """The dry run a person reads: node 0's block in full, then each other node folded into a
    line when it is node 0 with its own address, node rank and ranks (`fold`), else in full."""
    plans = [p.plans[n.rank] for n in p.cluster.nodes]
    lines = node_block(plans[0])
    for group, note in fold(plans):
        if note is None:
            lines += node_block(group[0])
            continue
        span = f"node {group[0].node_rank}" if len(group) == 1 else f"nodes {group[0].node_rank}-{group[-1].node_rank}"
        lines.append(f"{span}: as node 0{note}, each with its own address, node rank and ranks:")
        lines += [f"{_INDENT}{_header(q)}" for q in group]
    return lines


def as_json(p: LaunchPlan) -> str:
    """--dry-run=json, one line: every node's whole plan (gpufleet.node_plan), in rank order, with the
    program each node runs today. The program is bash rendered from the same parts as the plan
    (launcher.core.program); it goes in the JSON until the node agent executes the plan itself,
    and then only the plan will travel."""
    doc: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "job_id": p.config.job_id,
        "order": p.order_message,
        "stdin": [k for k, _ in stdin_env(p.config)],
        "nodes": [
            {"plan": p.plans[n.rank].to_dict(), "program": p.programs[n.rank], "remote": remote}
            for n, remote in zip(p.cluster.nodes, p.remote_commands())
        ],
    }
    return json.dumps(doc)


def node_block(q: NodePlan) -> list[str]:
    """One node's block: its header line, then one line per part (label, then what)."""
    rows: list[tuple[str, str]] = []
    if q.prologue:
        rows.append(("first", "; ".join(_prologue(s) for s in q.prologue)))
    rows.append(("run", shlex.join(q.command)))
    c = q.container
    if c is not None:
        gpus = "all, through the runtime" if c.gpus == "all" else "the devices below" if c.devices else "none"
        rows.append(("image", f"{c.image} as container {c.name} (docker, else podman; GPUs: {gpus})"))
        rows.append(("options", " ".join(f"{f} {v}" for f, v in c.options) or "-"))
        if c.mounts:
            rows.append(("mounts", "; ".join(_mount(m.host, m.container, m.read_only) for m in c.mounts)))
        if c.devices:
            rows.append(("devices", " ".join(c.devices)))
    shown = [v for i, v in enumerate(q.env) if v not in q.env[:i]]  # the job's ID is set twice
    rows += [("env", line) for line in _wrap([_env(v) for v in shown])]
    rows += [("checks", line) for line in _checks(q.checks) or ["none"]]
    rows += [("prepare", _prepare(s)) for s in q.prepare] or [("prepare", "none")]
    rows.append(("stop", _limits(q)))
    out = [_header(q)]
    for i, (label, what) in enumerate(rows):
        shown = label if i == 0 or rows[i - 1][0] != label else ""
        out.append(f"{_INDENT}{shown:<8} {what}")
    return out


def _header(q: NodePlan) -> str:
    where = q.host if q.host == q.address else f"{q.host} ({q.address})"
    if q.ranks is not None:
        first, last = q.ranks
        ranks = f"ranks {first}-{last}" if last > first else f"rank {first}"
        what = f"{ranks} ({q.procs} process{'es' * (q.procs != 1)})"
    elif q.workload == "torchrun":
        what = f"{q.procs} process{'es' * (q.procs != 1)}, ranks assigned at the rendezvous (c10d)"
    else:
        what = "1 process (a plain command: no RANK)"
    return f"node {q.node_rank}  {where}  {what}"


def _mount(host: str, container: str, read_only: bool) -> str:
    return (host if host == container else f"{host} -> {container}") + (" (read-only)" if read_only else "")


def _env(v: EnvVar) -> str:
    if v.source is EnvSource.STDIN:
        return f"{v.name}=<hidden: --env, on stdin>"
    if v.source is EnvSource.NODE:
        return f"{v.name}=<the host NIC, found on the node>"
    value = shlex.quote(v.value or "")
    return f"{v.name}={value}:${v.name}" if v.prepend else f"{v.name}={value}"


def _wrap(items: Sequence[str]) -> list[str]:
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 1 + len(item) <= _WIDTH:
            lines[-1] += " " + item
        else:
            lines.append(item)
    return lines


def _checks(checks: Sequence[Check]) -> list[str]:
    out = []
    nics = [c for c in checks if c.kind is CheckKind.NIC]
    for c in checks:
        if c.kind is CheckKind.NIC:
            if c is nics[0]:  # the NICs in one item, grouped by what each must be
                by: dict[str, list[str]] = {}
                for n in nics:
                    by.setdefault(n.expect, []).append(n.target)
                out.append("NICs " + ", ".join(f"{' '.join(names)} ({e})" for e, names in by.items()))
            continue
        out.append(_CHECK_WORDS[c.kind](c))
    return out


_CHECK_WORDS = {
    CheckKind.NODE_FACTS: lambda c: "hostname, clock and ready marker",
    CheckKind.TORCH_VERSION: lambda c: f"torch version of {c.target} ({c.expect})",
    CheckKind.WORKDIR: lambda c: f"--workdir {c.target} exists",
    CheckKind.PREEMPTIBLE: lambda c: c.expect,
    CheckKind.GPUS: lambda c: f"GPUs {c.expect}",
    CheckKind.RXDM: lambda c: f"{c.target} {c.expect}",
    CheckKind.RDZV_PORT: lambda c: f"rendezvous port {c.target} {c.expect}",
}


def _prepare(s: PrepareStep) -> str:
    return {
        PrepareKind.WORKDIR: "cd {}",
        PrepareKind.CODE: "gpufleet's code at {} is there",
        PrepareKind.DIRECTORY: "the job's directory {} is there",
        PrepareKind.ENVIRONMENT: "the environment's python {} is there",
        PrepareKind.PREPARED: "{} is there",
        PrepareKind.LOCAL_DIR: "the account's own local directory (local checkpoints; compile caches {})",
        PrepareKind.FR_ALIASES: "the flight recorder's older names, if {}'s torch is 2.4-2.7",
    }[s.kind].format(s.path)


def _prologue(s: PrologueStep) -> str:
    return "hold the nodes" if s.kind is PrologueKind.HOLD else "authorize the cluster key"


def _limits(q: NodePlan) -> str:
    lim = q.limits
    s = f"SIGTERM to every rank, SIGKILL after {lim.term_grace_s:g} s"
    if lim.watch_preemption:
        s += "; also on a Spot preemption notice"
    if lim.controller_grace_s is not None:
        s += f"; detached: stops itself after {lim.controller_grace_s} s with no controller"
    return s


# ---- folding ---------------------------------------------------------------------------------


def fold(plans: Sequence[NodePlan]) -> list[tuple[list[NodePlan], str | None]]:
    """The nodes after the first, in runs: (nodes, note) where each is the first node but for
    its own address, node rank and ranks, `note` saying which checks it has not (node 0's
    rendezvous-port lock) or has besides; (node, None) for a node that differs otherwise."""
    base = _shape(plans[0])
    runs: list[tuple[list[NodePlan], str | None]] = []
    for q in plans[1:]:
        note = _note(base, _shape(q))
        if note is not None and runs and runs[-1][1] == note:
            runs[-1][0].append(q)
        else:
            runs.append(([q], note))
    return runs


def _note(base: dict[str, Any], shape: dict[str, Any]) -> str | None:
    if {k: v for k, v in base.items() if k != "checks"} != {k: v for k, v in shape.items() if k != "checks"}:
        return None
    words = {CheckKind.RDZV_PORT.value: "the rendezvous-port lock"}
    missing = [words.get(c["kind"], c["kind"]) for c in base["checks"] if c not in shape["checks"]]
    extra = [words.get(c["kind"], c["kind"]) for c in shape["checks"] if c not in base["checks"]]
    return (f" without {', '.join(missing)}" if missing else "") + (f" with {', '.join(extra)}" if extra else "")


def _shape(q: NodePlan) -> dict[str, Any]:
    """The plan with what is the node's own left out or replaced by a placeholder: its rank,
    host, address and ranks, and in the strings torchrun's --node-rank, --local-addr and is_host,
    the container's name and the run token (each names the node)."""
    own = {q.job_id + "-" + str(q.node_rank): "<job>-<node>", f"--local-addr={q.address}": "--local-addr=<address>"}
    d = q.to_dict()
    for k in ("node_rank", "host", "address", "ranks"):
        d.pop(k)
    d["env"] = [e for e in d["env"] if e["name"] != "GPUFLEET_NODE_RANK"]

    def norm(x: Any) -> Any:
        if isinstance(x, str):
            for a, b in own.items():
                x = x.replace(a, b)
            return _IS_HOST.sub("is_host=<node>", _NODE_RANK.sub("--node-rank=<node>", x))
        if isinstance(x, list):
            return [norm(y) for y in x]
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        return x

    return norm(d)


# torchrun's flags whose value is the node's own (launcher.core.torchrun).
_NODE_RANK = re.compile(r"^--node-rank=\d+$")
_IS_HOST = re.compile(r"\bis_host=[01]\b")
