"""What bus bandwidth a healthy cluster gives, per collective, machine type and node count.

Pure: no torch, no I/O. `launcher/nccl/report.py` judges a sweep with it; `bench/bench_expected.py`
checks it against Google's published sweeps.

**The model.** For sizes S in its trusted range, the α-β (Hockney) form (Thakur, Rabenseifner &
Gropp, IJHPCA 19(1), 2005),

    busbw(S) = B / (1 + A·B / (f·S))

with f the nccl-tests bus factor (`gpufleet.bandwidth.bus_factor`), B the plateau and A an
effective per-op latency. B depends on the algorithm NCCL runs under our NCCL profile
(`gpufleet.nccl_env.PROFILES`) and on the node count N, with n ranks, p = n/N per node:

- **ring** (all_gather, reduce_scatter, broadcast, reduce; all_reduce where NCCL_ALGO pins Ring,
  as the TCPX profile does): every byte crosses every node boundary once, so busbw is the
  per-node network rate: ``B = η · R · p/g``, R the catalog's per-node GPU network rate for its
  g GPUs (`gpu_network_gbps`), η the stack's efficiency (`EFFICIENCY`, fitted on Google's
  2-node all_gather), p/g the share of the NICs p processes reach. Capped by NVLink's ring rate
  (`_NVLINK` below). alltoall and sendrecv reach one NIC: ``B = η · R / nics``.
- **NVLS tree** (all_reduce with NCCL_ALGO unset, as Google's TCPXO and gIB profiles leave it,
  on 8-GPU Hopper/Blackwell nodes): NVLink SHARP reduces inside the node first and only the
  node's share crosses the network, an all_reduce among N nodes. The network then carries
  2(N−1)/N·S per node where nccl-tests' busbw counts 2(n−1)/n·S, so
  ``B = η · R · f(n)/f(N)``, f(x) = 2(x−1)/x: 1.875 × R·η for 2 nodes of 8 GPUs, 1.06× at 16
  nodes ("On two nodes, NCCL uses the tree (or nvlstree) algorithm which can indeed go beyond
  the network bottleneck", sjeaugey, NVIDIA/nccl-tests#196; "up to 2x the network bandwidth
  with trees", NVIDIA/nccl#209). Capped by the NVLS rate inside the node,
  ``B_nvls · f(n)/f(p)``.

A and the trusted range come from `CALIBRATIONS`: one published 2-node sweep per network stack
and algorithm, A fitted on its trusted points (the fit is `fit_calibration`; bench/
bench_expected.py reruns it on the sweeps and fails when a constant drifts from what it gives).
Other node counts are extrapolated: A grows with the algorithm's steps as NCCL's own tuning
model has it (github.com/NVIDIA/nccl `src/graph/tuning.cc` ncclTopoTuneModel: ring latency linear in its n−1 steps,
2(n−1) for all_reduce; NVLS tree in 1 + 2·log2 N), and the report says the figure is
extrapolated.

**Trusted range.** The model is trusted at sizes where it predicts at least φ of its plateau
(`Calibration.trusted_fraction`): there bandwidth dominates; below, NCCL switches protocols
(LL → LL128 → Simple) and algorithms and no two-parameter curve follows it (the 2-node A3 Mega
all_reduce sits at 27–33 GB/s from 8 to 16 MiB, then doubles at 32 MiB). Below the trusted
range, sizes up to `LATENCY_UNTIL` are judged by their time against a latency bound (twice the
slowest time the published sweep shows there: it catches a fallback path that adds
milliseconds, not a drift of 20%), and the sizes between are not judged. Stacks without a
published small-size time are not judged below the trusted range at all.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from gpufleet.bandwidth import bus_factor
from gpufleet.catalog import MachineType, NetStack, lookup
from gpufleet.contracts import SweepRow
from gpufleet.nccl_env import PROFILES

__all__ = [
    "CALIBRATIONS",
    "DEFAULT_LATENCY_S",
    "EFFICIENCY",
    "LATENCY_BOUND_FACTOR",
    "LATENCY_UNTIL",
    "MARGIN",
    "Algorithm",
    "Calibration",
    "Expectation",
    "Finding",
    "Judgement",
    "algorithm_for",
    "expectation",
    "fit_calibration",
    "judge",
    "plateau_busbw",
    "uses_single_nic",
    "model_busbw",
    "fit_latency",
    "SMALL_MAX_BYTES",
]


# ---- the α-β cost model ---------------------------------------------------------------------------


def model_busbw(size: float, plateau: float, latency_s: float, factor: float) -> float:
    """busbw(S) = B / (1 + A·B / (f·S)), B in GB/s, A in seconds, S in bytes (α-β / Hockney form)."""
    if size <= 0:
        return 0.0
    b = plateau * 1e9  # B/s
    return plateau / (1.0 + latency_s * b / (factor * size))


# Where fit_latency looks for latency-bound points: Google's published GCP sweeps are below 10% of
# their plateau at 1 MiB (A3 Mega all_gather 7.3 of 189 GB/s: github.com/GoogleCloudPlatform/
# cluster-toolkit examples/gke-a3-megagpu/README.md), so sizes up to 1 MiB are dominated by A, and
# A is what they measure.
SMALL_MAX_BYTES = 1 << 20


def fit_latency(
    points: list[tuple[int, float]], plateau: float, factor: float, max_size: int = SMALL_MAX_BYTES
) -> float | None:
    """Fit A (seconds) of the cost model on the small sizes (<= max_size) of a sweep.

    `points` are (size bytes, measured busbw GB/s). The model's time is t(S) = A + f·S/B and the
    measured bus time is f·S/busbw, so each point gives A_i = f·S·(1/busbw − 1/B). We take the
    median of the A_i: it ignores one hiccup, where a least-squares mean would not. Never
    negative. None when the sweep has no point at or below max_size. (The expected-bandwidth
    check no longer fits on the run it judges: see gpufleet.expected.)
    """
    if plateau <= 0 or factor <= 0:
        raise ValueError(f"plateau ({plateau}) and factor ({factor}) must be > 0")
    pts = sorted((s, bw) for s, bw in points if 0 < s <= max_size and bw > 0)
    if not pts:
        return None
    b = plateau * 1e9
    est = sorted(factor * s * (1.0 / (bw * 1e9) - 1.0 / b) for s, bw in pts)
    mid = len(est) // 2
    a = est[mid] if len(est) % 2 else (est[mid - 1] + est[mid]) / 2.0
    return max(0.0, a) if math.isfinite(a) else 0.0


class Algorithm(str, enum.Enum):
    """How NCCL moves the data of a multi-node collective, as far as the plateau cares."""

    RING = "ring"
    NVLS_TREE = "nvls-tree"


# A row more than this fraction below the model is reported (nccl-tests' own NCCL_TESTS_MIN_BW
# check fails below 0.9 × its target, github.com/NVIDIA/nccl-tests README.md).
MARGIN = 0.10

# η = measured 2-node ring busbw plateau / per-node GPU network rate, per stack: the GCP sample of
# each stack (Google's examples in github.com/GoogleCloudPlatform/cluster-toolkit), not another cloud's
# best case, so "below expected" means below what Google's own examples showed.
EFFICIENCY: dict[NetStack, float] = {
    # A3 Mega TCPXO, 2 nodes, all_gather: 188.73 / 200 GB/s at 8 GiB (cluster-toolkit
    # examples/gke-a3-megagpu/README.md).
    NetStack.TCPXO: 0.94,
    # A4 RoCE (gIB), 2 nodes, all_gather: 328.85–335.67 / 400 = 0.82–0.84 at 8 GiB (cluster-toolkit
    # examples/gke-a4-highgpu/README.md); the middle.
    NetStack.RDMA: 0.83,
    # A3 High TCPX, 2 nodes, all_gather: 70.90–71.35 / 100 at 512 MiB, flat from 256 MiB (cluster-toolkit
    # examples/gke-a3-highgpu/multi-node-test-plan.md).
    NetStack.TCPX: 0.71,
    # A2 Fast Socket: no published GCP number found; NCCL over kernel TCP like TCPX's
    # data path, so TCPX's figure is borrowed rather than a number invented.
    NetStack.FAST_SOCKET: 0.71,
    # Plain NCCL sockets: A3 Mega all_reduce over eth0 (200 Gbps = 25 GB/s) reached 3.5–3.74 GB/s
    # (github.com/MG-Cafe/TCPXO-Enabled-A3-Mega-H100-Benchmarks docs/benchmark-report.md): 3.74 / 25
    # = 0.15.
    NetStack.NONE: 0.15,
}

# What one 8-GPU node's NVLink carries, busbw GB/s: (ring, NVLS all_reduce), by accelerator type.
# A100 "should reach 230" (sjeaugey, NVIDIA/nccl-tests#149); H100/H200 ring ~370 and NVLS ~480
# (sjeaugey NVIDIA/nccl-tests#212; H200 table 367.6 / 482.3 in github.com/stas00/ml-engineering
# network/README.md); B200 ring ~680 (NVIDIA/nccl#2140), NVLS 845.7 (stas00, same file).
# NVLS needs NVLink SHARP: Hopper and later.
_NVLINK: dict[str, tuple[float, float | None]] = {
    "nvidia-tesla-a100": (230.0, None),
    "nvidia-a100-80gb": (230.0, None),
    "nvidia-h100-80gb": (370.0, 480.0),
    "nvidia-h100-mega-80gb": (370.0, 480.0),
    "nvidia-h200-141gb": (370.0, 480.0),
    "nvidia-b200": (680.0, 845.0),
}

# NVLS "gains only with >4 GPUs per NVLink domain" (stas00/ml-engineering network/README.md
# H200 table: 4 GPUs Ring 363, 8 NVLS 473).
_NVLS_MIN_GPUS = 5

# alltoall cannot aggregate NICs ("the performance you should see is the performance of a single
# NIC", sjeaugey, NVIDIA/nccl-tests#267). sendrecv's ring r→r+1 crosses each
# node boundary with one pair of GPUs, i.e. one NIC, so it is bounded the same way.
_SINGLE_NIC = frozenset({"alltoall", "sendrecv"})

# Sizes up to this are latency-bound on every published GCP sweep (the bandwidth term is < 10% of
# the time: A3 Mega all_gather 1 MiB moves in 5 us of its 129 us), so their time is what a
# latency bound judges.
LATENCY_UNTIL = 1 << 20

# The latency bound is this × the slowest time the published sweep shows up to LATENCY_UNTIL.
LATENCY_BOUND_FACTOR = 2.0


def uses_single_nic(collective: str) -> bool:
    """True when the collective's multi-node busbw is bounded by one NIC, not the node aggregate."""
    bus_factor(collective, 2)  # names an unknown collective
    return collective in _SINGLE_NIC


