"""`launch top`'s library: one long-lived session per node streaming samples (launcher.observe.sampler),
turned into one `NodeRow` per node: GPU, CPU and per-role NIC rates, outliers flagged.

No rich here (the CLI renders, launcher.cli.cmd_top) and no click: a detached job's controller
(python -S on node 0) drives the same `TopSampler` with its own interval and an `on_row` that appends to the
job record, exactly as `launch top --record` does.

NIC roles. The catalog says which interfaces are the host NIC and which the GPU NICs for the
machine type and image OS (gpufleet.catalog: `MachineType.nics`, `interface_names`). What the
catalog cannot name (a hostfile without a machine type; single-NIC Ubuntu types whose name
depends on the PCI slot) is resolved on the node: the host NIC is the interface holding the
node's address, else the one the default route leaves through; every other interface is
"other". On A3 Ultra / A4 the GPU NICs are the CX-7 ports under /sys/class/infiniband.

The *data NICs* of a node are its GPU NICs, or its host NIC where it has none (A2 and the small
A3 types send NCCL's traffic over the host NIC; so does every simulated node). A node whose data
NICs move less than half the cluster's median is flagged: in a synchronous collective every
node moves about the same bytes, so one that moves far fewer is the one to look at.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import statistics
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from gpufleet.catalog import lookup
from launcher.core.types import Cluster, Node
from launcher.observe.sampler import Counters, Delta, NodeStream, delta, node_program

__all__ = [
    "SCHEMA",
    "HOST",
    "GPU",
    "OTHER",
    "FLAG_FRACTION",
    "FLAG_FLOOR_GBPS",
    "NodeStatus",
    "RolePlan",
    "role_plan",
    "nic_roles",
    "NicRate",
    "NodeRow",
    "build_row",
    "flag_outliers",
    "slowest",
    "sparkline",
    "to_record",
    "Recorder",
    "TopSampler",
]

# The record's schema name; bump the number when a field changes meaning (docs/top.md lists the fields).
SCHEMA = "gpufleet.top/1"

HOST, GPU, OTHER = "host", "gpu", "other"

# Flag a node whose data NICs move less than this fraction of the cluster's median (the laggard
# every collective waits on)...
FLAG_FRACTION = 0.5
# ...once the median itself is traffic: below 10 Mbit/s (SSH, this view's own stream, ARP) an
# idle cluster is not a collective with an outlier.
FLAG_FLOOR_GBPS = 0.01


class NodeStatus(str, enum.Enum):
    """Where a node's session stands; changes only in `TopSampler._set`."""

    CONNECTING = "connecting"
    OK = "ok"
    STALE = "stale"  # connected, but no sample for a while (a hung node, a stalled link)
    UNREACHABLE = "unreachable"  # the session ended; retried every `retry_s`


@dataclass(frozen=True)
class RolePlan:
    """What the catalog says about a cluster's NICs, by interface name."""

    host_names: frozenset[str] = frozenset()
    gpu_names: frozenset[str] = frozenset()
    rdma: bool = False  # the GPU NICs are the infiniband ports (A3 Ultra, A4)


def role_plan(machine_type: str | None, image_os: str | None = None) -> RolePlan:
    """The role of each NIC name the catalog gives for `machine_type` on `image_os` (default:
    the type's default image). An unknown type raises the catalog's UnknownMachineType."""
    if not machine_type:
        return RolePlan()
    mt = lookup(machine_type)
    names = mt.interface_names(image_os)
    host = frozenset(n for nic, n in zip(mt.nics, names) if n and nic.role == "host")
    gpu = frozenset(n for nic, n in zip(mt.nics, names) if n and nic.role in ("gpu", "rdma"))
    return RolePlan(host, gpu, rdma=any(nic.role == "rdma" for nic in mt.nics))


def nic_roles(
    plan: RolePlan,
    ifaces: Iterable[str],
    ib_ports: Iterable[str],
    address: str,
    addresses: dict[str, str],
    default_iface: str | None,
) -> dict[str, str]:
    """{name: role} for a node's netdevs and infiniband ports ("ib:DEV/PORT")."""
    roles = {}
    for name in ifaces:
        roles[name] = GPU if name in plan.gpu_names else HOST if name in plan.host_names else OTHER
    if HOST not in roles.values():
        # The catalog names none here: the interface holding the address other nodes reach this
        # one at (what launcher.core.program resolves for the host NIC), else the default route's.
        iface = addresses.get(address)
        if iface not in roles:
            iface = default_iface
        if iface in roles:
            roles[iface] = HOST
    for port in ib_ports:
        roles[f"ib:{port}"] = GPU if plan.rdma else OTHER
    return roles


