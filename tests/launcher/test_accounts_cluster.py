"""A cluster two people share (tests/simcluster.py, `bare=True, accounts=...`): two accounts log in
to every bare node as themselves, as OS Login's do, with homes of mode 0755 (Debian's default)
and a local SSD of mode 1777 (as the startup script leaves it). Each runs the launcher from a
machine of its own (its own client HOME). What one account's launches keep on a node is
unreadable to the other; a cache the other planted on the SSD is never used; a launch onto nodes
the other's job holds is refused naming that job, or waits for it with --wait; `launch jobs
--all` shows the other's job and `launch stop` of it is refused; the local checkpoint tier's
inventory and removal never touch a step the other made look like one's own. One cluster for the
module."""

from __future__ import annotations

import io
import os
import pwd
import re
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from gpufleet.contracts import HOLDS_DIR
from gpufleet.replica import python_argv
from tests.support import LAUNCH, LAUNCH_POLL_S, REPO, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

A, B = "gfu1", "gfu2"
N = 2


@pytest.fixture(scope="module")
def c(bare_cluster):
    return bare_cluster(N, accounts=(A, B))


def client(tmp_path: Path, who: str) -> dict[str, str]:
    home = tmp_path / f"client-{who}"
    home.mkdir(exist_ok=True)
    return {**{k: v for k, v in os.environ.items() if k != "GPUFLEET_STATE_DIR"}, "HOME": str(home)}


def argv(c, tmp_path: Path, who: str, command: str, *args: str) -> list[str]:
    source = ["--hostfile", str(c.hostfile), *c.account_flags(who), "--runs-dir", str(tmp_path / f"runs-{who}")]
    return [LAUNCH, command, *source, *args]


def run_as(c, tmp_path: Path, who: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv(c, tmp_path, who, *args), capture_output=True, text=True, env=client(tmp_path, who), timeout=timeout
    )