@dataclass(frozen=True)
class Calibration:
    """One published 2-node sweep of 16 ranks, reduced to the model's parameters."""

    latency_s: float  # A, fitted on the trusted points (fit_calibration)
    trusted_fraction: float  # φ: the model is trusted where it predicts >= φ × B
    small_time_s: float | None  # slowest published time up to LATENCY_UNTIL; None: none published
    source: str  # where the sweep was published
    nnodes: int = 2
    nranks: int = 16


# Keyed by (stack, collective, algorithm). Each A is `fit_calibration` over the published points
# at or above φ × B, rounded to 5 us; bench/bench_expected.py refits and compares.
CALIBRATIONS: dict[tuple[NetStack, str, Algorithm], Calibration] = {
    # 2 x a3-megagpu-8g all_gather: the model is -5.9%..+3.0% of every point from 8 MiB to 8 GiB.
    # φ 0.25: below 8 MiB the time jumps at protocol switches (98 → 130 us at 256 KiB).
    # Small sizes: 129.67 us at 256 KiB.
    (NetStack.TCPXO, "all_gather", Algorithm.RING): Calibration(
        125e-6, 0.25, 129.67e-6, "2 x a3-megagpu-8g all_gather, cluster-toolkit examples/gke-a3-megagpu/README.md"
    ),
    # 2 x a3-megagpu-8g all_reduce (NVLS tree; NCCL_ALGO unset): -4.6%..+2.3% from 64 MiB. φ 0.25:
    # 8-16 MiB sit at 27-33 GB/s (another algorithm) before the tree takes over at 32 MiB.
    # Small sizes: 203.2 us at 1 MiB.
    (NetStack.TCPXO, "all_reduce", Algorithm.NVLS_TREE): Calibration(
        965e-6,
        0.25,
        203.2e-6,
        "2 x a3-megagpu-8g all_reduce, lessizzmore/create-a3mega-ztan-fork ztan-NCCL-test-result",
    ),
    # 2 x a3-highgpu-8g all_gather: -10.0%..+5.0% from 64 to 512 MiB. TCPX holds ~1 ms per op up
    # to 16 MiB, so the α-β form overshoots until 2/3 of the plateau: φ 0.6. Small sizes:
    # 996.7 us at 1 MiB (the smallest size published).
    (NetStack.TCPX, "all_gather", Algorithm.RING): Calibration(
        385e-6,
        0.6,
        996.7e-6,
        "2 x a3-highgpu-8g all_gather, cluster-toolkit examples/gke-a3-highgpu/multi-node-test-plan.md",
    ),
    # 2 x a4-highgpu-8g all_gather: 128 @16 MiB, 254 @128 MiB, 324 @1 GiB, 335.67 @8 GiB
    # (cluster-toolkit examples/gke-a4-highgpu/README.md): -10.6%..+5.6%; no small sizes published.
    (NetStack.RDMA, "all_gather", Algorithm.RING): Calibration(
        90e-6, 0.25, None, "2 x a4-highgpu-8g all_gather, cluster-toolkit examples/gke-a4-highgpu/README.md"
    ),
}

