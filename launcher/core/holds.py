"""Who holds a node: a registry on each node that every account reads and only the holder writes.

Several people's accounts share a cluster (OS Login gives each their own), and one person's
launch must not start on nodes another's job holds: its ranks would fight that job's for the GPUs
and the rendezvous port. Each node program (launcher.core.node_start, its prologue) registers its
job on its node before the check and removes the file when it ends:

    DIR/gpufleet-hold.UID.JOB     one line: v1 ACCOUNT UID JOB SINCE PID PIDSTART NODES

DIR is the first of HOLDS_DIRS that is root's, mode 1777 and not a link: /run/gpufleet-holds,
made by the node's startup script at every boot (a tmpfs: holds from before a reboot are gone
with their jobs), else /tmp, which every Linux has in that shape. A directory any account could
make (`/tmp/gpufleet-holds`) is never used: its maker could remove or forge every hold in it.
In a sticky directory only a file's owner removes it; a hold is believed only when the file's
owner is the UID it names, and only while PID (the node program) still runs with the
start time PIDSTART (field 22 of /proc/PID/stat): a job killed without its cleanup blocks no one.
The file is created with noclobber (O_EXCL), readable by all (umask 022).

The check prints every live hold of another account (`hold.N=ACCOUNT JOB SINCE NODES`) and this
launch's own SINCE (`hold_since=`); `refuse_held` refuses a launch on nodes held by an older job
(two launches racing for the same nodes: the younger is refused, on every node alike).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpufleet.contracts import HOLDS_DIR
from launcher.core.types import UserError

__all__ = [
    "HOLDS_DIRS",
    "Hold",
    "HeldError",
    "holds_script",
    "parse_holds",
    "held_by_others",
    "by_job",
    "refuse_held",
]

HOLDS_DIRS = (HOLDS_DIR, "/tmp")
FILE_PREFIX = "gpufleet-hold."
LIST_MARKER = "__GPUFLEET_HOLD__"


def _pick(dirs: tuple[str, ...]) -> str:
    """The registry's directory: the first of `dirs` that is root's, 1777 and not a link (none: empty)."""
    return (
        f"HD=; for HX in {' '.join(shlex.quote(d) for d in dirs)}; do "
        'if [ -d "$HX" ] && [ ! -L "$HX" ] && [ "$(stat -c %u:%a "$HX" 2>/dev/null)" = 0:1777 ]; then HD=$HX; '
        "break; fi; done"
    )


# `hold_live F`: F's line in $HL, true when it is believed (its owner is the UID it names, its bash
# runs with the start time it names and is not a zombie: a job killed before its cleanup whose
# parent has not reaped it yet holds nothing); a function, so `set --` leaves the program's own
# arguments. /proc/PID/stat is read after its `(comm) `, which may hold spaces.
_LIVE = (
    'hold_live() { HL=; read -r HL 2>/dev/null <"$1"; HO=$(stat -c %u "$1" 2>/dev/null); set -- $HL; '
    '[ "$1" = v1 ] && [ $# -ge 8 ] && [ "$HO" = "$3" ] && '
    'HT=$7 && HT2=$(sed "s/.*) //" "/proc/$6/stat" 2>/dev/null) && set -- $HT2 && [ "$1" != Z ] && '
    '[ "${20}" = "$HT" ]; }'
)
# `hold_say PREFIX`: PREFIX ACCOUNT JOB SINCE NODES, of the line in $HL.
_SAY = 'hold_say() { set -- "$1" $HL; echo "$1$3 $5 $6 $9"; }'


@dataclass(frozen=True)
class Hold:
    """One job's hold on one node (as its registry file says)."""

    account: str
    job: str
    since: float  # the node's clock, when the job's program registered
    nodes: tuple[str, ...]  # every host of the job, as its launcher named them

    def line(self, labels: list[str]) -> str:
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"{self.account}'s job {self.job}, since {at}, holds {', '.join(labels)}"


class HeldError(UserError):
    """A launch refused: another account's job holds some of its nodes (`holds`: hold -> labels)."""

    def __init__(self, message: str, holds: dict[Hold, list[str]]):
        super().__init__(message)
        self.holds = holds


def holds_script(dirs: tuple[str, ...] = HOLDS_DIRS) -> str:
    """Every live hold on a node, each line LIST_MARKER ACCOUNT JOB SINCE NODES (any account's)."""
    return "; ".join(
        [
            _pick(dirs),
            _LIVE,
            _SAY,
            '[ -n "$HD" ] || exit 0',
            f'for HX in "$HD"/{FILE_PREFIX}*; do hold_live "$HX" && hold_say "{LIST_MARKER} "; done',
            "exit 0",
        ]
    )


def _hold(text: str) -> Hold | None:
    parts = text.split()
    if len(parts) != 4:
        return None
    try:
        since = float(parts[2])
    except ValueError:
        return None
    return Hold(parts[0], parts[1], since, tuple(h for h in parts[3].split(",") if h and h != "-"))


def parse_holds(out: str) -> list[Hold]:
    """The holds in `holds_script`'s output (anything else on stdout, a banner, is skipped)."""
    found = [_hold(line.split(LIST_MARKER, 1)[1]) for line in out.splitlines() if line.startswith(LIST_MARKER + " ")]
    return [h for h in found if h is not None]


def held_by_others(facts: Mapping[str, str]) -> list[Hold]:
    """The holds one node's check reported that come before this launch's own: all of them when
    this launch could not register (no registry, or its file was there already)."""
    holds = [h for k, v in facts.items() if k.startswith("hold.") and (h := _hold(v)) is not None]
    try:
        mine = float(facts["hold_since"])
    except (KeyError, ValueError):
        return holds
    return [h for h in holds if h.since <= mine]


def by_job(found: Iterable[tuple[Hold, str]]) -> dict[Hold, list[str]]:
    """(hold, node label) pairs as one Hold per job (each node registers at its own moment: the
    earliest is the job's since) with the labels of its nodes, oldest job first."""
    jobs: dict[tuple[str, str], tuple[Hold, list[str]]] = {}
    for h, label in found:
        first, labels = jobs.get((h.account, h.job), (h, []))
        jobs[(h.account, h.job)] = (min(first, h, key=lambda x: x.since), [*labels, label])
    return dict(sorted(jobs.values(), key=lambda kv: kv[0].since))


def refuse_held(labels: Mapping[int, str], facts: Mapping[int, Mapping[str, str]]) -> None:
    """HeldError naming the account, the job, since when and the nodes of every job of another
    account that holds some of this launch's nodes (`labels`, `facts`: by rank)."""
    held = by_job((h, labels[rank]) for rank in sorted(facts) for h in held_by_others(facts[rank]))
    if not held:
        return
    lines = "; ".join(h.line(nodes) for h, nodes in held.items())
    raise HeldError(f"{lines}; nothing was started. Add --wait to wait for the nodes", held)
