"""launcher.core.node_run, the run half of an attached launch in Python, run as a node runs it
(`python3 -I -S -c SOURCE run PLAN`, the system python3, nothing of gpufleet on its path) on real
processes: which processes it takes for ranks, what a stop and a failure leave, its refusals. The
launches that use it (every cluster test) hold the rest."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpufleet.contracts import LAUNCHER_ERROR_PREFIX
from gpufleet.node_plan import SCHEMA_VERSION, Container, EnvVar, Limits, NodePlan
from launcher.core import node_run, node_start
from launcher.core.program import _node_run_source
from launcher.core.wire import EXIT_MARKER, PREEMPTION_NOTICE, RUN_VAR, STOP_REPORT, grace_line, stop_ticks
from tests.support import wait_for

SOURCE = _node_run_source()


def test_the_code_every_node_gets_is_python_3_8_and_names_the_launchers_markers():
    """What travels (launcher.core.program: the module without its docstrings) parses with the
    grammar of the oldest python3 a node may have (Ubuntu 20.04's 3.8)."""
    shipped = _node_run_source()
    ast.parse(shipped, feature_version=(3, 8))
    written = len(Path(node_run.__file__).read_text()) + len(Path(node_start.__file__).read_text())
    assert len(shipped) < written and f'"{STOP_REPORT}"' in shipped.replace("'", '"')
    assert "import launcher" not in shipped and "from launcher" not in shipped  # nothing of gpufleet on a node


def test_the_node_side_names_are_the_launchers():
    assert (node_run.SCHEMA, node_run.RUN_VAR, node_run.STOP_REPORT) == (SCHEMA_VERSION, RUN_VAR, STOP_REPORT)
    assert (node_run.EXIT_MARKER, node_run.PREEMPTION_NOTICE) == (EXIT_MARKER, PREEMPTION_NOTICE)
    assert node_run.ERROR_PREFIX == LAUNCHER_ERROR_PREFIX
    from launcher.core import stacks

    assert (node_run.STACK_MARKER, node_run.FR_MARKER) == (stacks.STACK_MARKER, stacks._FR_MARKER)
    assert (node_run.NO_PYSPY, node_run.STACKS_END) == (stacks._NO_PYSPY, stacks._END)
    assert all(round(g / node_run.TICK_S) == stop_ticks(g) for g in (0.2, 1, 7.5, 25))


def _job() -> str:
    """A job id no other run of these tests on this machine shares: its token is what a stop
    looks for and the reap kills."""
    return f"nr-{uuid.uuid4().hex[:12]}"


def _plan(job: str, argv: list[str], grace_s: float = 5, container: Container | None = None) -> str:
    return NodePlan(
        job_id=job,
        attempt=0,
        node_rank=0,
        nnodes=1,
        host="n0",
        address="10.0.0.1",
        procs=1,
        ranks=None,
        command=tuple(argv),
        argv=tuple(argv),
        workload="torchrun",
        env=(EnvVar(RUN_VAR, f"{job}-0"),),
        limits=Limits(grace_s, False),
        container=container,
    ).to_json()


def _start(plan: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["python3", "-I", "-S", "-c", SOURCE, "run", plan],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _carrying(token: str) -> list[int]:
    return list(node_run.carrying(f"{RUN_VAR}={token}", node_run.pids()))


# A torchrun stand-in: a parent without RANK that starts two ranks, each in a session of its own
# (as torchrun's workers are), rank 1 with a data-loader child that inherits RANK; each rank
# saves for a moment on SIGTERM; the parent waits for them on SIGTERM and exits 0. What it prints:
# "up" once every process runs.
TREE = r"""
import os, signal, subprocess, sys, time
RANK = '''
import signal, subprocess, sys, time
def term(s, f):
    time.sleep(0.3); sys.exit(0)
signal.signal(signal.SIGTERM, term)
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])] if sys.argv[1] == "1" else []
print("rank", sys.argv[1], flush=True)
while True: time.sleep(0.1)
'''
ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r)], env={**os.environ, "RANK": str(r)},
         start_new_session=True, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
for p in ranks: p.stdout.readline()
signal.signal(signal.SIGTERM, lambda s, f: None)
print("up", flush=True)
for p in ranks: p.wait()
"""


def test_a_stop_reports_each_rank_once_in_rank_order_and_leaves_nothing(tmp_path):
    job = _job()
    p = _start(_plan(job, [sys.executable, "-c", TREE]))
    assert p.stdout.readline().strip() == "up"
    assert len(_carrying(f"{job}-0")) == 4  # the parent, two ranks, one data-loader child
    p.stdin.write(grace_line(10).decode())
    p.stdin.close()  # the launcher's end of input: stop
    out = p.stdout.read()
    assert p.wait(timeout=60) == 0, out
    reports = [line for line in out.splitlines() if line.startswith(STOP_REPORT)]
    assert [r.split()[2] for r in reports] == ["0", "1"], out
    assert all(r.endswith("exited by itself after SIGTERM") for r in reports), out
    assert out.splitlines()[-1] == f"{EXIT_MARKER} 0"
    assert _carrying(f"{job}-0") == []  # the data-loader child too


@pytest.mark.parametrize("contained", [True, False])
def test_a_containers_ranks_outside_the_workloads_tree_are_found_by_their_token(tmp_path, contained):
    """A container's ranks are started by the runtime's monitor, not by the workload, so with a
    container in the plan every process with the token is looked at; without one, only the
    workload's tree, and a process outside it is not a rank (it is still killed at the end)."""
    job = _job()
    env = {**os.environ, RUN_VAR: f"{job}-0", "RANK": "3"}
    outside = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    image = Container("registry.example/img:1", f"gpufleet-{job}-0", "none") if contained else None
    try:
        p = _start(_plan(job, ["sleep", "300"], grace_s=0.4, container=image))
        time.sleep(0.5)
        p.stdin.close()
        out = p.stdout.read()
        assert p.wait(timeout=60) == 128 + signal.SIGTERM, out
        reported = f"{STOP_REPORT} rank 3 (pid {outside.pid}) exited by itself after SIGTERM" in out
        assert reported == contained, out
        assert outside.wait(timeout=10) == (-signal.SIGTERM if contained else -signal.SIGKILL)
    finally:
        outside.kill()
        outside.wait()


def test_sigterm_to_the_node_program_stops_the_run_with_the_grace(tmp_path):
    """A SIGTERM to the node's program (a `kill`, the node's shutdown) stops the ranks as a stop
    does: the grace, one report per rank, the reap."""
    job = _job()
    p = _start(_plan(job, [sys.executable, "-c", TREE]))
    assert p.stdout.readline().strip() == "up"
    p.send_signal(signal.SIGTERM)
    out = p.stdout.read()
    assert p.wait(timeout=60) == 0 and out.count("exited by itself after SIGTERM") == 2, out
    assert _carrying(f"{job}-0") == []


def test_a_failed_run_has_what_it_left_behind_killed(tmp_path):
    job = _job()
    left = "import subprocess; subprocess.Popen(['setsid', 'sleep', '300']); raise SystemExit(3)"
    p = _start(_plan(job, [sys.executable, "-c", left]))
    out = p.stdout.read()  # stdin stays open: the run ends by itself
    assert p.wait(timeout=60) == 3 and out.splitlines()[-1] == f"{EXIT_MARKER} 3", out
    assert _carrying(f"{job}-0") == []


@pytest.mark.parametrize(
    ("plan", "line", "rc"),
    [
        (_plan("nr-missing", ["no-such-command-here"]), "failed to execute no-such-command-here:", 127),
        (_plan("nr-schema", ["true"]).replace(f'"schema": {SCHEMA_VERSION}', '"schema": 99'), "schema 99", 2),
        ("{not json", "not JSON", 2),
        (f'{{"schema": {SCHEMA_VERSION}, "argv": ["true"]}}', "lacks its run half (KeyError", 2),
    ],
)
def test_what_the_run_cannot_start_is_one_line(plan, line, rc):
    out = subprocess.run(
        ["python3", "-I", "-S", "-c", SOURCE, "run", plan], input="", capture_output=True, text=True, timeout=60
    )
    first = out.stdout.splitlines()[0]
    assert out.returncode == rc and first.startswith(LAUNCHER_ERROR_PREFIX) and line in first, out


def test_a_supervised_run_stops_on_its_stop_request_and_leaves_its_status(tmp_path):
    """`supervise PLAN DIR`, as a detached job's session starts it (launcher.core.supervise): its
    `pid` once the workload runs, a stop request (the file `stop`, SIGUSR1) with its own grace,
    `rc` at the end; the workload inherits no signal disposition of the supervisor's."""
    job = _job()
    plan = json.loads(_plan(job, [sys.executable, "-c", TREE]))
    plan["limits"]["controller_grace_s"] = 600
    show = "import signal; print('hup', signal.getsignal(signal.SIGHUP) == signal.SIG_DFL, flush=True)\n"
    plan["argv"][-1] = show + TREE
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    with open(d / "out", "ab") as out:
        sup = subprocess.Popen(
            ["python3", "-I", "-S", "-c", SOURCE, "supervise", json.dumps(plan), str(d)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for(lambda: b"up\n" in (d / "out").read_bytes(), 60, "the supervised workload")
    pid, woken = (int(w) for w in (d / "pid").read_text().split())
    assert pid == woken == sup.pid and not (d / "rc").exists()
    (d / "stop").write_text(f"{stop_ticks(7)} 7\n")
    os.kill(woken, signal.SIGUSR1)
    assert sup.wait(timeout=60) == 0
    text = (d / "out").read_text()
    assert "hup True" in text and (d / "rc").read_text() == "0\n", text
    assert text.count("exited by itself after SIGTERM") == 2 and _carrying(f"{job}-0") == [], text


def _supervised(tmp_path, job: str, controller_grace_s: int = 600) -> tuple[Path, subprocess.Popen]:
    """A supervisor of TREE in the run directory `run` under tmp_path, as the session starts it."""
    plan = json.loads(_plan(job, [sys.executable, "-c", TREE]))
    plan["limits"]["controller_grace_s"] = controller_grace_s
    d = tmp_path / "job" / "0.0"
    d.mkdir(parents=True, mode=0o700)
    with open(d / "out", "ab") as out:
        sup = subprocess.Popen(
            ["python3", "-I", "-S", "-c", SOURCE, "supervise", json.dumps(plan), str(d)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return d, sup


def _stream(d: Path, pid: int, offset: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        ["python3", "-I", "-S", "-c", SOURCE, "stream", str(d), str(pid), str(offset)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_stream_relays_a_stop_then_ends_with_the_status_and_removes_the_run(tmp_path):
    """`stream DIR PID OFFSET`, a detached job's session: the supervisor's output from the offset,
    a `term` line relayed as the stop request with its grace, then the status, `EXIT_MARKER`, and
    the run's directory (and the job's, now empty) removed."""
    job = _job()
    d, sup = _supervised(tmp_path, job)
    wait_for(lambda: b"up\n" in (d / "out").read_bytes() and (d / "pid").exists(), 60, "the supervised workload")
    skip = len((d / "out").read_bytes().split(b"up\n", 1)[0])  # a controller that has read this far
    s = _stream(d, sup.pid, skip)
    s.stdin.write(grace_line(7).decode())
    s.stdin.flush()
    out, err = s.communicate(timeout=60)
    assert s.returncode == 0 and sup.wait(timeout=60) == 0, err
    assert out.startswith("up\n") and out.count("exited by itself after SIGTERM") == 2, out
    assert out.splitlines()[-1] == f"{EXIT_MARKER} 0", out
    assert not (tmp_path / "job").exists() and _carrying(f"{job}-0") == []


def test_a_stream_whose_input_ends_without_a_stop_detaches_and_the_run_goes_on(tmp_path):
    job = _job()
    d, sup = _supervised(tmp_path, job)
    try:
        wait_for(lambda: (d / "pid").exists(), 60, "the supervised workload")
        s = _stream(d, sup.pid)
        s.stdin.close()  # the controller went away
        assert s.wait(timeout=30) == 0 and EXIT_MARKER not in s.stdout.read()
        assert sup.poll() is None and (d / "out").exists() and not (d / "stop").exists()
        # A controller that comes back streams from where it was, then stops the run.
        again = _stream(d, sup.pid)
        out, _ = again.communicate(grace_line(3).decode(), timeout=60)
        assert out.splitlines()[-1] == f"{EXIT_MARKER} 0" and again.returncode == 0, out
    finally:
        sup.kill()
        sup.wait()
    assert _carrying(f"{job}-0") == []


def test_a_supervisor_that_died_without_a_status_is_one_line_exit_70(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "out").write_bytes(b"some output\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    s = _stream(d, dead.pid)  # its input open: a controller is there, waiting for the status
    assert s.wait(timeout=30) == 70
    why = "the supervisor of this run ended without an exit status\n"
    assert (s.stdout.read(), s.stderr.read()) == ("some output\n", why)
    s.stdin.close()


@pytest.mark.parametrize("value", ["/opt/own env/bin", "a\\b", "x\ny", "a\\nb", "ends\\"])
def test_a_value_read_from_stdin_is_the_launchers_byte_for_byte(value):
    from launcher.core.wire import env_block

    line = env_block([("PATH", value)])
    assert line.endswith(b"\n") and node_start.unescape(line[:-1].decode()) == value


def test_a_run_directory_gone_under_the_stream_is_one_line_exit_70(tmp_path):
    s = _stream(tmp_path / "gone", os.getpid())
    out, err = s.communicate("", timeout=30)
    assert s.returncode == 70 and out == "", err
    assert err.startswith(f"cannot read the run's output in {tmp_path / 'gone'}: ") and err.count("\n") == 1, err