# A of each stack's ring all_gather calibration (the stacks without a published sweep borrow
# TCPX's, the other TCP stack): what `gpufleet.bandwidth.DEFAULT_LATENCY_S` used to hold.
DEFAULT_LATENCY_S: dict[NetStack, float] = {
    s: CALIBRATIONS[
        (s if s in (NetStack.TCPXO, NetStack.TCPX, NetStack.RDMA) else NetStack.TCPX, "all_gather", Algorithm.RING)
    ].latency_s
    for s in NetStack
}


def _allowed(nccl_algo: str | None, collective: str) -> set[str] | None:
    """The algorithms NCCL_ALGO allows for `collective`, lower case; None: NCCL's own choice.

    NCCL_ALGO is a comma list, `^` to exclude (NCCL env docs); since NCCL 2.24 also per
    function, ``"ring,tree;allreduce:nvlstree,ring"`` (read second-hand, in vendor scripts).
    """
    if not nccl_algo or not nccl_algo.strip():
        return None
    func = collective.replace("_", "").lower()
    chosen: str | None = None
    for part in nccl_algo.split(";"):
        name, sep, algos = part.partition(":")
        if not sep:
            chosen = chosen if chosen is not None else part
        elif name.strip().lower() == func:
            chosen = algos
            break
    if chosen is None or not chosen.strip():
        return None
    chosen = chosen.strip().lower()
    every = {"ring", "tree", "nvls", "nvlstree", "collnetdirect", "collnetchain", "pat"}
    names = {a.strip() for a in chosen.lstrip("^").split(",") if a.strip()}
    return every - names if chosen.startswith("^") else names