@dataclass(frozen=True)
class NicRate:
    name: str
    role: str
    rx_gbps: float
    tx_gbps: float


@dataclass
class NodeRow:
    """One node at one moment: what the table shows and the record keeps. None = not known
    (no GPU, no NIC of that role, or no second sample yet to take a rate from)."""

    node: Node
    status: NodeStatus = NodeStatus.CONNECTING
    error: str = ""
    t: float | None = None  # the node's clock at the sample, s since the epoch
    received: float | None = None  # this machine's clock when it arrived
    interval_s: float | None = None  # since the node's previous sample
    gpu_count: int | None = None  # None: no nvidia-smi on the node
    gpu_util_mean: float | None = None
    gpu_util_min: float | None = None
    gpu_mem_used_mib: float | None = None  # summed over the node's GPUs
    gpu_mem_total_mib: float | None = None
    gpu_power_w: float | None = None  # summed
    gpu_temp_c: float | None = None  # the hottest GPU
    cpu_util_pct: float | None = None  # all CPUs, busy share of the interval
    host_rx: float | None = None  # Gbit/s, host NIC(s) summed
    host_tx: float | None = None
    gpu_rx: float | None = None  # GPU NICs summed
    gpu_tx: float | None = None
    gpu_slowest_rx: float | None = None  # the GPU NIC that moved least, per direction
    gpu_slowest_tx: float | None = None
    nics: list[NicRate] = field(default_factory=list)
    counter_resets: tuple[str, ...] = ()
    flagged: bool = False

    @property
    def data_gbps(self) -> float | None:
        """rx + tx on the data NICs: the GPU NICs, or the host NIC on a node with none."""
        if any(n.role == GPU for n in self.nics):
            return (self.gpu_rx or 0.0) + (self.gpu_tx or 0.0)
        if self.host_rx is None:
            return None
        return self.host_rx + (self.host_tx or 0.0)


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def build_row(node: Node, counters: Counters, d: Delta | None, roles: dict[str, str], received: float) -> NodeRow:
    """The row for one sample of `node` (rates from `d`, None on its first sample)."""
    row = NodeRow(node, NodeStatus.OK, t=counters.t_us / 1e6, received=received)
    if counters.gpus is not None:
        g = counters.gpus
        row.gpu_count = len(g)
        utils = [x.util_pct for x in g if x.util_pct is not None]
        if utils:
            row.gpu_util_mean = sum(utils) / len(utils)
            row.gpu_util_min = min(utils)
        row.gpu_mem_used_mib = _sum([x.mem_used_mib for x in g])
        row.gpu_mem_total_mib = _sum([x.mem_total_mib for x in g])
        row.gpu_power_w = _sum([x.power_w for x in g])
        temps = [x.temp_c for x in g if x.temp_c is not None]
        row.gpu_temp_c = max(temps) if temps else None
    if d is None:
        return row
    row.interval_s = d.dt_s
    row.cpu_util_pct = d.cpu_util_pct
    row.counter_resets = d.resets
    rates = {**d.nic_gbps, **{f"ib:{k}": v for k, v in d.ib_gbps.items()}}
    row.nics = [NicRate(n, roles.get(n, OTHER), rx, tx) for n, (rx, tx) in sorted(rates.items())]
    host = [n for n in row.nics if n.role == HOST]
    gpu = [n for n in row.nics if n.role == GPU]
    if host:
        row.host_rx, row.host_tx = sum(n.rx_gbps for n in host), sum(n.tx_gbps for n in host)
    if gpu:
        row.gpu_rx, row.gpu_tx = sum(n.rx_gbps for n in gpu), sum(n.tx_gbps for n in gpu)
        row.gpu_slowest_rx, row.gpu_slowest_tx = min(n.rx_gbps for n in gpu), min(n.tx_gbps for n in gpu)
    return row


