"""A detached job's node-side run half (launcher.core.supervise), run here with bash as the node's
login shell would, without SSH: it outlives its session, streams from any offset, stops on a
request or with no controller for --controller-grace, and passes shellcheck. Also: the job record
stays readable when its writer is killed mid-write."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.program import NodeProgram, attach_commands
from launcher.core.supervise import ORPHAN_STOP, node_run_dir
from launcher.core.types import Cluster, LaunchConfig, Node, Workload
from launcher.core.wire import CHECKED_MARKER, EXIT_MARKER
from launcher.jobs.adopt import stop_script
from launcher.jobs.record import restart_script

C = Cluster("c", (Node(0, "127.0.0.1", "127.0.0.1"),))
# A workload that prints a numbered line every 0.1 s for 60 s, and says when SIGTERM came.
TICKER = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(0)))\n"
    "for i in range(600):\n"
    "    print(f'line {i}', flush=True); time.sleep(0.1)\n"
)


def _config(tmp_path: Path, grace_s: int = 600, **kw) -> LaunchConfig:
    kw.setdefault("job_id", f"unit-{tmp_path.name}")
    return LaunchConfig(Workload("exec", ("x",)), controller_grace_s=grace_s, stop_grace_s=2.0, **kw)


class Session:
    """A node-side program running here as an SSH session would: `go` once checked."""

    def __init__(self, script: str, home: Path):
        self.p = subprocess.Popen(
            ["bash", "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "HOME": str(home)},
        )
        assert self.p.stdout.readline().strip() == CHECKED_MARKER.encode()
        self.tell("go")

    def tell(self, line: str) -> None:
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()

    def lines(self, n: int) -> list[bytes]:
        return [self.p.stdout.readline() for _ in range(n)]

    def hang_up(self) -> int:
        self.p.stdin.close()
        return self.p.wait(timeout=30)


def _run_dir(home: Path, config: LaunchConfig) -> Path:
    return home / node_run_dir(config.job_id, config.attempt, 0).removeprefix('"$HOME"/')


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _group(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (the supervisor's session leads its own group)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(stat.parent.name))
    return out


def test_end_of_input_detaches_and_an_attach_resumes_at_the_byte_it_had_read_then_a_stop_ends_it(tmp_path):
    config = _config(tmp_path)
    first = Session(NodeProgram(C, C.nodes[0], config, {}, [sys.executable, "-c", TICKER]).render(), tmp_path)
    got = first.lines(5)
    assert got == [f"line {i}\n".encode() for i in range(5)]
    # The controller went away: its session ends without an exit status, the workload goes on.
    assert first.hang_up() == 0 and EXIT_MARKER.encode() not in first.p.stdout.read()
    d = _run_dir(tmp_path, config)
    assert d.stat().st_mode & 0o777 == 0o700
    sup = int((d / "pid").read_text().split()[0])
    time.sleep(1.0)
    assert not _gone(sup) and b"line 12" in (d / "out").read_bytes()
    # Re-adopted from the bytes the first session read: the next line, none twice, none lost.
    second = Session(attach_commands(C, config, {0: sum(map(len, got))})[0], tmp_path)
    assert second.lines(3) == [f"line {i}\n".encode() for i in range(5, 8)]
    # A stop is a line of its own, and the end of input right after it (as the controller sends
    # it) does not cut the stream: the supervisor stops the workload with the grace it names.
    second.tell("term 10 2")
    second.p.stdin.close()
    rest = second.p.stdout.read().decode()
    assert second.p.wait(timeout=30) == 0
    assert rest.endswith(f"got SIGTERM\n{EXIT_MARKER} 0\n"), rest[-300:]
    # Once the stream has its exit status, nothing of the supervisor's is left (its watcher's
    # sleep included): the run's directory is gone too.
    assert not d.exists() and _gone(sup) and _group(sup) == []


def test_with_no_session_attached_for_the_grace_the_supervisor_stops_the_workload_itself(tmp_path):
    config = _config(tmp_path, grace_s=2)
    s = Session(NodeProgram(C, C.nodes[0], config, {}, [sys.executable, "-c", TICKER]).render(), tmp_path)
    s.lines(2)
    t0 = time.monotonic()
    s.hang_up()
    d = _run_dir(tmp_path, config)
    sup = int((d / "pid").read_text().split()[0])
    deadline = time.monotonic() + 60
    while not (d / "rc").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (d / "rc").read_text().strip() == "0" and time.monotonic() - t0 >= 2
    out = (d / "out").read_text()
    assert f"{ORPHAN_STOP} 2 s (--controller-grace): SIGTERM to every rank, SIGKILL after 2 s" in out, out
    assert out.endswith("got SIGTERM\n"), out[-200:]
    deadline = time.monotonic() + 10
    while not _gone(sup) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(sup)
    # A controller that comes back now reads the rest and the exit status, and the copy goes.
    late = Session(attach_commands(C, config, {0: 0})[0], tmp_path)
    text = late.p.stdout.read().decode()
    assert text.startswith("line 0\n") and text.endswith(f"got SIGTERM\n{EXIT_MARKER} 0\n") and not d.exists()


def test_a_workload_that_ends_by_itself_leaves_nothing_once_its_exit_status_is_streamed(tmp_path):
    config = _config(tmp_path)
    s = Session(NodeProgram(C, C.nodes[0], config, {}, ["sh", "-c", "sleep 1.5; echo done; exit 3"]).render(), tmp_path)
    pid = _run_dir(tmp_path, config) / "pid"
    deadline = time.monotonic() + 30
    while not pid.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    sup = int(pid.read_text().split()[0])
    assert s.p.stdout.read().decode() == f"done\n{EXIT_MARKER} 3\n" and s.p.wait(timeout=30) == 3
    assert _group(sup) == [] and not _run_dir(tmp_path, config).exists()


def test_a_session_that_stays_attached_keeps_the_workload_past_the_grace(tmp_path):
    config = _config(tmp_path, grace_s=1)
    s = Session(NodeProgram(C, C.nodes[0], config, {}, [sys.executable, "-c", TICKER]).render(), tmp_path)
    lines = s.lines(40)  # 4 s of output, 4 times the grace
    assert lines[-1] == b"line 39\n" and ORPHAN_STOP.encode() not in b"".join(lines)
    s.tell("term 10 2")
    assert s.p.stdout.read().decode().endswith(f"{EXIT_MARKER} 0\n")


def test_attaching_where_the_run_is_not_there_is_one_line_and_exit_3(tmp_path):
    config = _config(tmp_path, job_id="20260101-000000-aaaaaa")
    r = subprocess.run(
        ["bash", "-c", attach_commands(C, config, {0: 0})[0]],
        input=b"go\n",
        capture_output=True,
        env={**os.environ, "HOME": str(tmp_path)},
        timeout=30,
    )
    (line,) = r.stderr.decode().splitlines()
    assert r.returncode == 3 and r.stdout == b"" and "no run of job 20260101-000000-aaaaaa (attempt 0)" in line


def test_stop_script_stops_a_run_nobody_streams_and_removes_it(tmp_path):
    config = _config(tmp_path, job_id="20260101-000000-bbbbbb")
    s = Session(NodeProgram(C, C.nodes[0], config, {}, [sys.executable, "-c", TICKER]).render(), tmp_path)
    s.lines(1)
    s.hang_up()
    d = _run_dir(tmp_path, config)
    sup = int((d / "pid").read_text().split()[0])
    r = subprocess.run(
        ["bash", "-c", stop_script(config.job_id, 0, 0, 2.0, 10)],
        env={**os.environ, "HOME": str(tmp_path)},
        timeout=90,
    )
    assert r.returncode == 0 and not d.exists()
    deadline = time.monotonic() + 10
    while not _gone(sup) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(sup)


def test_an_attached_launch_writes_no_file_on_the_node_and_end_of_input_stops_it(tmp_path):
    attached = LaunchConfig(Workload("exec", ("x",)), job_id=f"unit-{tmp_path.name}", stop_grace_s=2.0)
    s = Session(NodeProgram(C, C.nodes[0], attached, {}, [sys.executable, "-c", TICKER]).render(), tmp_path)
    s.lines(2)
    s.p.stdin.close()
    assert EXIT_MARKER.encode() in s.p.stdout.read() and s.p.wait(timeout=30) == 0
    # No run directory (the account's local directory, for checkpoints and caches, is another's).
    assert not (tmp_path / ".gpufleet" / "node-runs").exists()


@pytest.mark.parametrize("part", ["run", "attached", "attach", "stop", "restart"])
def test_the_node_side_programs_pass_shellcheck(tmp_path, part):
    """The bash that reaches a node (a launch's program and a re-adopting controller's attach are
    one line that starts launcher.core.node_run's Python; the stop and the restart are bash)."""
    assert shutil.which("shellcheck"), "shellcheck is not installed (.ci/run installs it)"
    config = _config(tmp_path, job_id="20260101-000000-cccccc")
    attached = LaunchConfig(Workload("exec", ("x",)), job_id=config.job_id)
    script = {
        "run": lambda: NodeProgram(
            C, C.nodes[0], config, {}, ["python3", "-c", "print(1)"], watch_preemption=True
        ).render(),
        "attached": lambda: NodeProgram(C, C.nodes[0], attached, {}, ["true"], watch_preemption=True).render(),
        "attach": lambda: attach_commands(C, config, {0: 12})[0],
        "stop": lambda: stop_script(config.job_id, 0, 0, 2.0, 10),
        "restart": lambda: restart_script([config.job_id]),
    }[part]()
    (tmp_path / "node.sh").write_text("#!/bin/bash\n" + script + "\n")
    # SC2086: `set -- $L`, `$W`, `$P` are split on purpose (a line's words; pids). SC2016: the
    # single-quoted programs expand on the node, not here. SC2013: `for f in $(grep -l ...)` reads
    # /proc/PID/environ paths, which hold no blank.
    r = subprocess.run(
        ["shellcheck", "-s", "bash", "-e", "SC2086,SC2016,SC2013", str(tmp_path / "node.sh")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout


def test_the_record_stays_readable_when_its_writer_is_killed_mid_write(tmp_path):
    """The controller writes its record through gpufleet.atomic: killed at any moment (here: 20
    times, at random points of writes of a ~1 MB record), it leaves the last whole record."""
    from launcher.cluster.key import controller_ssh
    from launcher.jobs.record import request_json

    jobdir = tmp_path / "jobs" / "20260101-000000-dddddd"
    jobdir.mkdir(parents=True)
    config = LaunchConfig(Workload("exec", ("true",)), job_id=jobdir.name)
    request = request_json(C, config, controller_ssh("root", 22, "c-abc", "kh"))
    (jobdir / "request.json").write_text(json.dumps(request))
    writer = (
        "import sys\n"
        "from launcher.jobs.controller import Controller\n"
        "c = Controller(__import__('pathlib').Path(sys.argv[1]))\n"
        "c.record.marks = [{'at': float(i), 'kind': 'progress', 'line': 'x' * 200} for i in range(4000)]\n"
        "i = 0\n"
        "while True:\n"
        "    c.record.exit = i; c.save(); i += 1\n"
        "    if i == 1: print('saved', flush=True)\n"
    )
    rng = random.Random(7)
    for _ in range(20):
        p = subprocess.Popen([sys.executable, "-c", writer, str(jobdir)], stdout=subprocess.PIPE, cwd=Path.cwd())
        assert p.stdout.readline() == b"saved\n"
        time.sleep(rng.uniform(0.0, 0.2))
        p.send_signal(signal.SIGKILL)
        p.wait()
        record = json.loads((jobdir / "state.json").read_text())
        assert record["id"] == jobdir.name and len(record["marks"]) == 4000


def test_a_job_whose_controller_died_keeps_its_nodes_from_the_queue_while_they_wait_for_one(tmp_path):
    """Its nodes still run it for --controller-grace: a later job on them waits (PENDING) meanwhile,
    and goes once the grace has run out."""
    from launcher.cluster.key import controller_ssh
    from launcher.jobs.controller import Controller
    from launcher.jobs.record import JobRecord, JobState, request_json

    jobs = tmp_path / "jobs"
    orphan = jobs / "20260101-000000-eeeeee"
    orphan.mkdir(parents=True)
    dead = JobRecord(orphan.name, JobState.RUNNING, "exec true", ["127.0.0.1"], 1.0, pid=999999, controller_grace_s=60)
    (orphan / "state.json").write_text(json.dumps(dead.to_json()))
    (orphan / "heartbeat").touch()
    mine = jobs / "20260101-000001-ffffff"
    mine.mkdir()
    config = LaunchConfig(Workload("exec", ("true",)), job_id=mine.name)
    (mine / "request.json").write_text(json.dumps(request_json(C, config, controller_ssh("root", 22, "c", "kh"))))
    assert [r.id for r in Controller(mine).ahead()] == [orphan.name]
    os.utime(orphan / "heartbeat", (0, time.time() - 61))
    assert Controller(mine).ahead() == []


def test_adopt_all_starts_the_controllers_of_live_jobs_whose_controller_is_gone_only(tmp_path):
    """`python -m launcher.jobs.controller --adopt-all` (a controller host's boot): each live job
    with a dead controller has its start line run; an ended job, or one whose controller lives, not."""
    from launcher.jobs.record import JobRecord, JobState, process_start

    jobs = tmp_path / "jobs"
    me = os.getpid()
    cases = {
        "20260101-000000-aaaaaa": (JobState.RUNNING, 999999, ""),  # dead: started again
        "20260101-000001-bbbbbb": (JobState.SUCCEEDED, 999999, ""),  # ended
        "20260101-000002-cccccc": (JobState.RUNNING, me, process_start(me)),  # alive (this process)
    }
    for job, (state, pid, start) in cases.items():
        (jobs / job).mkdir(parents=True)
        record = JobRecord(job, state, "exec true", ["h"], 1.0, pid=pid, pid_start=start)
        (jobs / job / "state.json").write_text(json.dumps(record.to_json()))
        (jobs / job / "controller.sh").write_text(f"touch {tmp_path}/started-{job}; echo 1\n")
    r = subprocess.run(
        [sys.executable, "-m", "launcher.jobs.controller", "--adopt-all", str(jobs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "job 20260101-000000-aaaaaa: its controller had died; started it again to re-adopt the job"
    ]
    assert sorted(p.name for p in tmp_path.glob("started-*")) == ["started-20260101-000000-aaaaaa"]