def algorithm_for(
    machine: MachineType, collective: str, procs_per_node: float, env: Mapping[str, str] | None = None
) -> Algorithm:
    """The algorithm whose plateau NCCL reaches for `collective` under the machine's profile.

    NVLS tree only for all_reduce, on a GPU with NVLink SHARP and more than 4 processes a node,
    when NCCL_ALGO (the user's `env` over the profile) leaves NVLSTree allowed and
    NCCL_NVLS_ENABLE is not 0. Plain Tree is not counted: "if you have 8 NICs, Tree will struggle
    to get better performance than ring" (sjeaugey, nccl-tests#196), and on the one-NIC A2 there
    is no published sweep to calibrate the Tree effect on, so ring is the floor there: the check
    can miss a slow tree run but does not cry wolf.
    """
    merged = {**PROFILES[machine.net_stack], **(env or {})}
    if collective != "all_reduce" or _NVLINK.get(machine.gpu.accelerator_type, (0, None))[1] is None:
        return Algorithm.RING
    if procs_per_node < _NVLS_MIN_GPUS or merged.get("NCCL_NVLS_ENABLE", "").strip() == "0":
        return Algorithm.RING
    allowed = _allowed(merged.get("NCCL_ALGO"), collective)
    return Algorithm.NVLS_TREE if allowed is None or "nvlstree" in allowed else Algorithm.RING


def _steps(algorithm: Algorithm, collective: str, nranks: int, nnodes: int) -> float:
    """Latency steps, as NCCL's tuning model counts them (NVIDIA/nccl src/graph/tuning.cc)."""
    if algorithm is Algorithm.NVLS_TREE:
        return 1.0 + 2.0 * math.log2(nnodes)
    return (2.0 if collective == "all_reduce" else 1.0) * (nranks - 1)