def flag_outliers(
    rows: Sequence[NodeRow], fraction: float = FLAG_FRACTION, floor_gbps: float = FLAG_FLOOR_GBPS
) -> set[int]:
    """Ranks of reachable nodes whose data NICs move less than `fraction` of the median of all
    reachable nodes, once that median is above `floor_gbps`."""
    values = {r.node.rank: r.data_gbps for r in rows if r.status is NodeStatus.OK and r.data_gbps is not None}
    if len(values) < 2:
        return set()
    median = statistics.median(values.values())
    if median < floor_gbps:
        return set()
    return {rank for rank, v in values.items() if v < fraction * median}


# Which end of a column is the slow one: the least GPU use, power and traffic; the hottest GPU
# (clocks throttle with heat) and the busiest CPU (a data loader starving the GPUs).
_WORST_IS_HIGH = {"gpu_temp_c", "cpu_util_pct"}


def slowest(rows: Sequence[NodeRow], column: str) -> int | None:
    """The rank of the node at the slow end of `column` among reachable nodes, or None when
    fewer than two report it or they all report the same."""
    values = [
        (getattr(r, column), r.node.rank) for r in rows if r.status is NodeStatus.OK and getattr(r, column) is not None
    ]
    if len(values) < 2 or len({v for v, _ in values}) == 1:
        return None
    pick = max if column in _WORST_IS_HIGH else min
    return pick(values)[1]


_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], top: float) -> str:
    """One block character per value, scaled to `top` (the same top for every node, so heights
    compare across rows); a gap where a value is missing."""
    out = []
    for v in values:
        if v is None or math.isnan(v):
            out.append(" ")
        elif top <= 0:
            out.append(_BLOCKS[0])
        else:
            out.append(_BLOCKS[min(len(_BLOCKS) - 1, max(0, int(v / top * (len(_BLOCKS) - 1) + 0.5)))])
    return "".join(out)


def _r(v: float | None, nd: int = 4) -> float | None:
    return None if v is None else round(v, nd)


def to_record(row: NodeRow, session: str) -> dict:
    """One line of the `--record` JSONL file (schema SCHEMA; docs/top.md lists the fields)."""
    rec: dict = {
        "schema": SCHEMA,
        "session": session,
        "node": row.node.rank,
        "host": row.node.host,
        "name": row.node.name or None,
        "status": row.status.value,
        "error": row.error or None,
        "t": _r(row.t, 6),
        "received": _r(row.received, 6),
        "interval_s": _r(row.interval_s),
        "cpu_util_pct": _r(row.cpu_util_pct, 2),
        "gpu": None
        if row.gpu_count is None
        else {
            "count": row.gpu_count,
            "util_mean_pct": _r(row.gpu_util_mean, 2),
            "util_min_pct": _r(row.gpu_util_min, 2),
            "mem_used_mib": row.gpu_mem_used_mib,
            "mem_total_mib": row.gpu_mem_total_mib,
            "power_w": _r(row.gpu_power_w, 2),
            "temp_max_c": row.gpu_temp_c,
        },
        "host_rx_gbps": _r(row.host_rx, 6),
        "host_tx_gbps": _r(row.host_tx, 6),
        "gpu_nic_rx_gbps": _r(row.gpu_rx, 6),
        "gpu_nic_tx_gbps": _r(row.gpu_tx, 6),
        "gpu_nic_slowest_rx_gbps": _r(row.gpu_slowest_rx, 6),
        "gpu_nic_slowest_tx_gbps": _r(row.gpu_slowest_tx, 6),
        "data_gbps": _r(row.data_gbps, 6),
        "nics": [
            {"name": n.name, "role": n.role, "rx_gbps": _r(n.rx_gbps, 6), "tx_gbps": _r(n.tx_gbps, 6)} for n in row.nics
        ],
        "counter_resets": list(row.counter_resets),
        "flagged": row.flagged,
    }
    return rec


class Recorder:
    """Appends one JSON object per node per sample to a file (never truncates: a second view
    into the same file adds a session of its own). Safe to call from several threads."""

    def __init__(self, path: Path, session: str):
        self.path = Path(path)
        self.session = session
        self._lock = threading.Lock()
        self._fh: IO[str] | None = open(self.path, "a", encoding="utf-8")
        self.lines = 0

    def write(self, row: NodeRow) -> None:
        line = json.dumps(to_record(row, self.session), separators=(",", ":")) + "\n"
        with self._lock:
            if self._fh is None:
                return
            self._fh.write(line)  # one line per write, flushed: a reader never sees half a line
            self._fh.flush()
            self.lines += 1

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


