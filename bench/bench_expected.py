"""The expected-bandwidth model against Google's published sweeps: plateau, curve and fit.

    .venv/bin/python -m bench.bench_expected [--corpus tests/fixtures/nccl-outputs]

For each published 2-node sweep that calibrates `gpufleet.expected` (the corpus files 07, 08, 09
and the A4 all_gather of cluster-toolkit examples/gke-a4-highgpu/README.md) it prints the
model's plateau B against the sweep's largest published busbw (target: within 5%), the largest
error of the model's curve over the sweep's trusted sizes, and the latency A that
`fit_calibration` finds on the sweep against the constant in `CALIBRATIONS` (target: within 5 us
or 5%, so a constant cannot drift from its data); `--sizes` adds model vs published at every size
the model judges. Published figures that calibrate nothing are printed for information, not
gated. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpufleet.catalog import lookup
from gpufleet.expected import CALIBRATIONS, expectation, fit_calibration
from launcher.nccl.report import parse_output

PLATEAU_TOLERANCE = 0.05
LATENCY_TOLERANCE = (5e-6, 0.05)  # absolute, relative: whichever is looser
ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "nccl-outputs"

# (corpus file, machine type): the sweeps CALIBRATIONS was fitted on.
CORPUS_SWEEPS = [
    ("07-ctk-gke-a3mega-tcpxo-allgather-2node.txt", "a3-megagpu-8g"),
    ("08-ctk-gke-a3high-tcpx-allgather-2node-NA.txt", "a3-highgpu-8g"),
    ("09-a3mega-slurm-allreduce-2node.txt", "a3-megagpu-8g"),
]

# 2 x a4-highgpu-8g all_gather, 16 ranks (github.com/GoogleCloudPlatform/cluster-toolkit
# examples/gke-a4-highgpu/README.md @f23ae3163): (size, busbw as published), 8 GiB in place.
A4_ALL_GATHER = [(16 << 20, 128.0), (128 << 20, 254.0), (1 << 30, 324.0), (8 << 30, 335.67)]

# Published figures no constant was fitted on: (what, machine type, collective, size, busbw, source).
INFORMATION = [
    (
        "A3 High all_reduce, TCPX VM",
        "a3-highgpu-8g",
        "all_reduce",
        2 << 30,
        65.72,
        "skypilot-org/skypilot examples/gcp_gpu_direct_tcpx/README.md",
    ),
    (
        "A4 all_reduce, gIB",
        "a4-highgpu-8g",
        "all_reduce",
        8 << 30,
        683.52,
        "dstackai/dstack mkdocs/docs/examples/clusters/gcp.md",
    ),
]


def _human(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def _check(
    label: str, machine: str, collective: str, points: list[tuple[int, float]], source: str
) -> tuple[list[str], bool]:
    """Table rows for one calibrating sweep, and whether it met every target."""
    m = lookup(machine)
    exp = expectation(m, collective, 16, 2)
    assert exp is not None
    size, published = max(points)
    off = exp.plateau / published - 1.0
    trusted = [(s, bw) for s, bw in points if exp.trusted(s)]
    worst = max(trusted, key=lambda p: abs(exp.busbw(p[0]) / p[1] - 1.0))
    cal = CALIBRATIONS[(m.net_stack, collective, exp.algorithm)]
    fitted = fit_calibration(points, exp.plateau, exp.factor, cal.trusted_fraction)
    slack = max(LATENCY_TOLERANCE[0], LATENCY_TOLERANCE[1] * cal.latency_s)
    ok_b = abs(off) <= PLATEAU_TOLERANCE
    ok_a = abs(fitted - cal.latency_s) <= slack
    row = (
        f"| {label} | {exp.algorithm.value} | {published:.2f} @ {_human(size)} | {exp.plateau:.1f} | "
        f"{off:+.1%} {'ok' if ok_b else 'MISSED'} | {exp.busbw(size):.1f} | "
        f"{exp.busbw(worst[0]) / worst[1] - 1.0:+.1%} @ {_human(worst[0])} | "
        f"{cal.latency_s * 1e6:.0f} / {fitted * 1e6:.0f} {'ok' if ok_a else 'MISSED'} | {source} |"
    )
    return [row], ok_b and ok_a


def _sizes(title: str, machine: str, collective: str, points: list[tuple[int, float]]) -> list[str]:
    """Model vs published at every size of the sweep the model judges by busbw."""
    exp = expectation(machine, collective, 16, 2)
    assert exp is not None
    head = (
        f"{title}: B {exp.plateau:.1f} GB/s, A {exp.latency_s * 1e6:.0f} us, trusted from "
        f"{exp.trusted_from / 2**20:.1f} MiB"
    )
    out = ["", head, "", "| size | published busbw (best block) | model | model / published |", "|---|---|---|---|"]
    for s, bw in points:
        if exp.trusted(s):
            out.append(f"| {_human(s)} | {bw:.2f} | {exp.busbw(s):.2f} | {exp.busbw(s) / bw:.3f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--sizes", action="store_true", help="also print model vs published at every trusted size")
    args = ap.parse_args(argv)
    expected = json.loads((args.corpus / "EXPECTED.json").read_text())["files"]
    print(
        "| sweep (2 nodes, 16 ranks) | algorithm | published busbw GB/s | model B | B vs published "
        "| model at that size | worst trusted size | A const / refit (us) | source |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    details: list[str] = []
    for name, machine in CORPUS_SWEEPS:
        coll = expected[name]["collective"]
        rows = parse_output((args.corpus / name).read_text(), collective=coll, nranks=16)
        points = [(r.size, r.best_busbw) for r in rows if r.size > 0]
        lines, good = _check(
            f"{machine} {coll} (corpus {name[:2]})",
            machine,
            coll,
            points,
            expected[name]["source"].split(" ")[0].removeprefix("https://github.com/"),
        )
        print("\n".join(lines))
        ok &= good
        if args.sizes:
            details += _sizes(f"corpus {name[:2]}: {machine} {coll}", machine, coll, points)
    lines, good = _check(
        "a4-highgpu-8g all_gather",
        "a4-highgpu-8g",
        "all_gather",
        A4_ALL_GATHER,
        "cluster-toolkit examples/gke-a4-highgpu/README.md",
    )
    print("\n".join(lines))
    ok &= good
    for line in details:
        print(line)
    print()
    print("Not calibrated on (information only):")
    for what, machine, coll, size, bw, source in INFORMATION:
        exp = expectation(machine, coll, 16, 2)
        assert exp is not None
        print(
            f"- {what}: published {bw:.2f} GB/s @ {_human(size)}; model {exp.busbw(size):.1f} "
            f"({exp.busbw(size) / bw - 1.0:+.1%}, {exp.algorithm.value}, B {exp.plateau:.1f}) — {source}"
        )
    print(
        f"\n{'all targets met' if ok else 'a target was MISSED'} (B within {PLATEAU_TOLERANCE:.0%} "
        f"of the largest published busbw; A within {LATENCY_TOLERANCE[0] * 1e6:.0f} us or "
        f"{LATENCY_TOLERANCE[1]:.0%} of its refit)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
