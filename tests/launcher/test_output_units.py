"""--output (launcher.core.output.LiveFilter): which nodes' lines a launch shows live, what a
failed node's held lines become, the status line's account of the rest, the default by size,
and the refusals (one line, exit 2, nothing started)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.core.output import OUTPUT_ALL_UP_TO, TAIL_LINES, LiveFilter, default_output


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