class _NodeRun:
    """What the sampler keeps about one node."""

    def __init__(self, node: Node, history: int):
        self.node = node
        self.row = NodeRow(node)
        self.proc: subprocess.Popen | None = None
        self.prev: Counters | None = None
        self.last_at: float | None = None  # monotonic time of the last sample
        self.history: deque[float | None] = deque(maxlen=history)
        self.gpu_history: deque[float | None] = deque(maxlen=history)
        self.err: deque[str] = deque(maxlen=5)
        self.left = False  # no longer viewed (TopSampler.follow): its session ends, its loop too


class _Handshake:
    """Holds one of the sampler's handshake slots until `done()` or the end of the block."""

    def __init__(self, slots: threading.BoundedSemaphore):
        self._slots = slots
        self._held = False

    def __enter__(self) -> "_Handshake":
        self._slots.acquire()
        self._held = True
        return self

    def done(self) -> None:
        if self._held:
            self._held = False
            self._slots.release()

    def __exit__(self, *exc) -> None:
        self.done()


class TopSampler:
    """Streams samples from every node of `cluster`, one session per node, until `stop()`.

    `argv_for(node, script)` turns the node program into the command that runs it there (the
    launcher's Transport.argv: the same ssh options, control sockets and known_hosts as a
    launch). `on_row(row)` is called from the node's reader thread for every new row (a sample,
    or the node becoming unreachable). A node whose session ends is shown unreachable and
    retried every `retry_s` seconds; `rows()` is the newest row of every node, in rank order,
    with outliers flagged. At most `concurrency` sessions are in their SSH handshake at once
    (sshd's MaxStartups default starts refusing at 10)."""

    def __init__(
        self,
        cluster: Cluster,
        argv_for: Callable[[Node, str], list[str]],
        *,
        interval_s: float = 1.0,
        plan: RolePlan | None = None,
        on_row: Callable[[NodeRow], None] | None = None,
        concurrency: int = 8,
        retry_s: float = 5.0,
        history_s: float = 60.0,
    ):
        self.cluster = cluster
        self.interval_s = interval_s
        self.plan = plan or RolePlan()
        self.script = node_program(interval_s)
        self._argv_for = argv_for
        self._on_row = on_row
        self._retry_s = retry_s
        # A sample later than this is overdue: three intervals, and never under 3 s.
        self.stale_after_s = max(3.0, 3 * interval_s)
        self._handshakes = threading.BoundedSemaphore(max(1, concurrency))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._n_hist = max(2, int(round(history_s / interval_s)))
        self._runs = {n.rank: _NodeRun(n, self._n_hist) for n in cluster.nodes}
        self._threads: list[threading.Thread] = []
        self._started = False

    # ---- life ----

    def start(self) -> "TopSampler":
        with self._lock:
            self._started = True
            runs = list(self._runs.values())
        for run in runs:
            self._begin(run)
        return self

    def _begin(self, run: _NodeRun) -> None:
        t = threading.Thread(target=self._node_loop, args=(run,), daemon=True, name=f"top-node-{run.node.host}")
        t.start()
        self._threads.append(t)

    def follow(self, nodes: Sequence[Node]) -> tuple[list[Node], list[Node]]:
        """View `nodes` from now on (a detached job swapped a spare in for a lost node): a session
        for each node new to the view, the sessions of the nodes that left it ended, ranks as
        `nodes` gives them; a node still viewed keeps its session and history. (the nodes
        added, the nodes that left)."""
        with self._lock:
            by_host = {run.node.host: run for run in self._runs.values()}
            runs: dict[int, _NodeRun] = {}
            added = []
            for n in nodes:
                run = by_host.pop(n.host, None)
                if run is None:
                    run = _NodeRun(n, self._n_hist)
                    added.append(run)
                run.node, run.row = n, replace(run.row, node=n)
                runs[n.rank] = run
            left = list(by_host.values())
            self._runs = runs
            for run in left:
                run.left = True
            procs = [run.proc for run in left if run.proc is not None]
            started = self._started
        for p in procs:  # the node loop sees `left` and starts no other session
            with contextlib.suppress(OSError, AttributeError):
                p.stdin.close()
            with contextlib.suppress(OSError):
                p.terminate()
        if started and not self._stop.is_set():  # before start(), start() begins them
            for run in added:
                self._begin(run)
        return [r.node for r in added], [r.node for r in left]

    def stop(self, timeout: float = 5.0) -> None:
        """End every session: close its stdin (the node's loop ends on end of input), then kill
        what has not exited within `timeout`."""
        self._stop.set()
        with self._lock:
            procs = [r.proc for r in self._runs.values() if r.proc is not None]
        for p in procs:
            try:
                p.stdin.close()
            except (OSError, AttributeError):
                pass
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> "TopSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what a view reads ----

    def rows(self) -> list[NodeRow]:
        """The newest row of every node (rank order); overdue nodes STALE, outliers flagged."""
        now = time.monotonic()
        with self._lock:
            rows = []
            for run in self._runs.values():
                row = run.row
                if row.status is NodeStatus.OK and run.last_at is not None and now - run.last_at > self.stale_after_s:
                    row = replace(row, status=NodeStatus.STALE, error=f"no sample for {now - run.last_at:.0f} s")
                else:
                    row = replace(row)
                rows.append(row)
        flagged = flag_outliers(rows)
        for row in rows:
            row.flagged = row.node.rank in flagged
        return rows

    def history(self, rank: int) -> tuple[list[float | None], list[float | None]]:
        """The last minute of (data NIC Gbit/s, mean GPU util %) samples of node `rank`."""
        with self._lock:
            run = self._runs[rank]
            return list(run.history), list(run.gpu_history)

    def pids(self) -> dict[int, int]:
        """The launcher-side process (ssh) of each connected node, by rank."""
        with self._lock:
            return {r: run.proc.pid for r, run in self._runs.items() if run.proc and run.proc.poll() is None}

    # ---- one node ----

    def _node_loop(self, run: _NodeRun) -> None:
        while not self._stop.is_set() and not run.left:
            self._session(run)
            if self._stop.wait(self._retry_s):
                return

    def _session(self, run: _NodeRun) -> None:
        stream = NodeStream()
        rc: int | None = None
        with _Handshake(self._handshakes) as handshake:
            if self._stop.is_set():
                return
            try:
                proc = subprocess.Popen(
                    self._argv_for(run.node, self.script),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    errors="replace",
                    bufsize=1,
                    # A terminal's Ctrl-C reaches only the launcher, which ends every session in order.
                    start_new_session=True,
                )
            except OSError as e:  # no ssh client here, say: out of reach all the same
                run.err.append(f"cannot start the session: {e}")
                proc = None
            if proc is not None:
                with self._lock:
                    run.proc = proc
                    gone = run.left
                if gone:  # it left the view while this session started
                    with contextlib.suppress(OSError):
                        proc.terminate()
                threading.Thread(target=self._read_err, args=(run, proc), daemon=True).start()
                for line in proc.stdout:
                    handshake.done()  # the node answered: the next node may connect
                    counters = stream.feed(line)
                    if counters is not None:
                        self._sample(run, stream, counters)
                rc = proc.wait()
        if self._stop.is_set() or run.left:
            return
        why = run.err[-1] if run.err else (stream.other[-1] if stream.other else f"session ended (exit {rc})")
        with self._lock:
            run.prev = None
            run.history.append(None)
            run.gpu_history.append(None)
            run.row = NodeRow(run.node, NodeStatus.UNREACHABLE, error=why, received=time.time())
            row = run.row
        if self._on_row:
            self._on_row(row)

    @staticmethod
    def _read_err(run: _NodeRun, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            line = line.strip()
            if line:
                run.err.append(line)

    def _sample(self, run: _NodeRun, stream: NodeStream, counters: Counters) -> None:
        roles = nic_roles(
            self.plan, counters.nics, counters.ib, run.node.address, stream.hello.addresses, stream.hello.default_iface
        )
        row = build_row(run.node, counters, delta(run.prev, counters), roles, time.time())
        with self._lock:
            others = [r.row for rank, r in self._runs.items() if rank != run.node.rank]
        # Flagged against every other node's newest row, so the record says what the view did.
        row.flagged = run.node.rank in flag_outliers([*others, row])
        with self._lock:
            run.prev = counters
            run.last_at = time.monotonic()
            run.row = row
            run.history.append(row.data_gbps)
            run.gpu_history.append(row.gpu_util_mean)
        if self._on_row:
            self._on_row(row)
