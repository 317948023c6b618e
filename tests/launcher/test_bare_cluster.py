"""Every launch path on bare nodes (tests/simcluster.py, `bare=True`): nodes that have only the
system python3 and the cluster's package index, as `pulumi up` leaves them. Nothing is installed
on them by hand: gpufleet sends its own code and your --sync directory, and builds each job's
environment with uv (launcher.code). The nodes are the session's shared bare cluster
(tests/conftest.py `bare_nodes`), so an environment built by one test is there for the next, as on
a real fleet; each test asserts what it did against what the nodes held before it, so none
depends on another having run first."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from gpufleet.contracts import UV
from launcher.code.pyenv import EnvSpec, workloads_requirements
from launcher.code.snapshot import code_snapshot, take_snapshot
from launcher.code.tree import AGENT_SHA
from tests.launcher.test_jobs_cluster import client_env, detach, launch, wait_state
from tests.launcher.test_recover_own_cluster import snapshot_epochs
from tests.simcluster import _environ
from tests.support import BARE_GROUP, BARE_NODES, LAUNCH, REPO, TRAIN, source_args, wait_for, workers

pytestmark = [pytest.mark.cluster, BARE_GROUP, pytest.mark.timeout(900)]

N = BARE_NODES
ONE = ["--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1"]
FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
SENT = re.compile(r"sent (\d+) files \(([^)]*)\) to node 0 \([^)]*\); it passed content on to (\d+) other nodes?")


@pytest.fixture
def c(bare_nodes):
    return bare_nodes


def src(c, tmp_path: Path) -> list[str]:
    return [*source_args(c, tmp_path), "--index-url", c.package_index]


def lacking_workloads_env(c) -> list[int]:
    """The nodes without launch train's environment (gpufleet's workloads requirements from the
    cluster's index): the ones a train or nccl-tests launch must build it on."""
    key = EnvSpec("requirements.txt", {"requirements.txt": workloads_requirements()}, index_url=c.package_index).key
    return [i for i in range(N) if not c.node_path(i, f"/root/.gpufleet/envs/{key}/.gpufleet-complete").exists()]


def lacking_code(c) -> list[int]:
    """The nodes without gpufleet's own code (its snapshot, by hash)."""
    snap = code_snapshot()
    return [i for i in range(N) if not c.node_path(i, f"/root/.gpufleet/snap/{snap.hash}").is_dir()]


