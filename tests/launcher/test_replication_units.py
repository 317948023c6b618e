"""A --recover job's peer copies of its local checkpoints, on the launcher's side: the replica
key's authorized entry and forced command (launcher.code.tree), the ring in the job's order
(launcher.core.types.Replication), the sidecar wrapped round the rank command
(launcher.core.program), the job's request carrying it to the controller (launcher.jobs.record),
and the node agent keeping the key (launcher.code.node_agent). The copies themselves are
tests/workloads/test_replica.py's, and a node lost for good test_bare_spares_cluster.py's."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys

import pytest

from launcher.code import node_agent
from launcher.code.tree import authorize_replica, replica_command
from launcher.core.program import ProgramBuilder
from launcher.core.transport import cluster_slug
from launcher.core.types import Cluster, LaunchConfig, Node, Replication, SshConfig, UserError, Workload
from launcher.jobs.record import request_from_json, request_json
from tests.support import REPO

NODES = tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(4))
CLUSTER = Cluster("c1", NODES)
RING = Replication(
    ring=tuple((n.host, f"me@{n.address}") for n in NODES), port=22, state="/h/.gpufleet/replica/c1", code="/h/snap/abc"
)


def test_each_node_sends_to_the_next_in_the_jobs_order_then_the_ones_after_it():
    assert RING.peers("10.0.0.3") == ("me@10.0.0.4", "me@10.0.0.5", "me@10.0.0.2")
    assert RING.peers("10.0.0.5") == ("me@10.0.0.2", "me@10.0.0.3", "me@10.0.0.4")
    assert RING.peers("10.9.9.9") == ()
    # The plan's order (launcher.runner.plan) puts node 2 first: the ring follows it.
    reordered = RING.in_order((NODES[2], NODES[0]))
    assert [h for h, _ in reordered.ring] == ["10.0.0.4", "10.0.0.2", "10.0.0.3", "10.0.0.5"]


def test_the_request_carries_the_ring_to_the_controller(tmp_path):
    config = LaunchConfig(workload=Workload("torchrun", ("-m", "workloads.train")), job_id="j1", replication=RING)
    doc = json.loads(json.dumps(request_json(CLUSTER, config, SshConfig(key=tmp_path / "k"))))
    _, again = request_from_json(doc, [], tmp_path, tmp_path / "runs")
    assert again.replication == RING


def _builder(tmp_path, **kw):
    config = LaunchConfig(
        workload=Workload("exec", ("python3", "train.py")), job_id="j1", runs_dir=tmp_path, replication=RING, **kw
    )
    return ProgramBuilder(Cluster("c1", NODES[:3]), config, env={})


def test_the_rank_command_runs_under_the_sidecar_with_the_nodes_peers(tmp_path):
    builder = _builder(tmp_path)
    argv = list(builder.program(NODES[1]).argv)
    assert argv[:4] == ["python3", "-I", "-S", "-c"] and argv[5:7] == ["/h/snap/abc", "sidecar"], argv
    assert argv[argv.index("--peers") + 1] == "me@10.0.0.4,me@10.0.0.5,me@10.0.0.2"
    assert argv[argv.index("--state") + 1] == "/h/.gpufleet/replica/c1"
    assert argv[argv.index("--") + 1 :] == ["python3", "train.py"]
    assert "wrap:replicate" in builder.steps()
    # What --dry-run shows keeps the user's command apart from the wrapper.
    assert list(builder.plans()[1].command) == ["python3", "train.py"]


def test_with_an_image_the_ranks_are_not_wrapped_by_the_sidecar(tmp_path):
    builder = _builder(tmp_path, image="example.com/a/b:1")
    assert "wrap:replicate" not in builder.steps()


def _keygen(tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    return (tmp_path / "k.pub").read_text()


def test_the_replica_key_is_authorized_restricted_from_the_cluster_forced_to_receive(tmp_path):
    public = _keygen(tmp_path)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    keys = home / ".ssh" / "authorized_keys"
    keys.write_text("ssh-ed25519 AAAAmine me@laptop\n")
    statement = authorize_replica(public, CLUSTER, ".gpufleet/snap/abc")
    for _ in range(2):  # once: a second launch changes nothing
        subprocess.run(["bash", "-c", statement], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True)
    lines = keys.read_text().splitlines()
    assert len(lines) == 2 and lines[0] == "ssh-ed25519 AAAAmine me@laptop", lines
    assert lines[1].startswith('from="10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5",restrict,command="exec python3 -I -S -c ')
    assert (
        lines[1].endswith(f"{public.split()[1]} gpufleet-replica-{cluster_slug(CLUSTER)}")
        and "snap/abc receive\"" in lines[1]
    )
    assert subprocess.run(["ssh-keygen", "-l", "-f", str(keys)], capture_output=True).returncode == 0


def test_the_forced_command_runs_the_receiver_from_gpufleets_code_as_sshd_would(tmp_path):
    """sshd runs the forced command with the user's shell, in the home directory: here `bash -c`
    in a home holding gpufleet's code where the preparation puts it (a link to this checkout)."""
    home = tmp_path / "home"
    (home / ".gpufleet" / "snap").mkdir(parents=True)
    os.symlink(REPO, home / ".gpufleet" / "snap" / "abc")
    command = replica_command(".gpufleet/snap/abc").replace("python3", shlex.quote(sys.executable), 1)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": "../escape"}
    r = subprocess.run(["bash", "-c", command], cwd=home, env=env, input=b"", capture_output=True)
    assert r.returncode == 2 and b"'../escape' is not a plain name" in r.stderr, r.stderr


