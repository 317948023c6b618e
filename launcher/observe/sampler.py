"""`launch top`'s node side: the program each node runs for the whole view, and reading what it
prints. Pure functions and small state machines; no processes here (launcher.observe.top runs them).

One SSH session per node carries one long-lived bash loop (not a session per sample). Each turn
it reads, with bash builtins only (no fork, so nothing is installed and little is spent):
- `/proc/stat`'s first line: the jiffies every CPU spent per state (proc(5), "/proc/stat");
- `/sys/class/net/IFACE/statistics/{rx,tx}_bytes` for every interface but `lo` (the kernel's
  per-interface byte counters, Documentation/ABI/testing/sysfs-class-net-statistics);
- `/sys/class/infiniband/DEV/ports/N/counters/port_{rcv,xmit}_data` where present: RDMA traffic
  (A3 Ultra / A4 CX-7 NICs carry NCCL's data over verbs, which the netdev counters do not see);
  the kernel counts them in units of 4 octets (Documentation/ABI/stable/sysfs-class-infiniband:
  "Total number of data octets, divided by 4");
and prints them as one line. It waits for the next turn with `read -t` on its stdin, which is
the launcher's end of the session: a line or end of input (the launcher closed it, Ctrl-C, or
the connection dropped) ends the loop at once, so nothing outlives the view on the node.

GPUs: where `nvidia-smi` exists, one `nvidia-smi --query-gpu=... --format=csv,noheader,nounits
-lms N` runs beside the loop for the whole view (its loop mode keeps NVML initialised, so a
sample costs a query, not a driver start); its lines go straight to the same stdout (each is one
write(2) under PIPE_BUF, so lines never interleave mid-line). It is killed when the loop ends;
should the loop itself be killed, its next write to the closed session ends it (SIGPIPE).

The stream, one record per line:
    H gpufleet-top <version> <hostname>     once, first
    A <iface> <address>                     once per address the node holds (from `ip -o addr`)
    R <iface>                               the interface of the default route, when there is one
    P gpu nvidia-smi|none                   whether GPU lines will come
    S <t_us> c <8 cpu jiffies> [n <iface> <rx_bytes> <tx_bytes>]... [i <dev/port> <rx4> <tx4>]...
    <index>, <util %>, <mem used MiB>, <mem total MiB>, <power W>, <temp C>     (nvidia-smi)
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field

__all__ = [
    "PROTOCOL_VERSION",
    "GPU_FIELDS",
    "node_program",
    "Counters",
    "GpuReading",
    "Hello",
    "NodeStream",
    "Delta",
    "delta",
    "parse_gpu_line",
]

PROTOCOL_VERSION = 1

# What nvidia-smi is asked each turn (`nvidia-smi --help-query-gpu` documents each field; with
# `nounits`, memory is in MiB, power in W, temperature in C, utilization in %).
GPU_FIELDS = ("index", "utilization.gpu", "memory.used", "memory.total", "power.draw", "temperature.gpu")

# What nvidia-smi prints for a value it cannot give (nvidia-smi(1); gpufleet.health reads the
# same set for doctor's query).
_NOT_A_VALUE = {
    "[N/A]",
    "N/A",
    "[Not Supported]",
    "[Unknown Error]",
    "[Insufficient Permissions]",
    "[GPU is lost]",
    "[Requires Pstate Change]",
    "",
}

# The jiffy columns of /proc/stat's `cpu` line we read: user nice system idle iowait irq softirq
# steal (proc(5)); guest time is already counted in user.
_CPU_FIELDS = 8


def node_program(interval_s: float) -> str:
    """The bash program a node runs for `launch top` (see the module docstring for its output).

    Needs bash 5 (EPOCHREALTIME, for a drift-free schedule without forking `date`); COS and
    Ubuntu GPU images ship bash 5."""
    if not 0.05 <= interval_s <= 3600:
        raise ValueError(f"interval {interval_s} s is outside 0.05..3600 s")
    us = int(round(interval_s * 1e6))
    ms = max(1, int(round(interval_s * 1e3)))
    gpu_query = ",".join(GPU_FIELDS)
    # ${EPOCHREALTIME//[!0-9]/}: microseconds since the epoch as an integer, whatever the
    # locale's decimal separator (bash prints it with the locale's radix character).
    return _one_line(f"""\