def start_as(c, tmp_path: Path, who: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """`launch ARGS` as `who` in the background; its output (stdout and stderr) goes to the path."""
    log = tmp_path / f"{who}-{args[0]}-{len(list(tmp_path.glob('*.out')))}.out"
    with open(log, "w") as out:
        p = subprocess.Popen(
            argv(c, tmp_path, who, *args), stdout=out, stderr=subprocess.STDOUT, text=True, env=client(tmp_path, who)
        )
    return p, log


def on_node(c, i: int, who: str, script: str) -> subprocess.CompletedProcess:
    """`script` on node i as account `who` (inside the node: its /home, /tmp and local SSD)."""
    return c.exec(i, ["runuser", "-u", who, "--", "bash", "-c", script])


def holds_of(c, who: str) -> list[list[str]]:
    """Each node's holds of account `who` (the registry the node's startup made: /run/gpufleet-holds)."""
    uid = pwd.getpwnam(who).pw_uid
    listed = [c.exec(i, ["ls", HOLDS_DIR]).stdout.split() for i in range(N)]
    return [sorted(name for name in names if name.startswith(f"gpufleet-hold.{uid}.")) for names in listed]


def test_nothing_one_account_keeps_on_a_node_can_be_read_by_the_other_and_a_planted_cache_is_never_used(c, tmp_path):
    uid = pwd.getpwnam(A).pw_uid
    # B plants caches for A before A's first launch: the shared one an older startup script made,
    # and A's own per-account name on node 1's SSD, open to all, with an entry in it.
    for i in range(N):
        assert on_node(c, i, B, "mkdir -m 777 /mnt/localssd/uv-cache").returncode == 0
    planted = f"/mnt/localssd/gpufleet-{uid}"
    assert on_node(c, 1, B, f"mkdir -m 777 {planted} && echo evil > {planted}/entry").returncode == 0
    project = tmp_path / "project"
    project.mkdir()
    (project / "secret.env").write_text("TOKEN=mine\n")
    (project / "secret.env").chmod(0o600)
    (project / "requirements.txt").write_text("six==1.16.0\n")
    (project / "show.py").write_text("import six, sys; print('six', six.__version__, sys.prefix)\n")
    index = ["--index-url", c.package_index]
    r = run_as(c, tmp_path, A, "exec", *index, "--sync", str(project), "--", "python", "show.py", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("six 1.16.0 /home/gfu1/.gpufleet/envs/") == N, r.stdout
    assert f"not using the local SSD's cache: {planted} belongs to uid {pwd.getpwnam(B).pw_uid}" in r.stderr
    # A detached job too: its record (~/.gpufleet/jobs) and its runs' output (node-runs).
    r = run_as(c, tmp_path, A, "exec", "--detach", *index, "--sync", str(project), "--", "python", "show.py")
    assert r.returncode == 0 and r.stdout.startswith("job "), r.stdout + r.stderr
    job = r.stdout.split()[1]

    def ended() -> bool:
        listed = run_as(c, tmp_path, A, "jobs", "--json").stdout
        return re.search(rf'"id": "{job}".*"state": "SUCCEEDED"', listed) is not None

    wait_for(ended, 300, f"job {job} SUCCEEDED", interval=LAUNCH_POLL_S)
    # Node 0 kept A's cache on its SSD, in A's own directory; node 1 in A's home. Nothing of A's
    # is in what B planted.
    assert on_node(c, 0, A, f"stat -c %U:%a {planted}").stdout.strip() == f"{A}:700"
    for i in range(N):
        mine = on_node(c, i, "root", f"find /mnt/localssd/uv-cache {planted if i else ''} -user {A}")
        assert mine.stdout == "", mine.stdout
    assert on_node(c, 1, A, "ls ~/.gpufleet/uv-cache").returncode == 0
    # What B can read or write of A's on every node: A's home itself (its own 0755), nothing of gpufleet's.
    for i in range(N):
        readable = on_node(c, i, B, f"find /home/{A} /tmp /mnt/localssd /run -user {A} -readable 2>/dev/null")
        assert readable.stdout.split() == [f"/home/{A}"], readable.stdout
        writable = on_node(c, i, B, f"find /home/{A} /tmp /mnt/localssd /run -user {A} -writable 2>/dev/null")
        assert writable.stdout == "", writable.stdout
        assert "Permission denied" in on_node(c, i, B, f"cat /home/{A}/.gpufleet/work/*/secret.env").stderr
    # The local checkpoint tier: a step B makes look complete in the SSD directory it planted is
    # never one of A's (the controller's inventory, on node 1), and A's `forget` leaves it alone;
    # on node 0, where that directory is A's own, A's step is listed and then removed.
    step = "own/step_00000040/rank_00001"
    fake = f"{planted}/checkpoints/job1/{step}"
    assert on_node(c, 1, B, f"mkdir -p {fake} && echo '{{}}' > {fake}/MANIFEST.json").returncode == 0
    mine = f"/mnt/localssd/gpufleet-{uid}/checkpoints/job1/{step}"
    assert on_node(c, 0, A, f"mkdir -p {mine} && echo '{{}}' > {mine}/MANIFEST.json").returncode == 0
    assert replica_as(c, 1, A, "inventory", "job1") == '{"own": {}, "peer": {}}'
    assert replica_as(c, 1, A, "forget", "job1") == "[]"
    assert on_node(c, 1, B, f"test -f {fake}/MANIFEST.json").returncode == 0
    assert replica_as(c, 0, A, "inventory", "job1") == '{"own": {"1": [40]}, "peer": {}}'
    assert replica_as(c, 0, A, "forget", "job1") == "[40]"
    assert replica_as(c, 0, A, "inventory", "job1") == '{"own": {}, "peer": {}}'


def replica_as(c, i: int, who: str, *args: str) -> str:
    """gpufleet.replica's command ARGS on node i as `who`, run as the controller runs it
    (launcher.jobs.realign), from gpufleet's package copied into the account's home; its stdout."""
    pack = io.BytesIO()
    with tarfile.open(fileobj=pack, mode="w") as tar:
        tar.add(REPO / "gpufleet", "gpufleet", filter=lambda t: None if "__pycache__" in t.name else t)
    put = c.exec(
        i,
        ["runuser", "-u", who, "--", "bash", "-c", "mkdir -p ~/code && tar -x -C ~/code"],
        input=pack.getvalue(),
        text=False,
    )
    assert put.returncode == 0, put.stderr
    r = c.exec(i, ["runuser", "-u", who, "--", *python_argv(f"/home/{who}/code"), *args])
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


def test_a_launch_onto_nodes_another_accounts_job_holds_is_refused_naming_it_and_wait_waits_for_them(c, tmp_path):
    # A's job runs until the test lets it end: a file in each node's own /tmp.
    release = "/tmp/release-gfu1"
    work = f"while [ ! -e {release} ]; do sleep 0.2; done; echo job-ended $(date +%s.%N)"
    held, log = start_as(c, tmp_path, A, "exec", "--", "sh", "-c", work)
    try:
        wait_for(lambda: all(holds_of(c, A)), 120, f"{A}'s job to hold every node")
        (name,) = holds_of(c, A)[0]
        job = name.rsplit(".", 1)[1]
        r = run_as(c, tmp_path, B, "exec", "--", "echo", "ran")
        assert r.returncode == 2 and "ran" not in r.stdout, r.stdout + r.stderr
        line = r.stderr.strip().splitlines()[-1]
        labels = ", ".join(f"node {i} ({a})" for i, a in enumerate(c.addresses))
        assert re.fullmatch(
            rf"error: {A}'s job {job}, since \S+ \S+ UTC, holds {re.escape(labels)}; nothing was started\. "
            r"Add --wait to wait for the nodes",
            line,
        ), r.stderr
        assert holds_of(c, B) == [[]] * N  # B's refused launch left no hold
        # Every account's jobs, attached ones too; stopping A's is A's alone.
        listed = run_as(c, tmp_path, B, "jobs", "--all", "--json")
        assert f'"held": {{"account": "{A}", "id": "{job}"' in listed.stdout, listed.stdout + listed.stderr
        r = run_as(c, tmp_path, B, "stop", job)
        assert r.returncode == 2 and f"job {job} is {A}'s" in r.stderr and f"only {A} can stop it" in r.stderr, r.stderr
        waiting, waited = start_as(c, tmp_path, B, "exec", "--wait", "--", "sh", "-c", "echo job-began $(date +%s.%N)")
        wait_for(lambda: "waiting for the nodes" in waited.read_text(), 120, "B's progress line")
        assert f"{A}'s job {job}" in waited.read_text() and waiting.poll() is None
    finally:
        for i in range(N):
            c.node_path(i, release).touch()
        held.wait(timeout=120)
    assert held.returncode == 0, log.read_text()
    assert waiting.wait(timeout=120) == 0, waited.read_text()
    ended = max(float(t) for t in re.findall(r"job-ended (\S+)", log.read_text()))
    started = [float(t) for t in re.findall(r"job-began (\S+)", waited.read_text())]
    assert len(started) == N and min(started) > ended, (log.read_text(), waited.read_text())


def test_two_accounts_launching_at_once_take_turns(c, tmp_path):
    """Both with --wait, onto the same nodes at the same moment: both run, never at once."""
    work = "echo job-from $(date +%s.%N); sleep 2; echo job-to $(date +%s.%N)"
    results: dict[str, subprocess.CompletedProcess] = {}
    go = threading.Barrier(2)

    def one(who: str) -> None:
        go.wait()
        results[who] = run_as(c, tmp_path, who, "exec", "--wait", "--", "sh", "-c", work)

    threads = [threading.Thread(target=one, args=(who,)) for who in (A, B)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = {}
    for who, r in results.items():
        assert r.returncode == 0, r.stdout + r.stderr
        begin, end = re.findall(r"job-from (\S+)", r.stdout), re.findall(r"job-to (\S+)", r.stdout)
        assert len(begin) == len(end) == N, r.stdout
        spans[who] = (min(map(float, begin)), max(map(float, end)))
    (a0, a1), (b0, b1) = spans[A], spans[B]
    assert a1 < b0 or b1 < a0, spans


def test_each_accounts_launch_tree_keeps_its_keys_and_nonces_its_own(c, tmp_path):
    """--fanout: each account's launch keys, nonces and relay files on a node are its own (its
    private ~/.gpufleet), and neither account can read the other's; both launches go down the tree."""
    for who in (A, B):
        r = run_as(c, tmp_path, who, "exec", "--fanout", "1", "--", "sh", "-c", 'echo "tree as $(id -un)"')
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count(f"tree as {who}") == N, r.stdout
        # Under --output failures every node keeps its lines in the account's ~/.gpufleet/logs.
        r = run_as(c, tmp_path, who, "exec", "--fanout", "1", "--output", "failures", "--", "echo", f"kept by {who}")
        assert r.returncode == 0 and f"kept by {who}" not in r.stdout, r.stdout + r.stderr
    for i in range(N):
        for me, other in ((A, B), (B, A)):
            keys = on_node(c, i, me, "ls ~/.gpufleet/tree ~/.gpufleet/tree/seen | wc -l").stdout.strip()
            assert int(keys) >= 2, keys  # this account's key and at least one nonce
            readable = on_node(c, i, other, f"find /home/{me}/.gpufleet -readable 2>/dev/null").stdout.split()
            assert readable == [], readable
            stat = on_node(c, i, me, "stat -c '%a %U' ~/.gpufleet/tree ~/.gpufleet/tree/*--*").stdout.split("\n")
            assert all(line.split() in (["700", me], ["600", me]) for line in stat if line), stat
            logs = on_node(c, i, me, "stat -c '%a %U' ~/.gpufleet/logs ~/.gpufleet/logs/* ~/.gpufleet/logs/*/*")
            assert logs.stdout.count(f" {me}") >= 3, logs.stdout + logs.stderr
            assert all(line.split() in (["700", me], ["600", me]) for line in logs.stdout.splitlines()), logs.stdout
            kept = on_node(c, i, me, "cat ~/.gpufleet/logs/*/node-*.log").stdout
            assert f"kept by {me}" in kept and f"kept by {other}" not in kept, kept
