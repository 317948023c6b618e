"""Hang detection without a cluster: the detector on a fake clock, the classifier and the verdict
on real py-spy dumps (tests/fixtures/py-spy, README there), the node-side collection program run
for real with local bash against processes shaped like torchrun's, the flight recorder's
environment, and bad input."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.core import node_start
from launcher.core.env import flight_recorder_on, node_env
from launcher.core.hang import (
    FR_ALIASES,
    STARTUP_S,
    HangWatch,
    flight_recorder_env,
    flight_recorder_prefix,
)
from launcher.core.program import ProgramBuilder
from launcher.core.stacks import (
    PYSPY_TOOLS,
    STACK_MARKER,
    NodeStacks,
    RankStack,
    classify,
    collect,
    collect_script,
    collect_stdin,
    main_thread_frames,
    parse_node_output,
    verdict,
)
from launcher.core.transport import Transport
from launcher.core.types import Cluster, Hang, LaunchConfig, LaunchResult, Node, SshConfig, Workload, new_job_id
from launcher.jobs.recovery import failure_of
from tests.support import PY, wait_for

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "py-spy"


def dump(name: str) -> str:
    return (DUMPS / name).read_text()


def nodes(n: int) -> list[Node]:
    return [Node(i, f"10.0.0.{i + 11}", f"10.0.0.{i + 11}") for i in range(n)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the detector ----


def test_watch_fires_once_after_the_timeout_without_a_line_and_a_line_resets_it():
    clock = FakeClock()
    w = HangWatch(30, clock=clock, startup_s=0)
    assert not w.overdue()  # not started: the workload is not running yet
    w.start()
    clock.now += 29
    w.saw("step 1")
    clock.now += 29
    assert not w.overdue()  # 29 s since the last line
    clock.now += 2
    assert w.silent_for() == 31 and w.overdue()
    assert not w.overdue()  # once: the launch acts on it once


def test_with_progress_only_matching_lines_count():
    clock = FakeClock()
    w = HangWatch(30, progress=r"step \d+", clock=clock, startup_s=0)
    w.start()
    clock.now += 20
    w.saw("step 7 | loss 2.1")
    for _ in range(4):  # a heartbeat every 10 s is not progress
        clock.now += 10
        w.saw("heartbeat: still alive")
    assert w.silent_for() == 40 and w.overdue()


def test_before_the_first_progress_line_the_job_gets_its_startup_time():
    clock = FakeClock()
    w = HangWatch(5, clock=clock)
    w.start()
    clock.now += STARTUP_S - 1  # importing torch, the rendezvous: no line yet
    assert not w.overdue()
    w.saw("rank 0 up")
    clock.now += 6
    assert w.overdue()


def test_a_watch_without_a_positive_timeout_is_refused():
    with pytest.raises(ValueError):
        HangWatch(0)


# ---- classifying real dumps ----


def test_a_rank_in_a_gloo_all_reduce_is_inside_a_collective():
    p = classify(dump("gloo-all_reduce-wait.txt"))
    assert p.in_collective and p.collective == "all_reduce"
    assert p.at(1) == "train_step (hang_script.py:12)"  # the user's call site, not c10d_logger's wrapper


def test_a_rank_in_a_barrier_is_inside_a_collective():
    p = classify(dump("gloo-barrier-wait.txt"))
    assert p.in_collective and p.collective == "barrier" and p.at(1) == "main (hang_script.py:19)"


def test_a_rank_sleeping_in_user_code_is_outside_with_its_frames():
    p = classify(dump("user-sleep.txt"))
    assert not p.in_collective
    assert p.at() == "load_batch (hang_script.py:6) <- train_step (hang_script.py:10)"
    # With --native, libc and the interpreter's frames come first and are passed over.
    native = classify(dump("user-sleep-native.txt"))
    assert not native.in_collective
    assert native.at() == "load_batch (hang_script.py:16) <- train_step (hang_script.py:21)"


def test_work_wait_is_seen_only_in_native_frames():
    # Python frames alone show only the caller's line: this is why suspects are dumped again.
    assert not classify(dump("gloo-work-wait.txt")).in_collective
    p = classify(dump("gloo-work-wait-native.txt"))
    assert p.in_collective and p.collective == "wait" and p.at(1) == "train_step (hang_script.py:14)"


def test_the_main_thread_decides_when_other_threads_come_first():
    other = 'Thread 77 (idle): "pt_elastic"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n'
    text = dump("user-sleep.txt")
    head, _, rest = text.partition("Thread ")
    frames = main_thread_frames(head + other + "Thread " + rest)
    assert frames[0].function == "load_batch"
    assert not classify(head + other + "Thread " + rest).in_collective


# ---- the verdict ----


def rank(node: Node, r: int, name: str) -> RankStack:
    return RankStack(node, r, 100 + r, True, dump(name))


def test_verdict_names_the_rank_outside_any_collective_with_its_frames():
    n0, n1 = nodes(2)
    got = [
        NodeStacks(n0, [rank(n0, 0, "gloo-all_reduce-wait.txt"), rank(n0, 1, "gloo-all_reduce-wait.txt")]),
        NodeStacks(n1, [rank(n1, 2, "user-sleep.txt"), rank(n1, 3, "gloo-all_reduce-wait.txt")]),
    ]
    line, named = verdict(30.4, got, "runs/J/stacks")
    assert line == (
        "hang: no progress for 30 s; node 1 (10.0.0.12) rank 2 is outside any collective at load_batch "
        "(hang_script.py:6) <- train_step (hang_script.py:10); 3 ranks wait in all_reduce; stacks: runs/J/stacks/"
    )
    assert [(s.node.rank, s.rank) for s in named] == [(1, 2)]


def test_where_every_rank_waits_the_one_in_another_collective_is_named():
    n0, n1 = nodes(2)
    got = [
        NodeStacks(n0, [rank(n0, 0, "gloo-barrier-wait.txt"), rank(n0, 1, "gloo-all_reduce-wait-rank1.txt")]),
        NodeStacks(n1, [rank(n1, 2, "gloo-all_reduce-wait-rank1.txt"), rank(n1, 3, "gloo-all_reduce-wait-rank1.txt")]),
    ]
    line, named = verdict(30, got, "runs/J/stacks")
    assert line == (
        "hang: no progress for 30 s; every rank waits in a collective, but not the same one: node 0 (10.0.0.11) "
        "rank 0 waits in barrier at main (hang_script.py:19), while 3 ranks wait in all_reduce at "
        "train_step (hang_script.py:12); stacks: runs/J/stacks/"
    )
    assert [s.rank for s in named] == [0]


def test_where_every_rank_waits_in_the_same_collective_it_says_so_and_names_no_rank():
    (n0,) = nodes(1)
    got = [NodeStacks(n0, [rank(n0, r, "gloo-all_reduce-wait.txt") for r in range(3)])]
    line, named = verdict(61, got, "s")
    assert "every rank (3) waits in all_reduce at train_step (hang_script.py:12)" in line
    assert "the collective itself is stuck" in line and named == []


def test_verdict_reports_ranks_and_nodes_that_gave_no_stack():
    n0, n1 = nodes(2)
    failed = RankStack(n0, 1, 101, False, "Error: Permission denied (os error 13)\n", 1)
    got = [
        NodeStacks(n0, [rank(n0, 0, "user-sleep.txt"), failed]),
        NodeStacks(n1, error="could not collect stacks: Connection refused"),
    ]
    line, _ = verdict(30, got, "s")
    assert "node 0 (10.0.0.11) rank 0 is outside any collective at load_batch" in line
    assert "no stack from node 0 (10.0.0.11) rank 1: Error: Permission denied (os error 13)" in line
    assert "node 1 (10.0.0.12): could not collect stacks: Connection refused" in line


def test_a_rank_that_gives_no_stack_is_named_before_a_waiting_rank_at_another_call_site():
    # A stopped rank (SIGSTOP, a process in D state) gives no stack while the others wait for it
    # in a collective, some at another call site: the rank without a stack is the culprit.
    n0, n1 = nodes(2)
    stopped = RankStack(n1, 2, 102, False, "Error: Failed to suspend process\n", 1)
    got = [
        NodeStacks(n0, [rank(n0, 0, "gloo-barrier-wait.txt"), rank(n0, 1, "gloo-all_reduce-wait-rank1.txt")]),
        NodeStacks(n1, [stopped]),
    ]
    line, named = verdict(30, got, "s")
    assert [(s.node.rank, s.rank) for s in named] == [(1, 2)]
    assert "2 ranks wait in collectives" in line and "every rank" not in line, line
    assert "no stack from node 1 (10.0.0.12) rank 2: Error: Failed to suspend process" in line


@pytest.mark.parametrize(
    "text,status,why",
    [
        # py-spy's error on stderr came before the header it had written to stdout
        ("Error: Failed to suspend process\nProcess 881: python\nPython v3.11.2 (/usr/bin/python3.11)\n", 1,
         "Error: Failed to suspend process"),
        ("Process 881: python\nPython v3.11.2 (/usr/bin/python3.11)\n", 124,
         "py-spy got no stack in 30 s (the process is stopped, or stuck in the kernel)"),
        ("", 3, "py-spy exit 3"),
    ],
)  # fmt: skip
def test_why_a_rank_gave_no_stack_is_py_spys_error_not_its_header(text, status, why):
    n0, n1 = nodes(2)
    got = [
        NodeStacks(n0, [rank(n0, 0, "gloo-all_reduce-wait.txt")]),
        NodeStacks(n1, [RankStack(n1, 1, 881, False, text, status)]),
    ]
    line, named = verdict(10, got, "s")
    assert f"no stack from node 1 (10.0.0.12) rank 1: {why};" in line and [s.rank for s in named] == [1], line


def test_node_output_is_split_into_ranks_and_flight_recorder_dumps():
    (n0,) = nodes(1)
    text = (
        "login banner\n"
        f"{STACK_MARKER} 4 901 0\n{dump('gloo-all_reduce-wait.txt')}"
        f"{STACK_MARKER} 5 902 1\nError: No such process\n"
        "__GPUFLEET_FR__ 4 aGVsbG8=\n__GPUFLEET_STACKS_END__\n"
    )
    ns = parse_node_output(n0, text)
    assert [(s.rank, s.pid, s.ok) for s in ns.ranks] == [(4, 901, True), (5, 902, False)]
    assert ns.ranks[0].text == dump("gloo-all_reduce-wait.txt") and "login banner" not in ns.ranks[0].text
    assert ns.flight_recorder == {4: b"hello"} and ns.error == ""
    assert "py-spy is not installed" in parse_node_output(n0, "__GPUFLEET_NO_PYSPY__\n").error
    assert "no worker" in parse_node_output(n0, "__GPUFLEET_STACKS_END__\n").error


# ---- the node-side program, run for real here ----

_WORKER = """
import os, threading, time
prefix = os.environ["FR_PREFIX"]
def dump_pipe():  # as ProcessGroupNCCL's DumpPipe: a write to <prefix><rank>.pipe asks for a dump
    path = prefix + os.environ["RANK"] + ".pipe"
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    while True:
        try:
            if os.read(fd, 128):
                time.sleep(0.5)  # the dump takes a while: the node program waits for it
                with open(prefix + os.environ["RANK"], "wb") as f:
                    f.write(b"fr-dump")
        except BlockingIOError:
            pass
        time.sleep(0.05)
