"""Pure pieces of the failure handling: naming the root cause, reading torchrun's worker-failure
line, the per-attempt store setting, one-line click errors."""

from __future__ import annotations

from click.testing import CliRunner

from launcher.cli.main import main
from launcher.core.env import TORCHRUN_DEFAULTS, node_env
from launcher.core.output import root_cause, worker_failure_note
from launcher.core.types import Cluster, LaunchConfig, Node, NodeOutcome, Workload

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
