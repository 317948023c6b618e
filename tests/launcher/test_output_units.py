"""--output (launcher.core.output.LiveFilter): which nodes' lines a launch shows live, what a
failed node's held lines become, the status line's account of the rest, the default by size,
and the refusals (one line, exit 2, nothing started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.core.output import (
    OUTPUT_ALL_UP_TO,
    TABLE_EVERY_NODE_UP_TO,
    TAIL_LINES,
    LiveFilter,
    ResultRow,
    default_output,
    result_rows,
)
from launcher.core.types import LaunchResult, Node, NodeOutcome


def test_rank0_shows_node_0_live_and_a_failed_nodes_last_lines_once_when_it_fails():
    f = LiveFilter("rank0", 4)
    assert f.line(0, "step 1") == ["step 1"]
    assert f.line(1, "quiet") == [] and f.ended(1, "exited") == []
    for i in range(TAIL_LINES + 5):
        assert f.line(2, f"line {i}") == []
    tail = f.ended(2, "failed")
    assert tail[0] == f"(its last {TAIL_LINES} lines; 5 before them in its log)"
    assert tail[1:] == [f"line {i}" for i in range(5, TAIL_LINES + 5)]
    assert f.ended(2, "failed") == []  # once
    f.line(3, "stopped by the launch")
    assert f.ended(3, "stopped") == []  # the launch stopped it: not its own failure
    assert f.summary() == "--output rank0: node 0's output shown live; the other 3 nodes: 1 exited, 1 failed, 1 stopped"


def test_failures_shows_no_line_until_a_node_fails_or_is_lost_and_all_shows_every_line():
    f = LiveFilter("failures", 3)
    assert f.line(0, "a") == [] and f.line(1, "b") == [] and f.line(2, "c") == []
    assert f.ended(1, "unreachable") == ["b"]  # a lost node's last words
    assert f.summary() == "--output failures: a failed node's output shown live; all 3 nodes: 2 running, 1 unreachable"
    every = LiveFilter("all", 2)
    assert every.line(1, "x") == ["x"] and every.ended(1, "failed") == [] and every.summary() is None
    with pytest.raises(ValueError):
        LiveFilter("rank1", 2)


def test_the_status_line_counts_the_nodes_not_shown_as_they_end_once_each():
    f = LiveFilter("rank0", 1000)
    for rank in range(1, 601):
        f.ended(rank, "exited")
    f.ended(700, "failed")
    f.ended(700, "failed")  # told twice: one node still
    f.ended(0, "exited")  # shown live: not among the rest
    assert f.summary() == (
        "--output rank0: node 0's output shown live; the other 999 nodes: 600 exited, 398 running, 1 failed"
    )


def test_every_nodes_lines_up_to_16_nodes_and_node_0s_above():
    assert default_output(1) == default_output(OUTPUT_ALL_UP_TO) == "all"
    assert default_output(OUTPUT_ALL_UP_TO + 1) == default_output(200) == "rank0"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--output", "rank1"], "Invalid value for '--output': 'rank1' is not one of 'all', 'rank0', 'failures'"),
        (["--output", "rank0", "--detach"], "--output is for an attached launch"),
    ],
)
def test_a_bad_output_is_one_line_exit_2_and_starts_nothing(tmp_path, args, words):
    r = CliRunner().invoke(main, ["exec", "--local", "--nodes", "2", *args, "--", "touch", str(tmp_path / "ran")])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert words in line, line
    assert not (tmp_path / "ran").exists()


def _result(n: int, failed: dict[int, int]) -> LaunchResult:
    outcomes = {}
    for r in range(n):
        node = Node(r, f"10.0.{r // 250}.{r % 250 + 2}", f"10.0.{r // 250}.{r % 250 + 2}")
        stopped = bool(failed) and r not in failed  # the launch stopped the rest: SIGTERM's 143
        code = failed.get(r, 143 if stopped else 0)
        outcomes[r] = NodeOutcome(node, exit_code=code, duration_s=0.05 * r, stopped=stopped)
    return LaunchResult("20260101-000000-abcdef", Path("/runs/x"), outcomes)


def test_the_summary_table_has_a_row_per_node_up_to_16_and_groups_nodes_that_ended_alike_above():
    assert [row.node for row in result_rows(_result(TABLE_EVERY_NODE_UP_TO, {}))] == [
        str(r) for r in range(TABLE_EVERY_NODE_UP_TO)
    ]
    (row,) = result_rows(_result(200, {}))
    assert row == ResultRow("0-199", "200 nodes", "exit 0", "0.0-10.0 s", "ok")
    # A failure stands alone between the stopped ranges around it.
    rows = result_rows(_result(200, {57: 3}))
    assert [(r.node, r.host, r.kind) for r in rows] == [
        ("0-56", "57 nodes", "stopped"),
        ("57", "10.0.0.59", "failed"),
        ("58-199", "142 nodes", "stopped"),
    ]
    assert rows[1].status == "exit 3" and rows[1].duration == "2.9 s"
