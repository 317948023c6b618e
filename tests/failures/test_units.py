"""Pure pieces of the failure handling: naming the root cause, reading torchrun's worker-failure
line, the per-attempt store setting, one-line click errors."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from launcher.cli import main
from launcher.core.env import TORCHRUN_DEFAULTS, node_env
from launcher.core.output import (
    StreamSorter,
    failure_line,
    is_agent_line,
    root_cause,
    traceback_key,
    worker_failure,
    worker_failure_note,
)
from launcher.core.types import Cluster, LaunchConfig, LaunchResult, Node, NodeOutcome, Workload
from tests.support import REPO

NODES = [Node(rank=i, host=f"10.0.0.{i + 2}", address=f"10.0.0.{i + 2}") for i in range(3)]


def _o(rank: int, code: int, **kw) -> NodeOutcome:
    return NodeOutcome(NODES[rank], exit_code=code, **kw)


def test_the_first_to_exit_is_named_when_nothing_else_tells_them_apart():
    outcomes = {2: _o(2, 1), 0: _o(0, 1, stopped=True), 1: _o(1, 1, stopped=True)}
    assert root_cause(outcomes, [2, 0, 1]) == 2


def test_a_node_whose_program_said_what_went_wrong_wins_over_a_peer_that_merely_aborted():
    # Rank 0 printed "error: ... No space left on device" and was still being waited for when
    # its peer's collective aborted and that peer's torchrun reported first.
    outcomes = {1: _o(1, 1), 0: _o(0, 1, stopped=True, reported_error_before_stop=True)}
    assert root_cause(outcomes, [1, 0]) == 0


def test_an_error_printed_after_the_stop_is_a_consequence_and_not_named():
    outcomes = {1: _o(1, 1), 0: _o(0, 1, stopped=True, reported_error_before_stop=False)}
    assert root_cause(outcomes, [1, 0]) == 1


def test_an_unreachable_node_is_named_before_nodes_whose_code_failed_after_it_vanished():
    outcomes = {0: _o(0, 1), 2: _o(2, 255, connection_lost=True)}
    assert root_cause(outcomes, [0, 2]) == 2


def test_nothing_failed_names_nobody():
    assert root_cause({0: _o(0, 0), 1: _o(1, 0)}, [0, 1]) is None


def test_torchruns_worker_failure_line_is_read_in_words():
    line = (
        "E1121 21:46:33.309000 11986 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
        "multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 12486) of binary: /x/python"
    )
    assert worker_failure_note(line) == "worker local_rank 0 (pid 12486) killed by SIGKILL"
    assert (
        worker_failure_note("... failed (exitcode: 1) local_rank: 3 (pid: 7) of binary: p")
        == "worker local_rank 3 (pid 7) exit 1"
    )
    assert worker_failure_note("[node 0] step 10/100 | loss 4.1") is None


def test_every_torchrun_node_gets_a_fresh_worker_store_per_attempt_unless_overridden():
    c = Cluster("c", tuple(NODES))
    cfg = LaunchConfig(Workload("torchrun", ("x.py",)), job_id="j")
    assert (
        node_env(c, cfg)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
        == "1"
        == TORCHRUN_DEFAULTS["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
    )
    cfg = LaunchConfig(Workload("torchrun", ("x.py",)), job_id="j", env=(("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0"),))
    assert node_env(c, cfg)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_a_bad_flag_is_one_red_line_naming_it_not_a_usage_block():
    r = CliRunner().invoke(main, ["train", "--nodes", "two", "--local"], prog_name="launch")
    assert r.exit_code == 2
    assert r.output.strip() == (
        "error: Invalid value for '--nodes': 'two' is not a valid integer. (`launch train -h` lists the options)"
    )
    r = CliRunner().invoke(main, ["trian"])
    assert r.exit_code == 2 and r.output.strip().startswith("error: No such command 'trian'")
    assert CliRunner().invoke(main, ["--help"]).exit_code == 0
    bare = CliRunner().invoke(main, [], prog_name="launch")
    assert bare.output.startswith("Usage: launch [OPTIONS] COMMAND") and "error:" not in bare.output


# ---- what the live stream shows of a node's output ---------------------------------------------

TORCHRUN_LOGS = REPO / "tests" / "fixtures" / "torchrun"


def _sorted(path: Path) -> list[tuple[str, str]]:
    sorter = StreamSorter()
    out = []
    for line in path.read_text().splitlines():
        out += sorter.feed(line)
    return [*out, *sorter.flush()]


def test_of_a_raising_rank_the_live_stream_gets_its_traceback_whole_and_nothing_of_torchruns():
    pieces = _sorted(TORCHRUN_LOGS / "user-traceback.log")
    shown = [p for p in pieces if p.kind != "log"]
    assert [p.kind for p in shown] == ["traceback"]
    lines = shown[0].text.split("\n")
    assert lines[0] == "[rank0]: Traceback (most recent call last):"
    assert lines[-1] == "[rank0]: ValueError: bad value 3"
    hidden = [p.text for p in pieces if p.kind == "log"]
    # torchrun's failure line, its ChildFailedError traceback and the whole report, down to its last rule.
    assert any("failed (exitcode: 1) local_rank: 0" in x for x in hidden)
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: " in hidden
    assert hidden[-1] == "=" * 60 and "Root Cause (first observed failure):" in hidden
    # Nothing is lost: every line of the file is in exactly one piece.
    assert sum(len(p.text.split("\n")) for p in pieces) == len(
        (TORCHRUN_LOGS / "user-traceback.log").read_text().splitlines()
    )


def test_of_a_stopped_peer_the_live_stream_gets_only_the_workers_error_line():
    pieces = _sorted(TORCHRUN_LOGS / "peer-stopped.log")
    assert [p for p in pieces if p.kind != "log"] == [
        (
            "live",
            "error: --global-batch 8 is not divisible by --micro-batch 4 x world size 3 = 12; use a multiple of 12",
        )
    ]


def test_agent_lines_are_torchruns_own_and_a_workers_lines_are_not():
    log = (TORCHRUN_LOGS / "peer-stopped.log").read_text().splitlines()
    agent = [x for x in log if is_agent_line(x)]
    assert [x.split("] ", 1)[1][:31] for x in agent] == [
        "The node '127.0.0.1_14954_0' ha",
        "Sending process 15140 closing s",
        "The node '127.0.0.1_14954_0' ha",
    ]
    assert not is_agent_line("[node 0] step 10/100 | loss 4.1")
    assert not is_agent_line(log[0])  # the workload's error line


def test_a_user_line_after_a_traceback_is_live_and_ranks_interleaved_on_one_node_stay_apart():
    s = StreamSorter()
    fed = []
    for line in [
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: Traceback (most recent call last):",
        '[rank0]:   File "/w/a.py", line 3, in <module>',
        '[rank1]:   File "/w/a.py", line 3, in <module>',
        "[rank0]: KeyError: 'x'",
        "step 3",
        "[rank1]: KeyError: 'y'",
    ]:
        fed += s.feed(line)
    assert [p.kind for p in fed] == ["traceback", "live", "traceback"]
    a, b = fed[0].text, fed[2].text
    assert a.endswith("[rank0]: KeyError: 'x'") and b.endswith("[rank1]: KeyError: 'y'")
    # The same frames and exception type on two ranks are one traceback, whatever the message.
    assert traceback_key(a) == traceback_key(b)
    assert traceback_key(a) != traceback_key(a.replace("line 3", "line 4"))


def test_a_traceback_cut_off_by_the_end_of_the_stream_still_comes_out():
    s = StreamSorter()
    assert s.feed("Traceback (most recent call last):") == []
    assert s.feed('  File "/w/a.py", line 3, in <module>') == []
    assert [p.kind for p in s.flush()] == ["live", "live"]


def test_a_killed_worker_exits_128_plus_the_signal_and_the_one_line_says_so_with_the_log():
    line = (
        "E1121 21:46:33.309000 11986 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
        "multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 12486) of binary: /x/python"
    )
    w = worker_failure(line)
    assert w is not None and w.status == 137
    cause = NodeOutcome(NODES[2], exit_code=1, worker=w)
    peer = NodeOutcome(NODES[0], exit_code=143, stopped=True)
    r = LaunchResult("j", Path("runs/j"), {2: cause, 0: peer}, first_failure=2)
    assert r.exit_code == 137
    assert failure_line(r) == (
        "node 2 (10.0.0.4) failed first: worker local_rank 0 (pid 12486) killed by SIGKILL (exit 137); "
        "its log: runs/j/node-2.log"
    )


def test_the_exit_status_is_the_causes_worker_status_not_the_stop_that_ended_its_node():
    w = worker_failure("... failed (exitcode: 2) local_rank: 0 (pid: 8419) of binary: p")
    cause = NodeOutcome(NODES[1], exit_code=143, stopped=True, reported_error_before_stop=True, worker=w)
    r = LaunchResult("j", Path("r"), {2: _o(2, 1), 1: cause}, first_failure=1)
    assert r.exit_code == 2
    # Its worker's failure line never came (the stop got there first): the first worker failure
    # seen before the stop stands in, not the 143.
    cause.worker = None
    r.first_worker_status = 2
    assert r.exit_code == 2
    r.first_worker_status = None
    assert r.exit_code == 143
