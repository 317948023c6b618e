"""--recover's pure parts: the options, the failure a result calls for, the step a line
says the run is at, without a network."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main as cli
from launcher.core.types import LaunchResult, Node, NodeOutcome, UserError
from launcher.jobs.recovery import (
    RecoverPolicy,
    RecoverRequest,
    checkpoint_tiers,
    failure_of,
    judged_bad,
    parse_duration,
    recover_policy,
    resume_argv,
    step_of,
)

TRAIN_ARGV = ("-m", "workloads.train", "--steps", "10", "--checkpoint-dir", "/ckpt")


def test_durations_read_seconds_minutes_hours_and_days_and_a_bad_one_names_the_flag():
    assert parse_duration("90") == 90 and parse_duration("90s") == 90
    assert parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400 and parse_duration("7d") == 604800
    for bad in ("", "soon", "10w", "-5", "0"):
        with pytest.raises(UserError, match="--recover-timeout"):
            parse_duration(bad)


def test_recover_policy_defaults_and_settings():
    assert recover_policy(RecoverRequest(), TRAIN_ARGV, detach=True) is None
    assert recover_policy(RecoverRequest(recover=True), TRAIN_ARGV, detach=True) == RecoverPolicy(3, 1800.0)
    got = recover_policy(RecoverRequest(recover=True, max_recoveries=1, recover_timeout="20s"), TRAIN_ARGV, True)
    assert got == RecoverPolicy(1, 20.0)
    assert recover_policy(RecoverRequest(recover=True), ("-m", "workloads.train", "--checkpoint-dir=gs://b/r"), True)
    # --restart-stopped is on by default with --recover; the API endpoint (tests) travels with it.
    on = recover_policy(RecoverRequest(recover=True, api_endpoint="http://127.0.0.1:1"), TRAIN_ARGV, True)
    assert on.restart_stopped and on.api_endpoint == "http://127.0.0.1:1"
    off = recover_policy(RecoverRequest(recover=True, restart_stopped=False, api_endpoint="http://x"), TRAIN_ARGV, True)
    assert not off.restart_stopped and off.api_endpoint is None


@pytest.mark.parametrize(
    "o, argv, detach, words",
    [
        ({"recover": True}, ("-m", "workloads.train", "--steps", "10"), True, "--checkpoint-dir"),
        ({"recover": True}, ("-m", "workloads.train", "--local-checkpoint-every", "0"), True, "--checkpoint-dir"),
        ({"recover": True}, TRAIN_ARGV, False, "--detach"),
        ({"max_recoveries": 2}, TRAIN_ARGV, True, "--max-recoveries needs --recover"),
        ({"recover_timeout": "5m"}, TRAIN_ARGV, True, "--recover-timeout needs --recover"),
        ({"restart_stopped": False}, TRAIN_ARGV, True, "--no-restart-stopped needs --recover"),
        ({"recover": True, "max_recoveries": 0}, TRAIN_ARGV, True, "--max-recoveries 0"),
    ],
)
def test_recover_without_what_it_needs_is_one_line_naming_it(o, argv, detach, words):
    with pytest.raises(UserError) as e:
        recover_policy(RecoverRequest(**o), argv, detach)
    assert words in str(e.value) and "\n" not in str(e.value)


LOCAL_ONLY = ("-m", "workloads.train", "--steps", "10", "--local-checkpoint-every", "2")


def test_the_local_tier_alone_is_something_to_resume_from_and_the_relaunch_resumes_from_it():
    assert checkpoint_tiers(TRAIN_ARGV) == ["durable"] and checkpoint_tiers(LOCAL_ONLY) == ["local"]
    assert checkpoint_tiers(("--local-checkpoint-every=5", "--checkpoint-dir=gs://b/r")) == ["durable", "local"]
    assert checkpoint_tiers(("--local-checkpoint-every", "5", "--local-checkpoint-every", "0")) == []  # argparse's last
    policy = recover_policy(RecoverRequest(recover=True), LOCAL_ONLY, detach=True)
    assert policy is not None and policy.resume
    # The relaunch's arguments, as workloads.train reads them: --resume over the local tier alone.
    from workloads.config import config_from_args

    cfg = config_from_args(list(resume_argv(LOCAL_ONLY)[2:]), world_size=1)
    assert cfg.checkpoint.resume and cfg.checkpoint.local_checkpoint_every == 2 and not cfg.checkpoint.checkpoint_dir


def test_the_refusal_names_both_tiers_in_one_line():
    with pytest.raises(UserError) as e:
        recover_policy(RecoverRequest(recover=True), ("-m", "workloads.train", "--steps", "10"), detach=True)
    line = str(e.value)
    assert "--checkpoint-dir" in line and "--local-checkpoint-every" in line and "\n" not in line


def _train(tmp_path: Path, *args: str):
    # TEST-NET-1 addresses (RFC 5737): nothing answers there, so whatever ends the launch comes before any contact.
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"192.0.2.{i + 1}\n" for i in range(3)))
    base = ["train", "--hostfile", str(hosts), "--runs-dir", str(tmp_path / "runs"), "--detach", "--recover"]
    r = CliRunner().invoke(cli, [*base, *args])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and not (tmp_path / "runs").exists(), r.output
    return lines[0]


def test_launch_train_detach_recover_takes_the_local_tier_alone_and_refuses_no_tier(tmp_path):
    # Accepted: the launch goes on past --recover's check to the next one (--min-nodes above the nodes).
    line = _train(tmp_path, "--min-nodes", "9", "--", "--steps", "10", "--local-checkpoint-every", "2")
    assert "--min-nodes 9 is more than the job's 3 nodes" in line
    line = _train(tmp_path, "--", "--steps", "10")
    assert "--recover needs checkpoints" in line and "--local-checkpoint-every N" in line and "--checkpoint-dir" in line


def test_resume_is_added_once():
    assert resume_argv(TRAIN_ARGV) == (*TRAIN_ARGV, "--resume")
    assert resume_argv((*TRAIN_ARGV, "--resume")) == (*TRAIN_ARGV, "--resume")


def test_step_lines_and_resume_lines_give_the_step():
    assert step_of("step 12/100 | loss 3.2 | 20 ms") == 12
    assert step_of("resumed from /ckpt at step 4 (epoch 0, 16 samples seen)") == 4
    assert step_of("steps: 12/100") is None and step_of("hello") is None


def _result(code: int, outcome: NodeOutcome | None = None, signal: int | None = None) -> LaunchResult:
    r = LaunchResult("j", Path("/tmp/x"), {1: outcome} if outcome else {})
    r.first_failure = 1 if outcome else None
    r.signal = signal
    if outcome is None and code:
        r.outcomes[0] = NodeOutcome(Node(0, "a", "a"), exit_code=code)
    return r


def test_which_results_call_for_a_recovery():
    node = Node(1, "10.0.0.3", "10.0.0.3")
    assert failure_of(_result(0), preempted=False, step=9) is None  # done
    assert failure_of(_result(130, signal=2), preempted=False, step=9) is None  # a person stopped it
    pre = failure_of(_result(0), preempted=True, step=9)
    assert pre is not None and "preempted" in pre.cause and pre.node is None and pre.step == 9
    lost = failure_of(_result(255, NodeOutcome(node, connection_lost=True, error="Connection reset")), False, 3)
    assert lost.node == 1 and "unreachable (Connection reset)" in lost.cause and not lost.signature
    crash = failure_of(_result(1, NodeOutcome(node, exit_code=1, error_lines=["error: boom"])), False, 4)
    assert crash.node == 1 and "exit 1: error: boom" in crash.cause and crash.signature == "exit 1 / error: boom"


def test_a_lost_node_is_named_even_when_a_peer_it_took_down_was_heard_of_first():
    # Node 1 powered off: node 0's rank crashes on the lost peer and the launch may hear of that
    # crash before node 1's connection drops (seen in CI): the recovery names node 1.
    r = LaunchResult("j", Path("/tmp/x"), {})
    r.outcomes[0] = NodeOutcome(Node(0, "a", "a"), exit_code=1, error_lines=["RuntimeError: Connection closed by peer"])
    r.outcomes[1] = NodeOutcome(Node(1, "b", "b"), connection_lost=True, error="Connection reset")
    r.first_failure = 0
    rec = failure_of(r, False, 30)
    assert rec.node == 1 and rec.reason == "node-lost" and "unreachable (Connection reset)" in rec.cause


def test_each_recovery_is_one_line_saying_when_which_node_why_and_how_long():
    from launcher.jobs.recovery import Recovery, recovery_lines

    done = Recovery(
        1e9,
        1,
        "preempted: the workers got SIGTERM and saved a checkpoint",
        57,
        12.34,
        restarted={"gpu-1": "started (it was TERMINATED)"},
    )
    last = Recovery(1e9 + 60, None, "worker crash: exit 1: error: boom", 4, None, "exit 1 / error: boom")
    one, two = recovery_lines([done.to_json(), last.to_json()])
    assert one.startswith("recovery 1: 20") and "node 1 at step 57: preempted" in one
    assert "relaunched after 12.3 s" in one and "instance gpu-1 started (it was TERMINATED)" in one
    assert two.startswith("recovery 2: ") and "a node at step 4: worker crash" in two and "not relaunched" in two


def test_a_rank_that_reports_a_failed_gpu_names_its_node_even_when_a_peer_crashed_first():
    # Node 2's GPU hit an uncorrectable ECC error (torch's words); node 0's rank crashed first on
    # the collective it lost (NCCL's error): the recovery names node 2, judged bad at once.
    r = LaunchResult("j", Path("/tmp/x"), {})
    r.outcomes[0] = NodeOutcome(Node(0, "a", "a"), exit_code=1, error_lines=["RuntimeError: NCCL error: unhandled"])
    ecc = "[rank 4] RuntimeError: CUDA error: uncorrectable ECC error encountered"
    r.outcomes[2] = NodeOutcome(Node(2, "c", "c"), exit_code=1, tail=[ecc, "torch.distributed.elastic ... FAILED"])
    r.first_failure = 0
    rec = failure_of(r, False, 30)
    assert rec.node == 2 and rec.reason == "worker-failed", rec
    assert rec.cause == f"GPU error (uncorrectable ECC error): {ecc}"
    assert judged_bad(rec) == {2: "GPU error"}
    # NCCL's own line for a GPU that fell off the bus, from an error line kept apart from the tail.
    r.outcomes[2] = NodeOutcome(Node(2, "c", "c"), exit_code=1, error_lines=["NCCL WARN Cuda failure 'GPU is lost'"])
    assert judged_bad(failure_of(r, False, 30)) == {2: "GPU error"}
    # An illegal memory access is most often the program's own bug: a crash, no node judged bad.
    illegal = "RuntimeError: CUDA error: an illegal memory access was encountered"
    r.outcomes[2] = NodeOutcome(Node(2, "c", "c"), exit_code=1, error_lines=[illegal])
    rec = failure_of(r, False, 30)
    assert rec.node == 0 and rec.cause.startswith("worker crash") and judged_bad(rec) == {}


def test_a_killed_workers_cause_is_torchruns_account_not_the_replicators_last_line():
    from launcher.core.types import WorkerFailure

    node = Node(2, "c", "c")
    tail = ["step 2187/100000 | loss 1.9", "replica: copied step_00002100 of rank 2 to root@10.0.0.5 in 0.6 s"]
    killed = NodeOutcome(node, exit_code=1, tail=tail, worker=WorkerFailure(-9, 0, 4242))
    rec = failure_of(_result(1, killed), False, 2187)
    assert rec.cause == "worker crash: exit 1: worker local_rank 0 (pid 4242) killed by SIGKILL", rec.cause
    # No torchrun account either: the last line of the program's own, never the replicator's.
    rec = failure_of(_result(1, NodeOutcome(node, exit_code=1, tail=tail)), False, 2187)
    assert rec.cause == "worker crash: exit 1: step 2187/100000 | loss 1.9", rec.cause
