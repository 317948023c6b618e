"""Find a slow node: sweep every pair of nodes, rank the nodes by their pairs, confirm with halves.

Pure parts, tested without a network:

``pair_schedule(hosts) -> list[list[tuple[str, str]]]``
    Rounds of disjoint pairs covering every pair once; the pairs of a round can run at once.
``rank_nodes(pair_busbw, threshold=0.8) -> BadNodeReport``
    Scores each node by the median busbw of the pairs it was in; names every node below
    threshold × the median score. ``report.exclude`` is the ``--exclude`` value.
``confirm_halves(hosts, suspects)`` and ``confirm_suspects(clean_busbw, suspect_busbw, suspects, threshold)``
    The confirming pass: a suspect half and a clean half; a suspect is confirmed when its half
    is below threshold × the clean half.

The search, ``BadNodeSearch``, is a caller of ``launcher.core.launch.Launch``: every pair of nodes,
a round of disjoint pairs at a time, all in ONE launch of ``workloads.sweep --rounds``
(gpufleet.groups), then, unless the pairs settle it (``BadNodeReport.decisive``), the two halves
in one more launch. Each pair's sweep runs under ``--time-budget`` (``--pair-budget``): a pair
far slower than the others is timed with one call per size instead of -w + 2 x (1 + -n + -c), so
the search takes about (rounds x the slow pair's one call) plus one launch, however slow the bad
node is. It returns data and reports wrong rows through a callback; the CLI prints.

Ports: the search runs one launch at a time, each on the request's one rendezvous port
(``--rdzv-port``; a free one with ``--local``). The pairs (or halves) that run at once are
process groups inside that launch's one torch.distributed world (``new_subgroups_by_enumeration``
in workloads.sweep), built over the world's own store: they open no listening port of their own,
so no two of them can collide on a port however many run at once, and no port is derived per pair.

Stopping: each launch handles SIGINT/SIGTERM itself while it runs (``Launch.run``), and every
launch of one search shares one stop event (``BadNodeSearch.stop``): a signal stops the running
launch's nodes in order, and the search ends with ``SearchFailed`` (``signals`` names them)
instead of starting another launch. Between two launches nothing runs on any node.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet import atomic
from gpufleet.collectives import SWEEP_MODULE, SweepSpec
from gpufleet.contracts import SweepRow
from gpufleet.groups import format_rounds, group_documents
from launcher.core.launch import Interrupted, Launch
from launcher.core.types import Cluster, LaunchConfig, LaunchResult, UserError, Workload
from launcher.health.prestart import prestart_verdict
from launcher.jobs.busy import BusyCheck
from launcher.nccl.judge import failures

__all__ = [
    "BadNodeReport",
    "BadNodeSearch",
    "GroupResult",
    "Halves",
    "SearchFailed",
    "SearchOptions",
    "confirm_halves",
    "confirm_suspects",
    "group_result",
    "pair_schedule",
    "rank_nodes",
]


# ---- the pure parts ------------------------------------------------------------------------------


def pair_schedule(hosts: list[str]) -> list[list[tuple[str, str]]]:
    """Every pair of hosts once, in rounds of disjoint pairs (the circle method).

    n even: n-1 rounds of n/2 pairs; n odd: n rounds, one host idle in each. Pairs within a
    round share no host, so they can run at the same time without disturbing each other.
    """
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts repeat: {', '.join(h for h in hosts if hosts.count(h) > 1)}")
    if len(hosts) < 2:
        raise ValueError(f"pairs need 2 or more hosts, got {len(hosts)}")
    ring: list[str | None] = list(hosts) + ([None] if len(hosts) % 2 else [])
    m = len(ring)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ring[i], ring[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]  # keep the first fixed, rotate the rest
    return rounds


@dataclass
class BadNodeReport:
    """What rank_nodes found."""

    scores: dict[str, float]  # node → median busbw (GB/s) of the pairs it was in
    pairs: dict[str, dict[str, float]]  # node → {partner: busbw}
    median: float  # median of the scores
    threshold: float  # fraction of the median below which a node is named
    bad: list[str]  # named nodes, worst first

    @property
    def exclude(self) -> str:
        """The comma list the launcher's --exclude accepts."""
        return ",".join(self.bad)

    @property
    def decisive(self) -> bool:
        """True when the pairs alone settle it: every pair with a named node is below threshold ×
        the slowest pair of two unnamed nodes. A confirming pass then has nothing to add (a pair
        already far slower than all the others is the answer); the finder skips it."""
        bad = set(self.bad)
        named = [bw for n in bad for bw in self.pairs[n].values()]
        clean = [bw for n, ps in self.pairs.items() if n not in bad for p, bw in ps.items() if p not in bad]
        return bool(named) and bool(clean) and max(named) < self.threshold * min(clean)

    @property
    def lines(self) -> list[str]:
        """One line per named node with its numbers."""
        cut = self.threshold * self.median
        out = []
        for n in self.bad:
            partners = ", ".join(f"{p} {bw:.2f}" for p, bw in sorted(self.pairs[n].items()))
            out.append(
                f"{n}: busbw {self.scores[n]:.2f} GB/s (median of {len(self.pairs[n])} pairs: "
                f"{partners}) < {self.threshold:g} x median {self.median:.2f} = {cut:.2f} GB/s"
            )
        return out


