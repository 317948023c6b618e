"""gpufleet.bandwidth against hand-computed nccl-tests numbers."""

from __future__ import annotations

import pytest

from gpufleet import bandwidth as bw
from gpufleet.catalog import NetStack, lookup
from gpufleet.contracts import SweepRow
from gpufleet.expected import DEFAULT_LATENCY_S, EFFICIENCY, fit_latency, model_busbw, plateau_busbw, uses_single_nic

# (collective, nranks) → busbw/algbw, computed by hand from nccl-tests' *GetBw (NVIDIA/nccl-tests src/<coll>.cu).
HAND_FACTORS = {
    ("all_reduce", 2): 1.0,
    ("all_reduce", 3): 4 / 3,
    ("all_reduce", 6): 10 / 6,
    ("all_reduce", 8): 1.75,
    ("all_reduce", 16): 1.875,
    ("all_reduce", 1): 0.0,
    ("all_gather", 2): 0.5,
    ("all_gather", 6): 5 / 6,
    ("all_gather", 16): 0.9375,
    ("reduce_scatter", 2): 0.5,
    ("reduce_scatter", 8): 0.875,
    ("reduce_scatter", 3): 2 / 3,
    ("alltoall", 4): 0.75,
    ("alltoall", 8): 0.875,
    ("alltoall", 1): 0.0,
    ("broadcast", 2): 1.0,
    ("broadcast", 16): 1.0,
    ("reduce", 3): 1.0,
    ("reduce", 64): 1.0,
    ("sendrecv", 2): 1.0,
    ("sendrecv", 8): 1.0,
}


@pytest.mark.parametrize(("coll", "n"), sorted(HAND_FACTORS))
def test_bus_factor_matches_nccl_tests(coll, n):
    assert bw.bus_factor(coll, n) == pytest.approx(HAND_FACTORS[(coll, n)])


def test_every_collective_has_a_factor_and_bandwidths():
    # 1 GB in 10 ms = 100 GB/s algbw for every collective in terms of the printed size.
    for coll in bw.COLLECTIVES:
        assert bw.algbw(10**9, 0.01) == pytest.approx(100.0)
        assert bw.busbw(coll, 10**9, 0.01, 8) == pytest.approx(100.0 * bw.bus_factor(coll, 8))


def test_all_reduce_16_ranks_hand_example():
    # 1 GiB in 9 ms on 16 ranks: algbw = 1073741824/1e9/0.009 = 119.30 GB/s; ×1.875 = 223.69.
    assert bw.algbw(1 << 30, 0.009) == pytest.approx(119.3046, rel=1e-5)
    assert bw.busbw("all_reduce", 1 << 30, 0.009, 16) == pytest.approx(223.6962, rel=1e-5)


def test_unknown_collective_and_bad_inputs_are_named():
    with pytest.raises(ValueError, match="'allreduce' is unknown"):
        bw.bus_factor("allreduce", 2)
    with pytest.raises(ValueError, match="nranks"):
        bw.bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="> 0"):
        bw.algbw(8, 0.0)


