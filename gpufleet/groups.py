"""The plan the bad-node finder hands the sweep: rounds of disjoint node groups (a contract).

`launch nccl-tests --find-bad-nodes` (launcher side) starts ONE sweep across every node and
passes ``--rounds PLAN``; `workloads.sweep` (node side) runs, round after round, one sweep per
group of the round at the same time, each group on its own process group. Starting torchrun once
instead of once per pair is what keeps the search bounded: on a 16-node cluster a launch costs
tens of seconds and all-pairs needs 15 rounds.

PLAN text: rounds separated by ``;``, groups of a round by ``,``, the nodes of a group by ``+``;
a node is its launcher node rank (``GPUFLEET_NODE_RANK``, which `launch` exports on every node):

    0+3,1+2;0+2,3+1;0+1,2+3      three rounds of two pairs (4 nodes, every pair once)

Each group's sweep is printed by global rank 0 as one JSON line (``JSON_MARKER``) whose document
carries ``round`` (0-based) and ``nodes`` (the group, as written in the plan) besides the rows.
"""

from __future__ import annotations

import json
from typing import Any

from gpufleet.contracts import JSON_MARKER

__all__ = ["NODE_RANK_ENV", "Plan", "format_rounds", "parse_rounds", "group_documents"]

# Exported by launcher.core.program's node script on every node: the node's index in the launch.
NODE_RANK_ENV = "GPUFLEET_NODE_RANK"

Plan = list[list[tuple[int, ...]]]
"""Rounds; each round a list of groups; each group a tuple of node ranks."""


def format_rounds(rounds: Plan) -> str:
    """The PLAN text of `rounds` (see the module docstring); parse_rounds reads it back."""
    return ";".join(",".join("+".join(str(n) for n in g) for g in rnd) for rnd in rounds)


def parse_rounds(text: str) -> Plan:
    """Read PLAN text. Raises ValueError naming the bad part: an empty round or group, a node
    that is not a non-negative integer, or a node in two groups of one round."""
    rounds: Plan = []
    for i, rtext in enumerate(text.split(";")):
        groups: list[tuple[int, ...]] = []
        seen: set[int] = set()
        for gtext in rtext.split(","):
            parts = gtext.strip().split("+")
            if not all(p.strip().isdigit() for p in parts):
                raise ValueError(
                    f"round {i + 1}: group {gtext.strip()!r} is not node ranks joined by '+' (e.g. 0+3,1+2;0+2,3+1)"
                )
            group = tuple(int(p) for p in parts)
            twice = sorted(seen.intersection(group) | {n for n in group if group.count(n) > 1})
            if twice:
                raise ValueError(
                    f"round {i + 1}: node {twice[0]} appears twice; the groups of a round "
                    "run at the same time and must not share a node"
                )
            seen.update(group)
            groups.append(group)
        rounds.append(groups)
    return rounds


def group_documents(text: str) -> list[dict[str, Any]]:
    """The JSON documents of the groups in a sweep's output (those with "nodes"), in order. A
    line cut short (its node died mid-write) is skipped: the caller sees that group missing."""
    docs = []
    for line in text.splitlines():
        if not line.startswith(JSON_MARKER):
            continue
        try:
            doc = json.loads(line[len(JSON_MARKER) :])
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("nodes"), list) and isinstance(doc.get("rows"), list):
            docs.append(doc)
    return docs