def _calibration(stack: NetStack, collective: str, algorithm: Algorithm) -> tuple[Calibration, str, Algorithm, str]:
    """(calibration, its collective, its algorithm, how it applies) for a combination.

    Exact when published; else the nearest published sweep, and the note says which.
    """
    key = (stack, collective, algorithm)
    if key in CALIBRATIONS:
        return CALIBRATIONS[key], collective, algorithm, ""
    if algorithm is Algorithm.NVLS_TREE:
        return (
            CALIBRATIONS[(NetStack.TCPXO, "all_reduce", algorithm)],
            "all_reduce",
            algorithm,
            "A and φ borrowed from A3 Mega's all_reduce (no published sweep for this stack)",
        )
    own = stack if (stack, "all_gather", Algorithm.RING) in CALIBRATIONS else NetStack.TCPX
    cal = CALIBRATIONS[(own, "all_gather", Algorithm.RING)]
    if own is not stack:
        return (
            cal,
            "all_gather",
            Algorithm.RING,
            "A and φ borrowed from A3 High's all_gather (no published sweep for this stack)",
        )
    return cal, "all_gather", Algorithm.RING, f"A and φ from all_gather's ring ({collective} not published)"


@dataclass(frozen=True)
class Expectation:
    """The model for one collective on one cluster shape."""

    machine_type: str
    collective: str
    nranks: int
    nnodes: int
    algorithm: Algorithm
    plateau: float  # B, busbw GB/s
    latency_s: float  # A, seconds
    factor: float  # f, the bus factor
    trusted_from: float  # bytes: sizes at or above are judged by busbw
    latency_bound_s: float | None  # sizes up to LATENCY_UNTIL judged by time <= this; None: not
    basis: str  # how B and A were got, in words

    def busbw(self, size: float) -> float:
        """The model's busbw (GB/s) at `size` bytes."""
        return model_busbw(size, self.plateau, self.latency_s, self.factor)

    def trusted(self, size: float) -> bool:
        return size >= self.trusted_from


def _machine(machine: MachineType | str) -> MachineType:
    return lookup(machine) if isinstance(machine, str) else machine


def expectation(
    machine: MachineType | str,
    collective: str,
    nranks: int,
    nnodes: int,
    env: Mapping[str, str] | None = None,
) -> Expectation | None:
    """The model for `collective` on `nnodes` nodes of `machine` with `nranks` ranks in all.

    None within one node: NVLink, not the network, sets the plateau there and no GCP sweep
    calibrates it. `env` holds the user's NCCL variables over the profile (NCCL_ALGO,
    NCCL_NVLS_ENABLE change the algorithm). Raises UnknownMachineType for an unknown type and
    ValueError for an unknown collective or fewer ranks than nodes.
    """
    m = _machine(machine)
    f = bus_factor(collective, nranks)
    if nnodes < 2:
        return None
    if nranks < nnodes:
        raise ValueError(f"{nranks} ranks cannot span {nnodes} nodes")
    ppn = nranks / nnodes
    algo = algorithm_for(m, collective, ppn, env)
    eta = EFFICIENCY[m.net_stack]
    rate = m.gpu_network_bytes_per_s / 1e9
    ring_nvl, nvls = _NVLINK.get(m.gpu.accelerator_type, (math.inf, None))
    nics = max(1, len(m.gpu_nics))
    share = min(1.0, ppn / m.gpu_count)
    net = f"{rate:g} GB/s" + (f" x {share:.3g} (ranks per node / GPUs)" if share < 1 else "")
    if uses_single_nic(collective):
        plateau = eta * rate / nics
        how = f"B = {eta:g} x {rate:g} GB/s / {nics} NICs (one NIC's share)"
    elif algo is Algorithm.NVLS_TREE:
        gain = bus_factor("all_reduce", nranks) / bus_factor("all_reduce", nnodes)
        cap = nvls * bus_factor("all_reduce", nranks) / bus_factor("all_reduce", max(2, round(ppn)))
        plateau = min(eta * rate * share * gain, cap)
        how = f"B = {eta:g} x {net} x {gain:.4g} (NVLS tree: f({nranks} ranks) / f({nnodes} nodes))"
        if plateau == cap:
            how += f", capped at NVLS's {cap:.0f}"
    else:
        plateau = min(eta * rate * share, ring_nvl)
        how = f"B = {eta:g} x {net} (ring)"
        if plateau == ring_nvl:
            how += f", capped at NVLink's {ring_nvl:.0f}"
    cal, cal_coll, cal_algo, note = _calibration(m.net_stack, collective, algo)
    scale = _steps(algo, collective, nranks, nnodes) / _steps(cal_algo, cal_coll, cal.nranks, cal.nnodes)
    a = cal.latency_s * scale
    phi = cal.trusted_fraction
    trusted_from = a * plateau * 1e9 / f * phi / (1.0 - phi)  # model(S) = φ·B solved for S
    bound = None
    if cal.small_time_s is not None and not note:
        bound = LATENCY_BOUND_FACTOR * cal.small_time_s * scale
    where = f"calibrated on {cal.source}"
    if (nranks, nnodes) != (cal.nranks, cal.nnodes):
        where += f"; A scaled x{scale:.3g} to {nnodes} nodes, {nranks} ranks (extrapolated)"
    if note:
        where += f"; {note}"
    basis = f"{how}, A {a * 1e6:.0f} us, {where}"
    return Expectation(m.name, collective, nranks, nnodes, algo, plateau, a, f, trusted_from, bound, basis)