def rank_nodes(pair_busbw: dict[tuple[str, str], float], threshold: float = 0.8) -> BadNodeReport:
    """Score nodes by the median busbw of their pairs; name those below threshold × the median.

    Median, not mean: a slow node drags down every pair it is in, while a healthy node is in one
    slow pair at most (when one node is bad); the median of a healthy node's pairs stays at the
    healthy level, where a mean would pull it toward the cut by its one bad partner.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    pairs: dict[str, dict[str, float]] = {}
    for (a, b), bw in pair_busbw.items():
        if a == b:
            raise ValueError(f"pair ({a}, {b}) names one node twice")
        pairs.setdefault(a, {})[b] = bw
        pairs.setdefault(b, {})[a] = bw
    if len(pairs) < 2:
        raise ValueError("rank_nodes needs pair results covering 2 or more nodes")
    scores = {n: statistics.median(p.values()) for n, p in pairs.items()}
    med = statistics.median(scores.values())
    bad = sorted((n for n, s in scores.items() if s < threshold * med), key=lambda n: scores[n])
    return BadNodeReport(scores, pairs, med, threshold, bad)


def confirm_halves(hosts: list[str], suspects: list[str]) -> tuple[list[str], list[str]]:
    """Two node groups for the confirming pass: (clean half, suspect half).

    The suspect half holds every suspect, topped up with healthy nodes to half the cluster; the
    clean half holds the other healthy nodes. Each half must have 2 nodes to run a sweep.
    """
    unknown = [s for s in suspects if s not in hosts]
    if unknown:
        raise ValueError(f"suspects not among the hosts: {', '.join(unknown)}")
    healthy = [h for h in hosts if h not in suspects]
    size = max(2, len(hosts) // 2, len(suspects))
    fill = max(0, size - len(suspects))
    suspect_half = list(suspects) + healthy[:fill]
    clean_half = healthy[fill:]
    if len(clean_half) < 2:
        raise ValueError(
            f"{len(hosts)} hosts with {len(suspects)} suspects leave {len(clean_half)} healthy "
            "node(s) for the clean half; it needs 2 — trust the pair results instead"
        )
    return clean_half, suspect_half


def confirm_suspects(
    clean_busbw: float, suspect_busbw: float, suspects: list[str], threshold: float = 0.8
) -> list[str]:
    """The suspects, if the suspect half ran below threshold × the clean half; else []."""
    if clean_busbw <= 0:
        raise ValueError(f"clean half busbw must be > 0, got {clean_busbw}")
    return list(suspects) if suspect_busbw < threshold * clean_busbw else []


@dataclass(frozen=True)
class GroupResult:
    """One group's result in a launch of the search: its busbw at the largest size."""

    busbw: float
    iters: int | None  # timed calls behind it (fewer than -n where --pair-budget cut them)
    wrong: tuple[SweepRow, ...]  # rows with wrong results


def group_result(doc: dict[str, Any]) -> GroupResult:
    """A group's JSON document (gpufleet.groups.group_documents) as a GroupResult."""
    rows = [SweepRow.from_dict(d) for d in doc["rows"]]
    if not rows:
        return GroupResult(0.0, None, ())
    largest = max(r.size for r in rows)
    iters = [d.get("iters") for d in doc["rows"] if d["size"] == largest and d.get("iters") is not None]
    return GroupResult(
        max(r.best_busbw for r in rows if r.size == largest), min(iters, default=None), tuple(failures(rows))
    )


# ---- the search --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchOptions:
    """How the search judges and bounds itself (--threshold, --pair-budget)."""

    threshold: float = 0.8  # name nodes below this fraction of the median node score
    pair_budget: float = 1.0  # seconds each size of a pair's sweep may take (the sweep's --time-budget)

    def __post_init__(self) -> None:
        if not (self.pair_budget > 0 and math.isfinite(self.pair_budget)):
            raise UserError(f"--pair-budget {self.pair_budget} must be a number of seconds > 0")
        if not 0 < self.threshold <= 1:
            raise UserError(f"--threshold {self.threshold} must be in (0, 1]")


class SearchFailed(Exception):
    """A launch of the search gave no numbers: the search ends with exit status `code`."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Halves:
    """The confirming pass: each half's busbw, and the suspects it confirmed ([] if none)."""

    clean: tuple[str, ...]
    suspect: tuple[str, ...]
    clean_busbw: float
    suspect_busbw: float
    confirmed: tuple[str, ...]


Group = tuple[str, ...]
OnWrong = Callable[[Group, SweepRow], None]