[ -n "$EPOCHREALTIME" ] || {{ echo "gpufleet top: bash $BASH_VERSION has no EPOCHREALTIME; bash 5 is needed" >&2; exit 3; }}
echo "H gpufleet-top {PROTOCOL_VERSION} $HOSTNAME"
ip -o addr show 2>/dev/null | while read -r _ d f a _; do case $f in inet|inet6) echo "A ${{d%@*}} ${{a%/*}}";; esac; done
ip -o route show default 2>/dev/null | {{ read -r -a w; for ((k=0; k<${{#w[@]}}; k++)); do if [ "${{w[k]}}" = dev ]; then echo "R ${{w[k+1]}}"; break; fi; done; }}
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu={gpu_query} --format=csv,noheader,nounits -lms {ms} </dev/null &
  G=$!
  trap 'kill $G 2>/dev/null' EXIT
  echo "P gpu nvidia-smi"
else
  echo "P gpu none"
fi
next=${{EPOCHREALTIME//[!0-9]/}}
while :; do
  read -r _ u n s i w q x t _ </proc/stat
  l="S ${{EPOCHREALTIME//[!0-9]/}} c $u $n $s $i $w $q $x $t"
  for d in /sys/class/net/*/statistics; do
    f=${{d%/statistics}}; f=${{f##*/}}
    [ "$f" = lo ] && continue
    read -r rx 2>/dev/null <"$d/rx_bytes" && read -r tx 2>/dev/null <"$d/tx_bytes" && l+=" n $f $rx $tx"
  done
  for d in /sys/class/infiniband/*/ports/*/counters; do
    p=${{d%/counters}}; f=${{p%/ports/*}}
    read -r rx 2>/dev/null <"$d/port_rcv_data" && read -r tx 2>/dev/null <"$d/port_xmit_data" && l+=" i ${{f##*/}}/${{p##*/}} $rx $tx"
  done
  echo "$l"
  next=$((next + {us})); d=$((next - ${{EPOCHREALTIME//[!0-9]/}}))
  if [ $d -le 0 ]; then next=${{EPOCHREALTIME//[!0-9]/}}; d=1000; fi
  printf -v T '%d.%06d' $((d / 1000000)) $((d % 1000000))
  read -r -t "$T" _; r=$?
  [ $r -gt 128 ] || exit 0
done""")


def _one_line(script: str) -> str:
    # One line, as every node program of the launcher is (so --dry-run prints one per node): a
    # line that opens a compound command or ends in `&` needs no `;` after it.
    out = []
    for line in (raw.strip() for raw in script.splitlines()):
        if line:
            out.append(line if line.endswith(("do", "then", "else", "{", "&")) else line + ";")
    return " ".join(out).rstrip(";")


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one moment, as nvidia-smi reported it. None = the GPU did not report it."""

    index: int
    util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    power_w: float | None
    temp_c: float | None


def _num(raw: str) -> float | None:
    raw = raw.strip()
    if raw in _NOT_A_VALUE:
        return None
    return float(raw)


def parse_gpu_line(line: str) -> GpuReading | None:
    """One line of `nvidia-smi --query-gpu=<GPU_FIELDS> --format=csv,noheader,nounits`, or None
    when the line is not one (a message nvidia-smi printed instead)."""
    fields = next(csv.reader([line], skipinitialspace=True), [])
    if len(fields) != len(GPU_FIELDS) or not fields[0].strip().isdigit():
        return None
    try:
        util, used, total, power, temp = (_num(f) for f in fields[1:])
    except ValueError:
        return None
    return GpuReading(int(fields[0]), util, used, total, power, temp)


@dataclass(frozen=True)
class Counters:
    """One turn of a node's loop: raw counters, as read (no rates yet)."""

    t_us: int  # the node's clock, microseconds since the epoch
    cpu: tuple[int, ...]  # /proc/stat jiffies: user nice system idle iowait irq softirq steal
    nics: dict[str, tuple[int, int]]  # iface -> (rx_bytes, tx_bytes)
    ib: dict[str, tuple[int, int]] = field(default_factory=dict)  # "dev/port" -> (rx, tx) bytes
    gpus: tuple[GpuReading, ...] | None = None  # None: the node has no nvidia-smi


@dataclass
class Hello:
    """What a node says once, before its first sample."""

    version: int = 0
    hostname: str = ""
    addresses: dict[str, str] = field(default_factory=dict)  # address -> iface
    default_iface: str | None = None
    gpu_source: str | None = None  # "nvidia-smi" or "none"


class NodeStream:
    """Reads one node's stream line by line: `feed(line)` returns the `Counters` an `S` line
    completes (with the newest reading of each GPU so far), else None."""

    def __init__(self) -> None:
        self.hello = Hello()
        self._gpus: dict[int, GpuReading] = {}
        self.other: list[str] = []  # lines that are none of ours (a login banner, a message)

    def feed(self, line: str) -> Counters | None:
        line = line.rstrip("\r\n")
        tag, _, rest = line.partition(" ")
        if tag == "S":
            return self._sample(rest)
        if tag == "H":
            parts = rest.split()
            if len(parts) >= 2 and parts[0] == "gpufleet-top" and parts[1].isdigit():
                self.hello.version = int(parts[1])
                self.hello.hostname = parts[2] if len(parts) > 2 else ""
                return None
        elif tag == "A":
            parts = rest.split()
            if len(parts) == 2:
                self.hello.addresses[parts[1]] = parts[0]
                return None
        elif tag == "R" and rest:
            self.hello.default_iface = rest.split()[0]
            return None
        elif tag == "P" and rest.startswith("gpu "):
            self.hello.gpu_source = rest.split()[1]
            return None
        elif line[:1].isdigit():
            gpu = parse_gpu_line(line)
            if gpu is not None:
                self._gpus[gpu.index] = gpu
                return None
        self.other.append(line)
        return None

    def _sample(self, rest: str) -> Counters | None:
        tok = rest.split()
        try:
            t_us = int(tok[0])
            i = 1
            cpu: tuple[int, ...] = ()
            nics: dict[str, tuple[int, int]] = {}
            ib: dict[str, tuple[int, int]] = {}
            while i < len(tok):
                kind = tok[i]
                if kind == "c":
                    # Empty fields (an old kernel without steal) read as missing, not zero.
                    cpu = tuple(int(v) for v in tok[i + 1 : i + 1 + _CPU_FIELDS] if v.isdigit())
                    i += 1 + len(cpu)
                elif kind == "n":
                    nics[tok[i + 1]] = (int(tok[i + 2]), int(tok[i + 3]))
                    i += 4
                elif kind == "i":
                    # port_{rcv,xmit}_data count 4-octet units (sysfs-class-infiniband).
                    ib[tok[i + 1]] = (4 * int(tok[i + 2]), 4 * int(tok[i + 3]))
                    i += 4
                else:
                    raise ValueError(kind)
        except (ValueError, IndexError):
            self.other.append("S " + rest)
            return None
        gpus = None
        if self.hello.gpu_source == "nvidia-smi":
            gpus = tuple(self._gpus[k] for k in sorted(self._gpus))
        return Counters(t_us, cpu, nics, ib, gpus)


@dataclass(frozen=True)
class Delta:
    """What happened between two turns: seconds, CPU busy %, and Gbit/s per NIC (rx, tx).

    A NIC present in only one of the two turns has no rate (it appeared or went away)."""

    dt_s: float
    cpu_util_pct: float | None
    nic_gbps: dict[str, tuple[float, float]]
    ib_gbps: dict[str, tuple[float, float]]
    resets: tuple[str, ...] = ()  # counters that went backwards in this interval


def _increase(prev: int, cur: int) -> tuple[int, bool]:
    # A counter that went backwards was reset (driver reload, interface re-created): the new
    # value is what it counted since then, as Prometheus' rate() reads a reset
    # (prometheus.io/docs/prometheus/latest/querying/functions/#rate).
    if cur < prev:
        return cur, True
    return cur - prev, False


def _rates(
    prev: dict[str, tuple[int, int]], cur: dict[str, tuple[int, int]], dt: float, resets: list[str]
) -> dict[str, tuple[float, float]]:
    out = {}
    for name, (rx, tx) in cur.items():
        if name not in prev:
            continue
        drx, r1 = _increase(prev[name][0], rx)
        dtx, r2 = _increase(prev[name][1], tx)
        if r1 or r2:
            resets.append(name)
        out[name] = (drx * 8 / dt / 1e9, dtx * 8 / dt / 1e9)
    return out


def delta(prev: Counters | None, cur: Counters) -> Delta | None:
    """Rates between two turns of one node; None for the first turn (nothing to compare with)
    or when the node's clock did not move forward (a clock step: no honest rate)."""
    if prev is None:
        return None
    dt = (cur.t_us - prev.t_us) / 1e6
    if dt <= 0:
        return None
    cpu = None
    if len(prev.cpu) == len(cur.cpu) >= 4:
        diffs = [c - p for p, c in zip(prev.cpu, cur.cpu)]
        total = sum(diffs)
        idle = diffs[3] + (diffs[4] if len(diffs) > 4 else 0)  # idle + iowait
        if total > 0 and all(d >= 0 for d in diffs):
            cpu = 100.0 * (total - idle) / total
    resets: list[str] = []
    nic = _rates(prev.nics, cur.nics, dt, resets)
    ib = _rates(prev.ib, cur.ib, dt, resets)
    return Delta(dt, cpu, nic, ib, tuple(resets))