def plateau_busbw(machine: MachineType, collective: str, nnodes: int) -> float | None:
    """B in GB/s for `collective` on `nnodes` full nodes of `machine`; None within one node."""
    e = expectation(machine, collective, machine.gpu_count * max(1, nnodes), nnodes)
    return None if e is None else e.plateau


def fit_calibration(points: list[tuple[int, float]], plateau: float, factor: float, trusted_fraction: float) -> float:
    """A (seconds) for a published sweep: `points` (size bytes, busbw GB/s) at or above φ·B.

    Minimises the largest relative error of the model over those points, an overshoot (a false
    alarm on a healthy cluster in the making) counting twice an undershoot (a miss). Searched on
    a 1 us grid up to 5 ms.
    """
    pts = [(s, bw) for s, bw in points if s > 0 and bw >= trusted_fraction * plateau]
    if not pts:
        raise ValueError(f"no published point reaches {trusted_fraction:g} of the plateau {plateau:g}")

    def cost(a: float) -> float:
        worst = 0.0
        for s, bw in pts:
            r = model_busbw(s, plateau, a, factor) / bw - 1.0
            worst = max(worst, 2.0 * r if r > 0 else -r)
        return worst

    return min((k * 1e-6 for k in range(5001)), key=cost)


# ---- judging ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One size that fell short."""

    size: int
    kind: str  # "busbw": below the model; "latency": slower than the latency bound
    measured: float  # busbw GB/s, or time us
    expected: float  # model busbw GB/s, or the bound in us
    pct: float | None  # % below the model; None for times and for busbw printed as 0.00


@dataclass(frozen=True)
class Judgement:
    """One collective's rows against its Expectation."""

    expectation: Expectation
    findings: list[Finding]
    judged: list[int]  # sizes judged by busbw
    bounded: list[int]  # sizes judged by time against the latency bound
    skipped: list[int]  # sizes not judged


def _best_time(r: SweepRow) -> float | None:
    times = [t for t in (r.oop_time_us, r.ip_time_us) if t is not None and t > 0]
    return min(times) if times else None


def judge(rows: list[SweepRow], exp: Expectation, margin: float = MARGIN) -> Judgement:
    """Rows of one collective (one type and op) against the model; size-0 rows move nothing and
    are left out."""
    if not 0 < margin < 1:
        raise ValueError(f"margin must be in (0, 1), got {margin}")
    findings, judged, bounded, skipped = [], [], [], []
    for r in sorted(rows, key=lambda r: r.size):
        if r.size <= 0:
            continue
        if exp.trusted(r.size):
            judged.append(r.size)
            want, got = exp.busbw(r.size), r.best_busbw
            if got < (1.0 - margin) * want:
                # A value printed as 0.00 carries no digits to take a percentage of.
                pct = None if f"{got:.2f}" == "0.00" else 100.0 * (1.0 - got / want)
                findings.append(Finding(r.size, "busbw", got, want, pct))
        elif exp.latency_bound_s is not None and r.size <= LATENCY_UNTIL and _best_time(r) is not None:
            bounded.append(r.size)
            t, limit = _best_time(r), exp.latency_bound_s * 1e6
            if t > limit:
                findings.append(Finding(r.size, "latency", t, limit, None))
        else:
            skipped.append(r.size)
    return Judgement(exp, findings, judged, bounded, skipped)