def work_dirs(c) -> set[str]:
    """The job directories (--sync snapshots) on node 0."""
    d = c.node_path(0, "/root/.gpufleet/work")
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's directory: a plain DDP script (examples/ddp_snapshot.py) started through a
    wrapper that says which code it runs, its own requirements.txt, things to leave behind."""
    d = tmp_path / "project"
    d.mkdir()
    shutil.copy(REPO / "examples" / "ddp_snapshot.py", d / "ddp_snapshot.py")
    (d / "main.py").write_text(
        textwrap.dedent(
            """\
            import os, runpy, sys
            import six
            print(f"code {os.environ['GPUFLEET_CODE']} six {six.__version__} cwd {os.getcwd()}", flush=True)
            sys.argv = ["ddp_snapshot.py", *sys.argv[1:]]
            runpy.run_path("ddp_snapshot.py", run_name="__main__")
            """
        )
    )
    # torch.distributed.broadcast_object_list needs numpy, which torch does not require.
    (d / "requirements.txt").write_text("torch\nnumpy\nsix==1.16.0\n")
    (d / ".gitignore").write_text("data/\n*.pt\n")
    (d / ".gpufleetignore").write_text("notes.md\n")
    (d / "data").mkdir()
    (d / "data" / "big.bin").write_bytes(b"x" * 1000)
    (d / "notes.md").write_text("mine\n")
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return d


def test_train_on_bare_nodes_brings_gpufleet_and_its_environment_once(c, tmp_path):
    lacking_env, lacking = lacking_workloads_env(c), lacking_code(c)
    r = launch(tmp_path, "train", *src(c, tmp_path), *ONE, *TRAIN, "--steps", "2", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: 2 steps" in r.stdout
    # What a node lacked, it got: the code from node 0 (sent once from here), the environment built.
    sent = SENT.search(r.stderr)
    if lacking:
        assert sent and int(sent.group(3)) == len(set(lacking) - {0}), r.stderr
    else:
        assert sent is None, r.stderr
    assert r.stderr.count("building environment") == len(lacking_env), r.stderr
    assert lacking_workloads_env(c) == [] and lacking_code(c) == []
    # The same content is on every node, by its hash; a second launch sends and builds nothing.
    snap = code_snapshot()
    train = (REPO / "workloads" / "train.py").read_bytes()
    assert all(
        c.node_path(i, f"/root/.gpufleet/snap/{snap.hash}/workloads/train.py").read_bytes() == train for i in range(N)
    )
    # It checkpoints to a directory every node shares (a Filestore's place: /var/tmp, of which the
    # nodes have no copy of their own), and a third launch resumes from it: the checkpoint's
    # metadata is read through the restore's allowlist (workloads.checkpoint.safe) on the nodes'
    # own Python, whose pickles differ from this machine's.
    shared = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gpufleet-bare-ckpt-"))
    try:
        ck = ["--checkpoint-dir", str(shared), "--checkpoint-every", "2"]
        again = launch(tmp_path, "train", *src(c, tmp_path), *ONE, *TRAIN, "--steps", "2", *ck, timeout=600)
        assert again.returncode == 0 and "done: 2 steps" in again.stdout, again.stderr[-3000:]
        assert "sent " not in again.stderr and "building environment" not in again.stderr, again.stderr
        on = launch(tmp_path, "train", *src(c, tmp_path), *ONE, *TRAIN, "--steps", "4", *ck, "--resume", timeout=600)
        assert on.returncode == 0 and "done: 4 steps" in on.stdout, on.stdout[-3000:] + on.stderr[-3000:]
        assert re.search(r"resumed from \S+ at step 2 .*restored step 2 from", on.stdout), on.stdout[-3000:]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_nccl_tests_on_bare_nodes_use_the_same_environment(c, tmp_path):
    lacking = lacking_workloads_env(c)
    r = launch(tmp_path, "nccl-tests", *src(c, tmp_path), *ONE, "-b", "1K", "-e", "4K", "--ops", "all_reduce")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Avg bus bandwidth" in r.stdout
    # launch train's environment (the same requirements, the same key): built only where missing.
    assert r.stderr.count("building environment") == len(lacking), r.stderr
    assert lacking_workloads_env(c) == []


def test_train_with_sync_runs_its_ranks_in_the_snapshot_with_gpufleet_code_set(c, tmp_path, project):
    """launch train --sync DIR: the ranks run gpufleet's workloads.train in the job's own copy of
    DIR (a relative --save-params lands there) with GPUFLEET_CODE the snapshot's hash."""
    snap = take_snapshot(project)
    before = work_dirs(c)
    args = [*src(c, tmp_path), *ONE, "--sync", str(project), *TRAIN, "--steps", "40", "--save-params", "params.pt"]
    with open(tmp_path / "train.log", "w") as log:
        p = subprocess.Popen(
            [LAUNCH, "train", *args], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=client_env(tmp_path)
        )
        try:
            # Each node's rank, while it trains: its environment as torchrun gave it.
            seen: dict[int, bytes] = {}

            def ranks_seen() -> bool:
                for i in range(N):
                    for pid in workers(c, i).values():
                        seen.setdefault(i, _environ(pid))
                return len(seen) == N or p.poll() is not None

            wait_for(ranks_seen, 600, "a rank on every node", interval=0.02)
            assert p.wait(timeout=600) == 0, (tmp_path / "train.log").read_text()[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = (tmp_path / "train.log").read_text()
    assert "done: 40 steps" in out, out[-3000:]
    assert sorted(seen) == list(range(N)), out[-3000:]
    assert all(f"GPUFLEET_CODE={snap.hash}".encode() in env.split(b"\0") for env in seen.values())
    (job,) = work_dirs(c) - before
    cwd = c.node_path(0, f"/root/.gpufleet/work/{job}")
    assert (cwd / "params.pt").is_file() and (cwd / "main.py").read_text() == (project / "main.py").read_text()
    assert not (project / "params.pt").exists() and not (cwd / "data").exists()


def test_a_sync_project_with_a_uv_lock_builds_the_locked_versions(c, tmp_path):
    """A --sync directory whose uv.lock defines the environment (uv export, then install): its
    pyproject.toml asks for any six and the index has 1.17.0, the lock says 1.16.0, and 1.16.0 is
    what every node runs. Built with uv at the version gpufleet pins, which a node without uv
    pip-installs from the index by its hash (gpufleet.contracts.UV)."""
    d = tmp_path / "locked"
    shutil.copytree(REPO / "tests" / "fixtures" / "locked_project", d)
    show = "import os, six, sys; print('six', six.__version__, sys.prefix, os.environ['GPUFLEET_CODE'])"
    r = launch(tmp_path, "exec", *src(c, tmp_path), "--sync", str(d), "--", "python", "-c", show, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = re.findall(r"\[node (\d)\] six (\S+) (\S+) (\w+)", r.stdout)
    assert sorted(int(n) for n, *_ in lines) == list(range(N)), r.stdout
    (env,) = {prefix for _, _, prefix, _ in lines}
    assert {(v, code) for _, v, _, code in lines} == {("1.16.0", take_snapshot(d).hash)}, r.stdout
    assert env.startswith("/root/.gpufleet/envs/") and r.stderr.count("building environment") == N, r.stderr
    for i in range(N):
        uv = c.exec(i, ["/root/.gpufleet/uv/bin/uv", "--version"])
        assert uv.stdout.startswith(f"uv {UV['version']}"), uv.stdout + uv.stderr


def test_run_sync_runs_a_plain_ddp_script_with_its_own_requirements_in_a_directory_of_its_own(c, tmp_path, project):
    snap = take_snapshot(project)
    assert sorted(f.path for f in snap.files) == [
        ".gitignore",
        ".gpufleetignore",
        "ddp_snapshot.py",
        "main.py",
        "requirements.txt",
    ]
    r = launch(
        tmp_path, "run", *src(c, tmp_path), *ONE, "--sync", str(project), "--", "main.py", "--epochs", "2", timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = re.findall(r"\[node (\d)\] code (\w+) six ([\d.]+) cwd (\S+)", r.stdout)
    assert sorted(int(n) for n, *_ in lines) == list(range(N)), r.stdout
    assert {(code, six) for _, code, six, _ in lines} == {(snap.hash, "1.16.0")}
    (cwd,) = {cwd for *_, cwd in lines}
    job = Path(cwd).name
    assert cwd == f"/root/.gpufleet/work/{job}"
    # The script saved its snapshot next to itself (rank 0), in this job's directory only.
    assert c.node_path(0, f"{cwd}/snapshot.pt").exists() and not (project / "snapshot.pt").exists()
    assert not c.node_path(0, f"{cwd}/data").exists() and not c.node_path(0, f"{cwd}/.git").exists()
    assert not c.node_path(1, f"{cwd}/notes.md").exists()
    # One file edited: that file is all that is sent, and the next job starts from a clean copy.
    (project / "main.py").write_text((project / "main.py").read_text().replace("cwd", "dir"))
    r = launch(tmp_path, "exec", *src(c, tmp_path), "--sync", str(project), "--", "python", "-c", _LIST, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sent = SENT.search(r.stderr)
    assert sent and sent.group(1) == "1", r.stderr
    assert r.stdout.count("['.gitignore', '.gpufleetignore', 'ddp_snapshot.py', 'main.py', 'requirements.txt']") == N
    assert "building environment" not in r.stderr  # the same requirements: the environment run built


# Run by `launch exec` with the environment's python (its bin is first on PATH).
_LIST = "import os, six; print(sorted(os.listdir('.')) if six.__version__ == '1.16.0' else 'wrong six')"


def test_a_detached_recovered_job_on_bare_nodes_runs_the_code_it_started_with(c, tmp_path, project):
    job_id = detach(
        c,
        tmp_path,
        "run",
        *src(c, tmp_path)[len(source_args(c, tmp_path)) :],
        *ONE,
        "--sync",
        str(project),
        "--recover",
        "--recover-timeout",
        "2m",
        "--",
        "main.py",
        "--epochs",
        "40",
        "--save-every",
        "2",
        "--epoch-seconds",
        "0.3",
    )
    saved = c.node_path(0, f"/root/.gpufleet/work/{job_id}/snapshot.pt")
    read = lambda: saved.read_bytes() if saved.exists() else None  # noqa: E731
    wait_for(lambda: snapshot_epochs(read) >= 4, 180, "epoch 4 saved on node 0")
    started = take_snapshot(project).hash
    (project / "main.py").write_text("raise SystemExit('the edited code ran')\n")  # the laptop moves on
    c.power_off(2)
    t_gone = time.monotonic()
    wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=30)
    time.sleep(max(0.0, 10 - (time.monotonic() - t_gone)))
    c.restart_sshd(2)
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=240)
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, done
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    codes = re.findall(r"\] code (\w+) six", out)
    assert len(codes) == 2 * N and set(codes) == {started}, out[-3000:]
    assert "the edited code ran" not in out and re.search(r"resuming from the snapshot at epoch (\d+)", out), out


def test_an_index_that_cannot_be_reached_is_one_line_naming_the_node_and_the_url(c, tmp_path, project):
    url = f"http://{c.unused_address()}:8080/simple/"
    r = launch(tmp_path, "run", *source_args(c, tmp_path), "--index-url", url, "--sync", str(project), "--", "x.py")
    assert r.returncode == 2, r.stderr
    (error,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: node 0 ({c.addresses[0]}): the package index {url} cannot be reached")
    assert error.endswith("check --index-url or the stack output packageIndex (and 2 other nodes); nothing was started")
    c.assert_nothing_left()


def test_requirements_that_cannot_be_resolved_are_one_line_with_the_resolvers_reason(c, tmp_path, project):
    (project / "requirements.txt").write_text("torch\nno-such-package-gpufleet==9.9\n")
    r = launch(tmp_path, "exec", *src(c, tmp_path), "--sync", str(project), "--", "true", timeout=300)
    assert r.returncode == 2, r.stderr
    (error,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert "cannot build the environment from requirements.txt: Because no-such-package-gpufleet" in error, error
    assert error.startswith("error: node 0 (") and error.endswith("nothing was started")
    c.assert_nothing_left()


def _fresh(tmp_path: Path, name: str) -> Path:
    """A directory no node has seen (random content) and no requirements: nothing to build."""
    d = tmp_path / name
    d.mkdir()
    (d / "data.txt").write_text(f"content {os.urandom(8).hex()}\n")
    (d / "big.bin").write_bytes(os.urandom(3 << 20))  # three chunks: passed on as they arrive
    return d


def relay_public(tmp_path: Path) -> str:
    """The base64 of the relay key this test's launching machine (its own HOME) made: its
    authorized_keys entry, among those of every other machine (test) that launched as root."""
    (pub,) = (tmp_path / "client").glob(".cache/gpufleet/*/relay_ed25519.pub")
    return pub.read_text().split()[1]


def test_a_chain_passes_content_node_to_node_and_leaves_no_key_behind(c, tmp_path):
    d = _fresh(tmp_path, "chain")
    want = (d / "data.txt").read_text().strip()
    chain = ["--sync", str(d), "--sync-fanout", "1"]
    r = launch(tmp_path, "exec", *source_args(c, tmp_path), *chain, "--", "cat", "data.txt")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(want) == N, r.stdout
    sent = SENT.search(r.stderr)
    assert sent and sent.group(1) == "2" and int(sent.group(3)) == N - 1, r.stderr
    assert f"({N - 1} levels deep)" in r.stderr, r.stderr  # 0 -> 1 -> 2
    blob = (d / "big.bin").read_bytes()
    for i in range(N):
        assert c.node_path(i, f"/root/.gpufleet/objects/{hashlib.sha256(blob).hexdigest()}").read_bytes() == blob
        relay = c.node_path(i, "/root/.gpufleet/relay")
        assert not relay.exists() or not list(relay.iterdir()), f"node {i} kept {list(relay.iterdir())}"
    # Node 1 passed content on with the relay key, never the cluster key.
    assert not c.node_path(1, "/root/.gpufleet/clusters").exists()
    keys = c.node_path(2, "/root/.ssh/authorized_keys").read_text()
    (entry,) = [line for line in keys.splitlines() if relay_public(tmp_path) in line]
    # Its forced command: the agent through the bootstrap that checks its copy (launcher.code.tree).
    assert entry.startswith(f'from="{",".join(sorted(c.addresses))}",restrict,command="exec python3 -I -S -c \\"')
    assert f"{AGENT_SHA} relay " in entry
    c.assert_nothing_left()


def test_a_node_that_cannot_pass_content_on_does_not_starve_the_one_below_it(c, tmp_path):
    """Node 1, in the middle of the chain 0 -> 1 -> 2, cannot reach node 2 (a route that
    refuses it); node 2 still gets its content, from node 0 directly, and the launch says so."""
    d = _fresh(tmp_path, "cut")
    want = (d / "data.txt").read_text().strip()
    route = ["ip", "route", "add", "prohibit", f"{c.addresses[2]}/32"]
    assert c.exec(1, route).returncode == 0
    try:
        chain = ["--sync", str(d), "--sync-fanout", "1"]
        r = launch(tmp_path, "exec", *source_args(c, tmp_path), *chain, "--", "cat", "data.txt")
    finally:
        c.exec(1, ["ip", "route", "del", "prohibit", f"{c.addresses[2]}/32"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(want) == N, r.stdout
    (line,) = [line for line in r.stderr.splitlines() if "did not get its content down the tree" in line]
    why = f"node 2 ({c.addresses[2]}) did not get its content down the tree (node 1 ({c.addresses[1]}) could not pass"
    assert line.startswith(f"{why} it on: ssh: connect to host {c.addresses[2]}"), line
    assert line.endswith(f"node 0 ({c.addresses[0]}) sent it directly"), line
    sent = SENT.search(r.stderr)
    assert sent and sent.group(1) == "2", r.stderr  # still once from here: node 0 re-sent it
    c.assert_nothing_left()


def test_a_node_no_other_node_can_reach_fails_the_launch_with_one_line_naming_it(c, tmp_path):
    """Neither node 1 (its parent in the chain) nor node 0 (the direct re-send) can reach node 2:
    one line naming node 2 and why, exit 2, nothing started."""
    d = _fresh(tmp_path, "unreachable")
    route = ["ip", "route", "add", "prohibit", f"{c.addresses[2]}/32"]
    for i in (0, 1):
        assert c.exec(i, route).returncode == 0
    try:
        chain = ["--sync", str(d), "--sync-fanout", "1"]
        r = launch(tmp_path, "exec", *source_args(c, tmp_path), *chain, "--", "cat", "data.txt")
    finally:
        for i in (0, 1):
            c.exec(i, ["ip", "route", "del", "prohibit", f"{c.addresses[2]}/32"])
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    (error,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(
        f"error: node 2 ({c.addresses[2]}): could not receive the job's files (node 0 ({c.addresses[0]}) could "
        f"not pass it on: ssh: connect to host {c.addresses[2]}"
    ), error
    assert error.endswith("; nothing was started"), error
    assert "started on" not in r.stderr and "data.txt" not in r.stdout
    c.assert_nothing_left()


def test_a_relay_from_user_at_address_lines_reaches_every_node_and_its_key_reaches_nothing_else(c, tmp_path):
    """A hostfile of `root@ADDRESS` lines: the hops go by address with that user. The relay key's
    forced command names those nodes; asked (from node 0, where `from=` lets it in) to pass
    content on to an address outside the cluster, node 1 refuses before opening any ssh."""
    d = _fresh(tmp_path, "users")
    want = (d / "data.txt").read_text().strip()
    hostfile = tmp_path / "hosts-with-users"
    hostfile.write_text("".join(f"root@{a}\n" for a in c.addresses))
    chain = ["--sync", str(d), "--sync-fanout", "1"]
    r = launch(tmp_path, "exec", *source_args(c, tmp_path, hostfile), *chain, "--", "cat", "data.txt")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(want) == N and f"({N - 1} levels deep)" in r.stderr, r.stderr
    peers = ",".join(sorted(f"root@{a}" for a in c.addresses))
    keys = c.node_path(1, "/root/.ssh/authorized_keys").read_text()
    (entry,) = [line for line in keys.splitlines() if relay_public(tmp_path) in line]  # this machine's key, once
    assert f' relay 22 {peers}" ssh-ed25519 ' in entry, entry
    (relay_key,) = (tmp_path / "client").glob(".cache/gpufleet/*/relay_ed25519")
    there = c.node_path(0, "/root/relay-test")  # node 0's own disk: its namespace sees it
    there.mkdir(mode=0o700, exist_ok=True)
    shutil.copy(relay_key, there / "key")
    shutil.copy(c.known_hosts, there / "known_hosts")
    plan = [{"rank": 1, "host": "192.0.2.1", "user": "root", "port": 22, "objects": [], "children": []}]
    frames = f"FWD {len(json.dumps(plan))}\n{json.dumps(plan)}END\n"
    ssh = ["ssh", "-i", "/root/relay-test/key", "-o", "IdentitiesOnly=yes", "-o", "User=root", "-o", "BatchMode=yes"]
    ssh += ["-o", "UserKnownHostsFile=/root/relay-test/known_hosts", "-o", "StrictHostKeyChecking=yes"]
    ssh += [c.addresses[1], "sh"]
    out = c.exec(0, ssh, input=frames, capture_output=True, text=True)
    shutil.rmtree(there)
    assert out.returncode != 0 and "'root@192.0.2.1' is not one of the cluster's nodes" in out.stderr, out.stderr
    c.assert_nothing_left()


def test_ctrl_c_mid_transfer_leaves_no_partial_file_and_prune_still_scans(c, tmp_path):
    """Ctrl-C while node 0 is receiving an object (its link slowed so the transfer lasts): node
    0's relay, hung up on, removes the half-written object; `launch prune` then scans cleanly."""
    d = _fresh(tmp_path, "cut-short")
    (d / "big.bin").write_bytes(os.urandom(16 << 20))
    objects = c.node_path(0, "/root/.gpufleet/objects")
    link = c.nodes[0].host_link

    def partial() -> list[Path]:
        return [f for f in objects.iterdir() if f.name.startswith(".tmp-")] if objects.is_dir() else []

    shape = ["tc", "qdisc", "replace", "dev", link, "root", "tbf", "rate", "4mbit", "burst", "64kb", "latency", "100ms"]
    subprocess.run(shape, check=True)  # this machine -> node 0 only
    try:
        p = subprocess.Popen(
            [LAUNCH, "exec", *source_args(c, tmp_path), "--sync", str(d), "--", "true"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=client_env(tmp_path),
            # SIGINT as a terminal's foreground job has it, whatever this test inherited: under
            # a suite started in the background (`make test &`) xdist's workers ignore it, and so
            # would the launch, which then ran to its end here.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        wait_for(lambda: partial() or p.poll() is not None, 300, "a partial object on node 0")
        assert partial(), p.communicate()
        seen = [f.name for f in partial()]
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", link, "root"], check=False)
    assert p.returncode != 0, (seen, out[-2000:], err[-3000:])
    wait_for(lambda: not partial(), 60, "node 0's relay to remove its partial object")
    r = launch(tmp_path, "prune", *source_args(c, tmp_path), "--list", timeout=120)
    assert r.returncode == 0, r.stderr
    c.assert_nothing_left()