@pytest.mark.parametrize("code", ["../x", "a b", "a;b", "$(x)", ""])
def test_a_code_path_that_is_not_plain_is_refused(code):
    with pytest.raises(UserError, match="not a plain path"):
        replica_command(code)


def test_the_node_agent_keeps_the_key_private_and_replaces_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(node_agent, "G", str(tmp_path / ".gpufleet"))
    before = os.umask(0o077)  # the node agent's own (own_state); this process's is put back below
    try:
        for text in ("first", "second"):
            node_agent.keep_replica_key({"slug": "c1", "key": text, "known": "10.0.0.2 ssh-ed25519 AAAA\n"})
    finally:
        os.umask(before)
    d = tmp_path / ".gpufleet" / "replica" / "c1"
    assert (d / "key").read_text() == "second" and stat.S_IMODE((d / "key").stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and sorted(p.name for p in d.iterdir()) == ["key", "known_hosts"]
    with pytest.raises(ValueError, match="not a plain name"):
        node_agent.keep_replica_key({"slug": "../x", "key": "k", "known": ""})


def test_gpufleets_code_sent_only_for_the_replicator_stays_off_the_ranks_pythonpath(tmp_path):
    """A script of the user's own (`launch run --detach --recover`) gets gpufleet's code for the
    replicator, not on its PYTHONPATH, where gpufleet's `workloads` could shadow a package of the
    user's; launch train's ranks import it from there."""
    from launcher.code import code_snapshot
    from launcher.code.prepare import CodeRequest, configured

    config = LaunchConfig(workload=Workload("exec", ("python3", "job.py")), job_id="j1")
    snap = code_snapshot()
    off = configured(config, CodeRequest(code=snap, code_root=REPO, code_on_path=False), "/h")
    on = configured(config, CodeRequest(code=snap, code_root=REPO), "/h")
    assert "PYTHONPATH" not in dict(off.env) and "GPUFLEET_CODE" not in dict(off.env)
    assert dict(on.env)["PYTHONPATH"] == f"/h/.gpufleet/snap/{snap.hash}"
    # Either way the node program checks the code is there before it runs (the `prepared` step).
    assert f"/h/.gpufleet/snap/{snap.hash}" in off.prepared and f"/h/.gpufleet/snap/{snap.hash}" in on.prepared


class _Answers:
    """A transport whose command for each node is a real process that answers as that node would:
    its inventory as JSON, or ssh's failure for a node that cannot be reached."""

    def __init__(self, answers: dict[str, str | None]):
        self.answers = answers

    def argv(self, node: Node, script: str) -> list[str]:
        said = self.answers[node.host]
        if said is None:
            return [
                "sh",
                "-c",
                f"echo 'ssh: connect to host {node.address} port 22: Connection timed out' >&2; exit 255",
            ]
        return [sys.executable, "-c", "import sys; print(sys.argv[1])", said]


@pytest.mark.parametrize("node_2_answers", [True, False])
def test_a_node_that_does_not_say_what_it_holds_is_named_in_the_realignment(monkeypatch, node_2_answers):
    """Node 0 holds rank 0's steps 40 and 60; node 2 holds rank 1's copy of step 60. When node 2
    cannot be reached no step has both ranks, and the line says which node did not answer and why."""
    from launcher.jobs import realign as ra

    inv = {"10.0.0.2": {"own": {"0": [40, 60]}, "peer": {}}, "10.0.0.4": {"own": {}, "peer": {"1": [60]}}}
    answers = {
        "10.0.0.2": json.dumps(inv["10.0.0.2"]),
        "10.0.0.4": json.dumps(inv["10.0.0.4"]) if node_2_answers else None,
    }
    monkeypatch.setattr(ra, "make_transport", lambda cluster, ssh: _Answers(answers))
    config = LaunchConfig(workload=Workload("exec", ("python3", "t.py")), job_id="j1", replication=RING)
    said: list[str] = []
    world, asked = (NODES[0], NODES[1]), (NODES[0], NODES[2])
    step = ra.realign(Cluster("c1", world), world, asked, config, said.append)
    if node_2_answers:  # step 60 for both: rank 1's copy goes from node 2 to node 1, its node now
        assert (step, said) == (60, ["copied rank 1's step 60 from 10.0.0.4 (peer) to 10.0.0.3, which holds it now"])
        return
    assert step is None
    (line,) = said
    assert line == (
        "no local step is on the nodes in service for all 2 ranks; node 10.0.0.4 did not say what it holds "
        "(ssh: connect to host 10.0.0.4 port 22: Connection timed out); the relaunch restores from the durable "
        "tier, if the job has one"
    )