threading.Thread(target=dump_pipe, daemon=True).start()
if os.fork() == 0:  # a DataLoader worker: it carries the rank's environment too
    time.sleep(600)
def load_batch():
    time.sleep(600)
load_batch()
"""


@pytest.fixture
def fake_torchrun(tmp_path):
    """An agent carrying the run token (no RANK) whose child is rank 3 (RANK, LOCAL_RANK), which
    forks a child of its own and serves a flight-recorder pipe: what a node of a job looks like."""
    job = new_job_id()
    prefix = flight_recorder_prefix(job)
    env = {**os.environ, "GPUFLEET_RUN": f"{job}-0", "FR_PREFIX": prefix}
    agent_code = (
        "import os, subprocess, sys, time\n"
        "env = {**os.environ, 'RANK': '3', 'LOCAL_RANK': '1'}\n"
        "w = subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=env)\n"
        "print(w.pid, flush=True)\n"
        "w.wait()\n"
    )
    agent = subprocess.Popen(
        [PY, "-c", agent_code, _WORKER], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    worker_pid = int(agent.stdout.readline())
    wait_for(lambda: Path(prefix + "3.pipe").exists(), 30, "the worker's pipe")
    yield job, worker_pid
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    for p in Path("/tmp").glob(Path(prefix).name + "*"):
        p.unlink()


def test_the_node_program_dumps_the_rank_not_its_agent_nor_its_child_with_native_frames_and_the_flight_recorder(
    fake_torchrun,
):
    job, worker_pid = fake_torchrun
    config = LaunchConfig(Workload("torchrun", ("x.py",)), job_id=job, python=PY)
    node = Node(0, "localhost", "127.0.0.1")
    script = collect_script(config, node, fr=True)
    r = subprocess.run(Transport(local=True).argv(node, script), capture_output=True, text=True, timeout=120)
    ns = parse_node_output(node, r.stdout)
    assert [(s.rank, s.pid, s.ok) for s in ns.ranks] == [(3, worker_pid, True)], r.stdout + r.stderr
    assert classify(ns.ranks[0].text).at(1) == "load_batch (<string>:21)"
    assert ns.flight_recorder == {3: b"fr-dump"}
    assert not Path(flight_recorder_prefix(job) + "3").exists()  # copied back, then removed
    # Outside torch.distributed's Python: dumped again in the same program with native frames.
    assert "clock_nanosleep (libc.so.6)" in ns.ranks[0].text


def test_the_node_program_quotes_what_it_is_given():
    hostile = '"; touch /tmp/pwned-gpufleet; "'
    config = LaunchConfig(Workload("torchrun", ("x.py",)), job_id="j", python=hostile, env=(("PATH", hostile),))
    script = collect_script(config, Node(0, "h", "10.0.0.2"))
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    r = subprocess.run(["bash", "-c", script], input=collect_stdin(config), capture_output=True, timeout=60)
    assert not Path("/tmp/pwned-gpufleet").exists() and r.returncode == 0
    assert b"__GPUFLEET_STACKS_END__" in r.stdout or b"__GPUFLEET_NO_PYSPY__" in r.stdout


def test_the_ssh_line_of_the_stacks_program_holds_no_env_value():
    path, token = "/opt/job-tools-7f3a/bin", "hf_s3cr3t-token-9b2"
    config = LaunchConfig(
        Workload("torchrun", ("x.py",)), job_id="j", env=(("PATH", path), ("HF_TOKEN", token)), python="python3"
    )
    node = Node(0, "h", "10.0.0.2")
    transport = Transport(local=False, ssh_base=["ssh", "-o", "BatchMode=yes"])
    argv = " ".join(transport.argv(node, collect_script(config, node, fr=True)))
    assert path not in argv and token not in argv
    # The PATH travels on stdin instead (one env_block line); the token is not needed there at all.
    assert collect_stdin(config) == f"{path}\n".encode()
    assert collect_stdin(LaunchConfig(Workload("torchrun", ("x.py",)), job_id="j")) == b""


def test_the_stacks_program_finds_py_spy_beside_the_python_that_the_env_path_read_from_stdin_names(
    fake_torchrun, tmp_path
):
    """`python` on the nodes is the one --env PATH puts first: its py-spy dumps the rank, though
    neither the PATH nor the directory is on the command line."""
    job, worker_pid = fake_torchrun
    own = tmp_path / "own env" / "bin"  # a space: the value is read back byte for byte
    own.mkdir(parents=True)
    (own / "python").symlink_to(PY)
    (own / "py-spy").symlink_to(Path(PY).parent / "py-spy")
    config = LaunchConfig(
        Workload("torchrun", ("x.py",)), job_id=job, python="python", env=(("PATH", str(own)),), runs_dir=tmp_path
    )
    cluster = Cluster("l", (Node(0, "localhost", "127.0.0.1"),), local=True)
    hang = collect(cluster, config, Transport(local=True), 12)
    text = (config.run_dir / "stacks" / "node-0-rank-3.txt").read_text()
    assert f"Process {worker_pid}:" in text and "load_batch" in text, hang.verdict
    assert "rank 3 is outside any collective at load_batch" in hang.verdict


def test_the_stacks_program_takes_the_tools_environments_py_spy_where_the_python_has_none(fake_torchrun, tmp_path):
    """A job environment without py-spy (a user's --sync requirements): the one the node
    preparation built under $HOME/PYSPY_TOOLS is used, before any on PATH."""
    job, worker_pid = fake_torchrun
    home = tmp_path / "home"
    tools = home / PYSPY_TOOLS / "bin"
    tools.mkdir(parents=True)
    (tools / "py-spy").symlink_to(Path(PY).parent / "py-spy")
    bare = tmp_path / "bare"  # a python with nothing beside it, and no py-spy on PATH
    bare.mkdir()
    (bare / "python").symlink_to(PY)
    config = LaunchConfig(Workload("torchrun", ("x.py",)), job_id=job, python=str(bare / "python"))
    script = collect_script(config, Node(0, "localhost", "127.0.0.1"))
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", "-c", script], input=b"", env=env, capture_output=True, timeout=120)
    ns = parse_node_output(Node(0, "localhost", "127.0.0.1"), r.stdout.decode())
    assert [(s.rank, s.pid, s.ok) for s in ns.ranks] == [(3, worker_pid, True)], r.stdout + r.stderr
    (tools / "py-spy").unlink()
    r = subprocess.run(["bash", "-c", script], input=b"", env=env, capture_output=True, timeout=120)
    assert "py-spy is not installed" in parse_node_output(Node(0, "localhost", "127.0.0.1"), r.stdout.decode()).error


# ---- the flight recorder's environment ----


def test_nccl_jobs_get_the_flight_recorder_and_cpu_jobs_do_not():
    config = LaunchConfig(Workload("torchrun", ("x.py",)), job_id="20260101-000000-abcdef")
    gpu = Cluster("c", tuple(nodes(2)), "a3-megagpu-8g")
    env = node_env(gpu, config)
    prefix = "/tmp/gpufleet-20260101-000000-abcdef-nccl_trace_rank_"
    assert {k: env[k] for k in flight_recorder_env(config.job_id)} == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix,
    }
    assert flight_recorder_on(gpu) and flight_recorder_on(Cluster("c", tuple(nodes(2))))  # unknown: maybe GPUs
    local = Cluster("l", tuple(nodes(2)), local=True)
    assert not flight_recorder_on(local) and "TORCH_FR_DUMP_TEMP_FILE" not in node_env(local, config)


@pytest.mark.parametrize("version, aliased", [("2.7.1", True), ("2.4.0", True), ("2.8.0", False), ("2.13.0", False)])
def test_a_torch_older_than_2_8_gets_the_flight_recorders_older_names_and_a_newer_one_only_the_new(
    tmp_path, version, aliased
):
    # A real python reading a real dist-info (what pip or uv writes for an installed torch), so
    # importlib.metadata answers the version as it would on the node.
    site = tmp_path / "site"
    (site / f"torch-{version}.dist-info").mkdir(parents=True)
    (site / f"torch-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
    )
    config = LaunchConfig(Workload("torchrun", ("x.py",)), job_id="20260101-000000-abcdef", python=PY)
    gpu = Cluster("c", tuple(nodes(2)), "a3-megagpu-8g")
    env = node_env(gpu, config)
    # The node's plan, its environment and prepare steps run as the node runs them (launcher.core.node_start).
    plan = ProgramBuilder(gpu, config).plans()[0].to_json()
    driver = "\nimport json, sys\ns = Start(json.loads(sys.argv[1]), None)\ns.environment()\ns.prepare()\n"
    driver += "print(dict(os.environ))\n"
    out = subprocess.run(
        ["python3", "-I", "-S", "-c", Path(node_start.__file__).read_text() + driver, plan],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": os.environ["PATH"], "HOME": str(tmp_path)},
    )
    got = {k: v for k, v in ast.literal_eval(out.stdout).items() if k.startswith("TORCH_")}
    old = {o: env[n] for n, o in FR_ALIASES.items()}
    assert (old.items() <= got.items()) is aliased, got
    assert got["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert dict(node_start.FR_ALIASES) == FR_ALIASES  # the node's copy of the names


# ---- the result, the record and a restart ----


def test_a_hang_ends_the_launch_with_124_and_is_a_failure_to_restart_from():
    result = LaunchResult("j", Path("runs/j"), {}, hang=Hang("hang: no progress for 5 s; ...", node=1))
    assert result.exit_code == 124
    rec = failure_of(result, preempted=False, step=12)
    assert rec.node == 1 and rec.cause.startswith("hang: no progress") and rec.signature == "hang"


# ---- bad input ----


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--hang-timeout", "0"], "--hang-timeout '0' is not a duration"),
        (["--hang-timeout", "abc"], "--hang-timeout 'abc' is not a duration"),
        (["--hang-timeout", "5s", "--progress", "step (\\d+"], "--progress 'step (\\\\d+' is not a valid regular"),
        (["--progress", "step"], "--progress 'step' only counts with a hang timeout; add --hang-timeout"),
    ],
)
@pytest.mark.parametrize("command", ["run", "train"])
def test_bad_hang_input_is_one_line_exit_2_and_nothing_starts(tmp_path, command, args, culprit):
    if command == "train" and args[0] == "--progress":
        args = ["--hang-timeout", "off", *args]
    program = ["x.py"] if command == "run" else ["--steps", "1"]
    hosts = tmp_path / "hosts"
    hosts.write_text("10.255.255.1\n")  # nothing answers there: any connection would hang the test
    for detach in ([], ["--detach"]):
        r = CliRunner().invoke(
            main,
            [command, "--hostfile", str(hosts), "--runs-dir", str(tmp_path / "runs"), *detach, *args, "--", *program],
        )
        assert r.exit_code == 2, r.output
        assert r.output.count("\n") == 1 and culprit in r.output, r.output
    assert not (tmp_path / "runs").exists()


def test_hang_timeout_off_turns_trains_default_off():
    from launcher.cli.options import build_config

    cluster = Cluster("c", tuple(nodes(1)))
    on = build_config({"hang_timeout": "10m"}, Workload("torchrun", ("x",)), cluster)
    off = build_config({"hang_timeout": "off"}, Workload("torchrun", ("x",)), cluster)
    assert on.hang_timeout_s == 600 and off.hang_timeout_s is None
    r = CliRunner().invoke(main, ["train", "--help"])
    assert "[default: 10m]" in " ".join(r.output.split())
    r = CliRunner().invoke(main, ["run", "--help"])
    assert "[default: off]" in " ".join(r.output.split())


def test_the_hang_settings_travel_to_the_detached_controller():
    from launcher.jobs.record import request_from_json, request_json

    config = LaunchConfig(
        Workload("torchrun", ("x.py",)), job_id="j", hang_timeout_s=30.0, progress=r"step \d+", ssh=SshConfig()
    )
    cluster = Cluster("c", tuple(nodes(2)))
    _, back = request_from_json(request_json(cluster, config, config.ssh), [], Path("/home/u"), Path("/jobs"))
    assert back.hang_timeout_s == 30.0 and back.progress == r"step \d+"