def _check_cluster(cluster: Cluster, config: LaunchConfig) -> None:
    if cluster.local:
        raise UserError("--find-bad-nodes compares machines; --local has only this one")
    if config.dry_run:
        raise UserError(
            "--find-bad-nodes runs many launches, chosen as results come in; --dry-run "
            "shows one: drop --find-bad-nodes to see the sweep's command"
        )
    if len(cluster.nodes) < 3:
        raise UserError(f"--find-bad-nodes needs 3 or more nodes to tell a bad one apart; found {len(cluster.nodes)}")


class BadNodeSearch:
    """The search on `cluster`: `run_pairs`, then (unless decisive) `run_halves`; each a Launch
    of `config` (its job id and run directory are the parent of the search's runs) running the
    sweep of `sweep`. Every launch shares `stop`; `signals` holds those the launches received."""

    def __init__(
        self,
        cluster: Cluster,
        config: LaunchConfig,
        sweep: SweepSpec,
        options: SearchOptions,
        on_wrong: OnWrong | None = None,
    ):
        _check_cluster(cluster, config)
        self.cluster = cluster
        self.config = config
        self.options = options
        self.hosts = [n.host for n in cluster.nodes]
        self.rounds = pair_schedule(self.hosts)
        self.parent: Path = config.run_dir  # pairs.tsv, and one run directory per launch
        self.stop = threading.Event()
        self.signals: list[int] = []
        self._argv = [*sweep.sweep_argv(), "--time-budget", repr(float(options.pair_budget))]
        self._on_wrong = on_wrong or (lambda group, row: None)

    def run_pairs(self) -> dict[Group, GroupResult]:
        """Every pair, all rounds in one launch: each pair's result."""
        return self._run_plan([[list(p) for p in rnd] for rnd in self.rounds], "pairs")

    def rank(self, pairs: dict[Group, GroupResult]) -> BadNodeReport:
        return rank_nodes({(g[0], g[1]): r.busbw for g, r in pairs.items()}, self.options.threshold)

    def run_halves(self, suspects: list[str]) -> Halves:
        """The suspect half against the clean half, at once in one launch. Raises ValueError
        (before launching) when the cluster is too small to make two halves."""
        clean, dirty = confirm_halves(self.hosts, suspects)
        found = self._run_plan([[clean, dirty]], "halves")
        clean_bw, dirty_bw = found[tuple(clean)].busbw, found[tuple(dirty)].busbw
        confirmed = confirm_suspects(clean_bw, dirty_bw, suspects, self.options.threshold)
        return Halves(tuple(clean), tuple(dirty), clean_bw, dirty_bw, tuple(confirmed))

    def write_pairs(self, pairs: dict[Group, GroupResult]) -> Path:
        """pairs.tsv in the parent run directory: `a<TAB>b<TAB>busbw` per pair, sorted."""
        path = self.parent / "pairs.tsv"
        atomic.write_text(path, "".join(f"{g[0]}\t{g[1]}\t{r.busbw}\n" for g, r in sorted(pairs.items())))
        return path

    def _launch(self, plan: list[list[list[str]]], label: str) -> LaunchResult:
        """One Launch on every node running `plan` (rounds of host groups) as --rounds."""
        ranks = [[tuple(self.hosts.index(h) for h in g) for g in rnd] for rnd in plan]
        work = Workload("torchrun", ("-m", SWEEP_MODULE, *self._argv, "--rounds", format_rounds(ranks)))
        config = dataclasses.replace(
            self.config, workload=work, job_id=f"{self.config.job_id}-{label}", runs_dir=self.parent
        )
        # A detached job holding the nodes refuses each launch as it refuses any attached one.
        busy = BusyCheck(self.cluster, config, self.stop)
        on_event = busy.gate(lambda event: None)
        launch = Launch(self.cluster, config, on_event=on_event, stop=self.stop, verdict=prestart_verdict)
        try:
            result = launch.run()  # Launch handles SIGINT/SIGTERM while it runs
        except Interrupted as e:
            if busy.busy is not None:
                raise busy.refusal() from None
            raise SearchFailed("stopped before the sweep started", 128 + e.signum) from None
        except UserError as e:
            raise SearchFailed(f"the {label} sweep could not start: {e}", 1) from None
        finally:
            busy.close()
            self.signals += launch.signals
        if result.signal is not None or self.signals:
            raise SearchFailed("stopped", result.exit_code or 1)
        return result

    def _run_plan(self, plan: list[list[list[str]]], label: str) -> dict[Group, GroupResult]:
        result = self._launch(plan, label)
        text = "".join(p.read_text(errors="replace") for p in sorted(result.run_dir.glob("node-*.log")))
        found = {tuple(self.hosts[i] for i in doc["nodes"]): group_result(doc) for doc in group_documents(text)}
        for group, grp in found.items():
            for row in grp.wrong:
                self._on_wrong(group, row)
        if result.exit_code != 0:
            raise SearchFailed(
                f"the {label} sweep failed ({result.exit_code}); see {result.run_dir}/node-*.log", result.exit_code
            )
        missing = [g for rnd in plan for g in rnd if tuple(g) not in found]
        if missing:
            raise SearchFailed(
                f"the {label} sweep printed no rows for {'+'.join(missing[0])}; see {result.run_dir}/node-*.log", 1
            )
        return found
