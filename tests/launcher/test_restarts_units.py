"""--recover for a user's own program, without a network: the options and their refusals, the
environment contract, why an attempt ended and whether the policy allows another, and the
node-side watchdog's SIGTERM grace and preemption notice (run here, under bash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.core.env import job_env, node_env
from launcher.core.program import NodeProgram, ProgramBuilder
from launcher.core.types import (
    Cluster,
    LaunchConfig,
    LaunchResult,
    Node,
    NodeOutcome,
    UserError,
    WorkerFailure,
    Workload,
)
from launcher.core.wire import EXIT_MARKER, PREEMPTION_NOTICE, grace_line
from launcher.jobs.record import STOP_GRACE_FILE, process_start, stop_script
from launcher.jobs.recovery import RecoverPolicy, RecoverRequest, failure_of, recover_policy
from launcher.jobs.restarts import (
    parse_exit_codes,
    program_error_line,
    restart_refusal,
    worker_exit_codes,
)
from tests.launcher.fake_gpu_node import FakeMetadata

OWN = ("script.py", "--epochs", "3")


def _cfg(**kw) -> LaunchConfig:
    kw.setdefault("workload", Workload("torchrun", OWN))
    kw.setdefault("job_id", "job1")
    return LaunchConfig(**kw)


def _cluster(n: int = 2) -> Cluster:
    return Cluster("c", tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(n)))


# ---- options --------------------------------------------------------------------------------


def test_exit_codes_read_a_comma_list_and_a_bad_one_names_itself_and_the_range():
    assert parse_exit_codes("2") == (2,) and parse_exit_codes("3, 2,3") == (2, 3) and parse_exit_codes("0") == (0,)
    for bad, culprit in (("256", "'256'"), ("2,-1", "'-1'"), ("abc", "'abc'"), ("2,,3", "''")):
        with pytest.raises(UserError) as e:
            parse_exit_codes(bad)
        assert culprit in str(e.value) and "0..255" in str(e.value) and "\n" not in str(e.value)


def test_recover_for_an_own_program_needs_no_checkpoint_dir_and_takes_max_restarts():
    got = recover_policy(RecoverRequest(recover=True, max_restarts=2), OWN, detach=True, builtin=False)
    assert got.max_restarts == 2 and got.no_restart_exit_codes == (2,) and not got.resume
    assert got.max_recoveries == 3
    codes = recover_policy(RecoverRequest(recover=True, no_restart_exit_codes="3,4"), OWN, True, builtin=False)
    assert codes.max_restarts == 0 and codes.no_restart_exit_codes == (3, 4)
    # The built-in workload keeps its policy: every recovery in --max-recoveries, with --resume.
    train = recover_policy(RecoverRequest(recover=True, max_restarts=2), ("--checkpoint-dir", "/c"), True, builtin=True)
    assert train.max_restarts is None and train.resume
    with pytest.raises(UserError, match="--no-restart-exit-codes is for your own program"):
        recover_policy(RecoverRequest(recover=True, no_restart_exit_codes="3"), ("--checkpoint-dir", "/c"), True, True)
    with pytest.raises(UserError, match="--no-restart-exit-codes needs --recover"):
        recover_policy(RecoverRequest(no_restart_exit_codes="3"), OWN, True, builtin=False)


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    # An address nothing answers at: a refusal must come before any connection.
    path = tmp_path / "hosts"
    path.write_text("10.255.255.1\n10.255.255.2\n")
    return path


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "--recover", "--", "train.py"], "--recover needs --detach"),
        (["exec", "--recover", "--", "true"], "--recover needs --detach"),
        (
            ["run", "--detach", "--recover", "--no-restart-exit-codes", "256", "--", "t.py"],
            "'256' is not an exit status",
        ),
        (["run", "--term-grace", "abc", "--", "train.py"], "--term-grace 'abc' is not a duration"),
        (["exec", "--detach", "--term-grace", "0", "--", "true"], "--term-grace '0' is not a duration"),
        (["stop", "--grace", "abc", "20260101-120000-a1b2c3"], "--grace 'abc' is not a duration"),
    ],
)
def test_bad_recover_and_grace_input_is_one_line_exit_2_and_nothing_starts(hostfile, tmp_path, args, words):
    runs = tmp_path / "runs"
    cmd, rest = args[0], args[1:]
    r = CliRunner().invoke(main, [cmd, "--hostfile", str(hostfile), "--runs-dir", str(runs), *rest])
    assert r.exit_code == 2, r.output
    (line,) = [line for line in r.output.splitlines() if line.strip()]
    assert line.startswith("error: ") and words in line, r.output
    assert not runs.exists()


def test_the_installed_launch_refuses_recover_without_detach_in_one_line(hostfile, tmp_path):
    launch = Path(sys.executable).with_name("launch")
    r = subprocess.run(
        [str(launch), "run", "--hostfile", str(hostfile), "--recover", "--", "train.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == "" and "--recover needs --detach" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


# ---- the environment contract ----------------------------------------------------------------


def test_every_rank_gets_the_job_id_the_attempt_and_from_attempt_1_the_reason():
    assert job_env(_cfg()) == {"GPUFLEET_JOB_ID": "job1", "GPUFLEET_ATTEMPT": "0"}
    again = _cfg(attempt=2, restart_reason="preempted")
    assert job_env(again) == {
        "GPUFLEET_JOB_ID": "job1",
        "GPUFLEET_ATTEMPT": "2",
        "GPUFLEET_RESTART_REASON": "preempted",
    }
    env = node_env(_cluster(), again)
    assert env["GPUFLEET_ATTEMPT"] == "2" and env["GPUFLEET_RESTART_REASON"] == "preempted"
    # torchrun's own SIGKILL comes after ours: its shutdown timeout follows --term-grace.
    assert node_env(_cluster(), _cfg(stop_grace_s=10.5))["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "16"
    # A plain command gets the contract too (but not the NCCL profile), and --env still wins.
    plain = _cfg(workload=Workload("exec", ("true",)), attempt=1, restart_reason="hang", env=(("X", "1"),))
    env = [(v.name, v.value) for v in ProgramBuilder(_cluster(), plain).plans()[0].env]
    assert ("GPUFLEET_ATTEMPT", "1") in env and ("GPUFLEET_RESTART_REASON", "hang") in env
    # (--env's value comes on stdin: the node reads X, after the contract's variables.)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in dict(env) and ("X", None) in env
    assert env.index(("X", None)) > env.index(("GPUFLEET_RESTART_REASON", "hang"))


# ---- why an attempt ended, and whether another is allowed ------------------------------------

SUMMARY = [
    "[1]:",
    "  time      : 2026-01-01_00:00:00",
    "  rank      : 1 (local_rank: 0)",
    "  exitcode  : 2 (pid: 4242)",
    "  error_file: <N/A>",
]


def _result(*outcomes: NodeOutcome, first: int | None = None, run_dir: Path = Path("/nonexistent")) -> LaunchResult:
    r = LaunchResult("j", run_dir, {o.node.rank: o for o in outcomes})
    r.first_failure = first
    return r


def test_worker_exit_codes_come_from_torchruns_summary_or_the_command_itself():
    node = Node(1, "h", "h")
    torchrun = _result(NodeOutcome(node, exit_code=1, tail=SUMMARY), first=1)
    assert worker_exit_codes(torchrun, torchrun=True) == [2]
    agent = _result(NodeOutcome(node, exit_code=1, tail=["... failed (exitcode: -9) local_rank: 0 (pid: 7) of"]))
    assert worker_exit_codes(agent, torchrun=True) == [-9]
    plain = _result(NodeOutcome(node, exit_code=3, tail=["whatever"]), first=1)
    assert worker_exit_codes(plain, torchrun=False) == [3]
    reported = NodeOutcome(node, exit_code=137, tail=["x"], worker=WorkerFailure(-9, 0, 7))
    assert worker_exit_codes(_result(reported), torchrun=True) == [137]
    lost = _result(NodeOutcome(node, exit_code=255, connection_lost=True, tail=SUMMARY))
    assert worker_exit_codes(lost, torchrun=True) == []


def test_the_reason_is_node_lost_preempted_or_worker_failed():
    node = Node(1, "h", "h")
    lost = _result(NodeOutcome(node, exit_code=255, connection_lost=True, error="reset"), first=1)
    assert failure_of(lost, preempted=False, step=None).reason == "node-lost"
    assert failure_of(lost, preempted=True, step=None).reason == "preempted"
    crash = _result(NodeOutcome(node, exit_code=1, tail=SUMMARY), first=1)
    assert failure_of(crash, preempted=False, step=None).reason == "worker-failed"
    # A notice came, then the ranks exited nonzero on their SIGTERM: still a preemption.
    assert failure_of(crash, preempted=True, step=None).reason == "preempted"


def test_the_budget_counts_node_reasons_and_program_reasons_apart():
    p = RecoverPolicy(max_recoveries=2, max_restarts=1, no_restart_exit_codes=(2,))
    lost, failed = {"reason": "node-lost"}, {"reason": "worker-failed"}
    assert restart_refusal("worker-failed", [1], [], p) == ""
    assert restart_refusal("worker-failed", [1], [lost, lost], p) == ""  # lost nodes are not the program's
    assert "gave up after 1 restart (--max-restarts 1)" in restart_refusal("worker-failed", [1], [failed], p)
    assert "gave up after 1 restart" in restart_refusal("hang", [], [failed], p)  # a hang counts the same
    assert "exit 2 is in --no-restart-exit-codes 2" in restart_refusal("worker-failed", [1, 2], [], p)
    assert restart_refusal("node-lost", [], [failed, lost], p) == ""
    assert "gave up after 2 recoveries (--max-recoveries 2)" in restart_refusal("preempted", [], [lost, lost], p)
    zero = RecoverPolicy(max_restarts=0)
    assert "not restarted (--max-restarts 0" in restart_refusal("worker-failed", [1], [], zero)


def test_the_programs_own_error_line_is_found_in_its_tail_or_its_log(tmp_path):
    node = Node(1, "h", "h")
    said = ["Traceback (most recent call last):", '  File "t.py", line 3', "ValueError: bad shard 7", *SUMMARY]
    assert program_error_line(_result(NodeOutcome(node, exit_code=1, tail=said), first=1)) == "ValueError: bad shard 7"
    (tmp_path / "node-1.log").write_text("\n".join(["old", "KeyError: 'x'", "new", *said]) + "\n")
    pushed_out = _result(NodeOutcome(node, exit_code=1, tail=SUMMARY), first=1, run_dir=tmp_path)
    assert program_error_line(pushed_out) == "ValueError: bad shard 7"
    assert program_error_line(_result(NodeOutcome(node, exit_code=1, tail=SUMMARY), first=1)) == ""


# ---- `launch stop --grace`, and the watchdog's grace on a node --------------------------------


def test_stop_script_leaves_the_grace_for_the_controller_before_its_sigterm(tmp_path):
    home = tmp_path / "home"
    jobdir = home / ".gpufleet" / "jobs" / "20260101-120000-a1b2c3"
    jobdir.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (jobdir / "controller.pid").write_text(f"{sleeper.pid} {process_start(sleeper.pid)}\n")
        out = subprocess.run(
            ["bash", "-c", stop_script("20260101-120000-a1b2c3", 7.5)],
            capture_output=True,
            text=True,
            env={**os.environ, "HOME": str(home)},
            timeout=30,
        )
        assert out.stdout.strip() == "stopping" and sleeper.wait(timeout=10) == -15
        assert float((jobdir / STOP_GRACE_FILE).read_text()) == 7.5
    finally:
        sleeper.kill()
        sleeper.wait()


def _wrapper(tmp_path: Path, prog: str, grace_s: float, env: dict[str, str] | None = None, watch: bool = False):
    """The node-side program around `prog` (one "rank": RANK=0 in its environment), started."""
    c = _cluster(1)
    argv = ["env", "RANK=0", sys.executable, "-c", prog]
    cfg = _cfg(job_id=f"unit-{tmp_path.name}", stop_grace_s=grace_s)
    script = NodeProgram(c, c.nodes[0], cfg, env or {}, argv, watch_preemption=watch).render()
    p = subprocess.Popen(["bash", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p.stdout.readline()  # CHECKED_MARKER
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "up"
    return p


SAVES = (
    "import signal, sys, time\n"
    "def term(s, f):\n    time.sleep(1); print('saved', flush=True); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term); print('up', flush=True)\nwhile True: time.sleep(0.1)\n"
)
IGNORES = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)\n"
)


def test_a_rank_that_saves_on_sigterm_exits_by_itself_and_one_that_ignores_it_is_killed(tmp_path):
    p = _wrapper(tmp_path / "a", SAVES, grace_s=30)
    p.stdin.write(grace_line(20).decode())  # this stop's own grace, as `launch stop --grace 20s` sends it
    p.stdin.close()
    out = p.stdout.read()
    assert p.wait(timeout=60) == 0 and "saved" in out, out
    assert "gpufleet-stop: rank 0 (pid " in out and ") exited by itself after SIGTERM" in out, out
    p = _wrapper(tmp_path / "b", IGNORES, grace_s=30)
    p.stdin.write(grace_line(1).decode())
    p.stdin.close()
    out = p.stdout.read()
    assert p.wait(timeout=60) != 0 and ") killed: still running 1 s after SIGTERM" in out, out
    assert f"{EXIT_MARKER} " in out.splitlines()[-1]


def test_a_preemption_notice_from_the_metadata_server_stops_every_rank_with_the_grace(tmp_path):
    metadata = FakeMetadata(None)
    try:
        p = _wrapper(tmp_path, SAVES, grace_s=20, env={"GCE_METADATA_HOST": metadata.host}, watch=True)
        deadline = time.monotonic() + 30
        while not any("preempted" in r for r in metadata.requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        metadata.preempt()
        out = p.stdout.read()  # the stdin stays open: the notice alone stops the rank
        assert p.wait(timeout=60) == 0, out
        lines = out.splitlines()
        notice = [line for line in lines if line.startswith(PREEMPTION_NOTICE)]
        assert notice and "SIGKILL after 20 s" in notice[0], out
        assert lines.index(notice[0]) < lines.index("saved") and "exited by itself" in out, out
    finally:
        metadata.close()
    # Without a metadata server, the watcher ends at once and the job runs on.
    c = _cluster(1)
    script = NodeProgram(
        c, c.nodes[0], _cfg(job_id="u2"), {"GCE_METADATA_HOST": "127.0.0.1:9"}, ["true"], watch_preemption=True
    ).render()
    out = subprocess.run(["bash", "-c", script], input="go\n", capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and PREEMPTION_NOTICE not in out.stdout


def test_the_request_carries_the_attempt_defaults_and_the_term_grace():
    from launcher.core.types import SshConfig
    from launcher.jobs.record import request_from_json, request_json

    cfg = _cfg(stop_grace_s=12.0)
    d = json.loads(json.dumps(request_json(_cluster(), cfg, SshConfig(key=Path("k"), known_hosts=Path("kh")))))
    _, back = request_from_json(d, [], Path("/home/u"), Path("/runs"))
    assert back.stop_grace_s == 12.0 and back.attempt == 0 and back.restart_reason == ""
