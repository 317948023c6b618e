"""workloads.sweep's pure parts: reference values, the wrong-element count, nccl-tests' number format."""

from __future__ import annotations

import functools

import pytest
import torch

from workloads import sweep
from workloads.sweep import expected, table

_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.float64]
_CASES = [
    (op, dt) for op in ("sum", "prod", "max", "min", "avg") for dt in _DTYPES if op != "avg" or dt.is_floating_point
]  # avg runs on floating types only


@pytest.mark.parametrize("n", range(1, 8))
@pytest.mark.parametrize(("op", "dtype"), _CASES)
def test_reference_equals_reducing_every_rank_by_hand(n, op, dtype):
    g = torch.arange(1000, 1100)
    per_rank = [expected.red_values(r, g, op).to(torch.float64) for r in range(n)]
    fold = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum, "avg": torch.add}[op]
    want = functools.reduce(fold, per_rank)
    if op == "avg":
        want = want / n
    got = expected.reduced(g, op, n, dtype)
    assert torch.equal(got, want.to(torch.int64).to(dtype) if not dtype.is_floating_point else want.to(dtype))


def test_count_wrong_counts_exactly_the_spoiled_elements():
    buf = torch.empty(1000, dtype=torch.float32)
    expected.fill(buf, 5, lambda g: expected.move_values(3, g))
    assert expected.count_wrong(buf, 5, lambda g: expected.move_values(3, g), 0.0) == 0
    buf[[0, 17, 999]] += 1
    assert expected.count_wrong(buf, 5, lambda g: expected.move_values(3, g), 0.0) == 3
    # A different rank's data (shifted by one) is wrong nearly everywhere.
    assert expected.count_wrong(buf, 5, lambda g: expected.move_values(4, g), 0.0) >= 990


@pytest.mark.parametrize(
    ("value", "width", "text"),
    [
        (0.001, 6, "  0.00"),
        (12.3456, 6, " 12.35"),
        (123.456, 6, "123.46"),
        (1234.5, 6, "1234.5"),
        (12345.6, 6, " 12346"),
        (123456.0, 6, "123456"),
        (1234567.0, 6, " 1e+06"),
        (42668.2, 7, "42668.2"),
        (1480.2, 7, "1480.20"),
        (35.123, 7, "  35.12"),
        (1234567.0, 7, "1234567"),
        (123456789.0, 7, "1.2e+08"),
    ],
)
def test_numbers_print_like_nccl_tests_getFloatStr(value, width, text):
    # Expected strings are C printf of nccl-tests src/util.cu getFloatStr's chosen format.
    assert table.float_str(value, width) == text


def test_row_line_layout_matches_the_header_columns():
    row = sweep.SweepRow(
        "all_reduce",
        8589934592,
        2147483648,
        "float",
        "sum",
        -1,
        16,
        42668.0,
        201.32,
        377.47,
        0,
        42654.0,
        201.39,
        377.6,
        None,
    )
    line = sweep.format_row(row)
    assert line == (
        "  8589934592    2147483648     float     sum      -1"
        "  42668.0  201.32  377.47       0  42654.0  201.39  377.60    N/A"
    )
    names = sweep.HEADER.splitlines()[1]
    # Every column ends where its header name ends (both are right-aligned, same widths).
    for name in ("size", "count", "type", "redop", "root"):
        end = names.index(name) + len(name)
        assert line[end - 1] != " " and (end == len(line) or line[end] == " "), name