@pytest.mark.parametrize(
    ("coll", "nbytes", "tsize", "n", "size", "count"),
    [
        # whole-buffer collectives: count = nbytes / type size, size = count × type size
        ("all_reduce", 1000, 4, 3, 1000, 250),
        ("all_reduce", 1001, 4, 3, 1000, 250),
        ("broadcast", 8, 8, 2, 8, 1),
        ("reduce", 1 << 30, 2, 16, 1 << 30, 1 << 29),
        ("sendrecv", 7, 1, 2, 7, 7),
        # per-rank collectives: base = (count // n) rounded down to 16 bytes
        ("all_gather", 1000, 4, 3, 960, 80),  # 250//3 = 83 → 80 (multiple of 4 floats)
        ("reduce_scatter", 1000, 4, 3, 960, 80),
        ("alltoall", 100, 1, 6, 96, 16),  # 100//6 = 16 int8 → 16
        ("alltoall", 64, 4, 6, 0, 0),  # 16//6 = 2 floats → 0: nccl-tests prints size 0
        ("all_gather", 8 << 20, 2, 16, 8 << 20, (8 << 20) // 2 // 16),
    ],
)
def test_coll_sizes_round_like_nccl_tests(coll, nbytes, tsize, n, size, count):
    s = bw.coll_sizes(coll, nbytes, tsize, n)
    assert (s.size, s.count) == (size, count)
    assert s.size == max(s.send_bytes, s.recv_bytes)


def test_coll_sizes_send_and_recv_sides():
    ag = bw.coll_sizes("all_gather", 1024, 4, 4)
    rs = bw.coll_sizes("reduce_scatter", 1024, 4, 4)
    assert (ag.send_bytes, ag.recv_bytes) == (256, 1024)
    assert (rs.send_bytes, rs.recv_bytes) == (1024, 256)


@pytest.mark.parametrize(
    ("text", "value"),
    [("8", 8), ("1K", 1024), ("1k", 1024), ("8M", 8 << 20), ("8G", 8 << 30), ("32m", 32 << 20), (" 64 ", 64)],
)
def test_parse_size_binary_suffixes(text, value):
    assert bw.parse_size(text) == value


@pytest.mark.parametrize("text", ["8T", "-1", "1.5M", "", "M", "8MB", "eight"])
def test_parse_size_rejects_with_the_value_named(text):
    with pytest.raises(bw.SizeError, match="is not understood"):
        bw.parse_size(text)


def test_format_size_round_trips():
    for n in (8, 1000, 1024, 3 << 20, 8 << 30):
        assert bw.parse_size(bw.format_size(n)) == n


def test_size_ladder_factor_and_step():
    assert bw.size_ladder(8, 8 << 30, 2) == [8 << i for i in range(31)]
    assert bw.size_ladder(8, 100, 4) == [8, 32]
    assert bw.size_ladder(1 << 20, 3 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20]
    assert bw.size_ladder(32 << 20, 32 << 20) == [32 << 20]


def test_size_ladder_errors_name_the_fix():
    with pytest.raises(bw.SizeError, match="swap -b and -e"):
        bw.size_ladder(1024, 8)
    with pytest.raises(bw.SizeError, match="-f 2"):
        bw.size_ladder(8, 64, 1, 0)
    with pytest.raises(bw.SizeError, match="never grows"):
        bw.size_ladder(0, 64, 2)


# ---- cost model ---------------------------------------------------------------------------


def test_model_is_half_the_plateau_at_s_half():
    b, a, f = 100.0, 50e-6, 1.5
    s_half = a * b * 1e9 / f  # busbw(S_half) = B/2: A·B/(f·S) = 1
    assert model_busbw(s_half, b, a, f) == pytest.approx(50.0)
    assert model_busbw(1 << 40, b, a, f) == pytest.approx(100.0, rel=1e-3)
    assert model_busbw(0, b, a, f) == 0.0


def test_fit_recovers_latency_from_small_sizes_only():
    b, a, f = 188.0, 115e-6, 15 / 16
    pts = [(s, model_busbw(s, b, a, f)) for s in (8 << i for i in range(31))]
    # Spoil the large sizes: the fit must not look at them.
    pts = [(s, v * (0.3 if s > (1 << 20) else 1.0)) for s, v in pts]
    assert fit_latency(pts, b, f) == pytest.approx(a, rel=1e-9)


def test_fit_is_robust_to_one_outlier_and_never_negative():
    b, a, f = 50.0, 20e-6, 1.0
    pts = [(s, model_busbw(s, b, a, f)) for s in (1024, 4096, 16384, 65536, 262144)]
    pts[2] = (pts[2][0], pts[2][1] / 10)  # one slow hiccup
    assert fit_latency(pts, b, f) == pytest.approx(a, rel=1e-9)
    # Faster than the plateau (impossible for the model): A clamps to 0.
    assert fit_latency([(1024, 1e6)], b, f) == 0.0
    assert fit_latency([(1 << 30, 10.0)], b, f) is None


def test_plateau_uses_catalog_rate_times_stack_efficiency():
    mega = lookup("a3-megagpu-8g")  # 1600 Gbps GPU network = 200 GB/s, TCPXO η 0.94
    assert plateau_busbw(mega, "all_gather", 2) == pytest.approx(188.0)
    # all_reduce runs as an NVLS tree under TCPXO's profile: 2(16-1)/16 / (2(2-1)/2) = 1.875x.
    assert plateau_busbw(mega, "all_reduce", 2) == pytest.approx(188.0 * 1.875)
    assert plateau_busbw(mega, "alltoall", 2) == pytest.approx(188.0 / 8)  # one NIC of 8
    assert plateau_busbw(mega, "all_reduce", 1) is None
    a2 = lookup("a2-highgpu-8g")  # 100 Gbps, Fast Socket, one NIC
    assert plateau_busbw(a2, "sendrecv", 4) == pytest.approx(12.5 * 0.71)
    assert set(EFFICIENCY) == set(NetStack) == set(DEFAULT_LATENCY_S)


def test_avg_busbw_is_the_mean_of_every_printed_block_and_skips_missing_ones():
    def row(oop, ip):
        return SweepRow("all_reduce", 8, 2, "float", "sum", -1, 2, 1.0, oop, oop, 0, 1.0, ip, ip, 0)

    assert bw.avg_busbw([row(2.0, 4.0), row(6.0, None)]) == pytest.approx((2.0 + 4.0 + 6.0) / 3)
    assert bw.avg_busbw([row(None, None)]) == 0.0
    assert bw.avg_busbw([]) == 0.0


def test_the_single_nic_collectives_get_one_nics_share_of_the_plateau():
    machine = lookup("a3-megagpu-8g")
    assert [c for c in bw.COLLECTIVES if uses_single_nic(c)] == ["alltoall", "sendrecv"]
    nics = max(1, len(machine.gpu_nics))
    assert plateau_busbw(machine, "alltoall", 2) == pytest.approx(plateau_busbw(machine, "all_gather", 2) / nics)
