"""The peer tier's receiver refuses what is not the tier's own, and the ring puts each shifted-down
node's ranks on it after a spare swap (gpufleet.replica)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet import local_tier as lt
from gpufleet.replica import Move, ReplicaError, Sender, inventory, pack, plan_moves, prune, receive, ring_peer, sidecar
from launcher.core.types import Node, Replication
from launcher.jobs.realign import aligned, askable, current_ring
from launcher.jobs.spares import split_spares, swap_in
from tests.support import REPO


def _own(tmp_path, step=10, rank=3, files=None):
    d = lt.rank_dir(tmp_path / "src", "job1", lt.OWN, step, rank)
    d.mkdir(parents=True)
    for name, data in (files or {".metadata": b"meta", "__0_0.distcp": b"x" * 5000}).items():
        (d / name).write_bytes(data)
    lt.write_manifest(d, step, rank, 4)
    return d


def _stream(manifest: dict, blobs: list[bytes]) -> io.BytesIO:
    text = json.dumps(manifest).encode()
    return io.BytesIO(f"{len(text)}\n".encode() + text + b"".join(blobs))


def test_a_packed_rank_directory_arrives_complete_and_verified(tmp_path):
    src = _own(tmp_path)
    dst = receive(tmp_path / "dst", "job1", io.BytesIO(b"".join(pack(src))))
    assert dst == lt.rank_dir(tmp_path / "dst", "job1", lt.PEER, 10, 3)
    m = lt.read_manifest(dst)
    assert m is not None and lt.verify(dst, m) is None
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == [10]


def test_a_stream_cut_short_leaves_no_manifest_so_no_checkpoint(tmp_path):
    whole = b"".join(pack(_own(tmp_path)))
    with pytest.raises(ReplicaError, match="ended inside __0_0.distcp"):
        receive(tmp_path / "dst", "job1", io.BytesIO(whole[:-10]))
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == []


def test_a_file_whose_hash_does_not_match_is_refused(tmp_path):
    whole = bytearray(b"".join(pack(_own(tmp_path))))
    whole[-1] ^= 0xFF
    with pytest.raises(ReplicaError, match="does not match its sha256"):
        receive(tmp_path / "dst", "job1", io.BytesIO(bytes(whole)))
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == []


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".", "MANIFEST.json", ".MANIFEST.json.tmp-1", "", "x" * 200])
def test_file_names_that_are_not_plain_names_are_refused(tmp_path, name):
    manifest = {
        "format": lt.MANIFEST_FORMAT,
        "step": 1,
        "rank": 0,
        "world_size": 1,
        "files": {name: {"size": 1, "sha256": "0" * 64}},
    }
    with pytest.raises(ReplicaError, match="not a plain file name"):
        receive(tmp_path / "dst", "job1", _stream(manifest, [b"x"]))
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "dst" / "job1" / "peer" / "step_00000001").exists()


@pytest.mark.parametrize("job", ["../x", "a/b", "..", "", "-rf"])
def test_a_job_id_that_could_escape_the_root_is_refused(tmp_path, job):
    with pytest.raises(ReplicaError, match="not a plain name"):
        receive(tmp_path / "dst", job, io.BytesIO(b"b"))


@pytest.mark.parametrize("step,rank,world", [(-1, 0, 1), (10**8, 0, 1), (1, 5, 4), (1, -1, 4)])
def test_steps_and_ranks_out_of_range_are_refused(tmp_path, step, rank, world):
    manifest = {"format": lt.MANIFEST_FORMAT, "step": step, "rank": rank, "world_size": world, "files": {}}
    with pytest.raises(ReplicaError, match="out of range"):
        receive(tmp_path / "dst", "job1", _stream(manifest, []))


def test_a_stream_without_a_length_line_is_refused(tmp_path):
    with pytest.raises(ReplicaError, match="manifest's length"):
        receive(tmp_path / "dst", "job1", io.BytesIO(b"{not a length}\n"))


def test_prune_keeps_the_newest_complete_steps(tmp_path):
    for step in (10, 20, 30):
        receive(tmp_path / "dst", "job1", io.BytesIO(b"".join(pack(_own(tmp_path, step=step)))))
    assert prune(tmp_path / "dst", "job1", lt.PEER, 3, keep=2) == [10]
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == [20, 30]


def test_the_ring_is_the_next_node_in_the_job_order_wrapping():
    order = ["a", "b", "c", "s"]
    assert [ring_peer(order, h) for h in order] == ["b", "c", "s", "a"]
    assert ring_peer(["a"], "a") is None and ring_peer(order, "zz") is None


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_after_one_swap_every_rank_finds_its_shards_on_its_node_through_the_ring(lost):
    """The spares.py renumbering: each node after the lost one takes the rank of the node before
    it, which the ring i -> i+1 has copied into its peer/."""
    order = ["n0", "n1", "n2", "s0"]
    nodes = [Node(rank=i, host=h, address=h) for i, h in enumerate(order)]
    world, spares = split_spares(nodes, 1)
    held = {h: {i} for i, h in enumerate(order[:3])}  # own/: each node's ranks before the loss
    for i, h in enumerate(order[:3]):
        held[ring_peer(order, h)] = held.get(ring_peer(order, h), set()) | {i}  # peer/
    new, _, swaps = swap_in(order, world, {lost: "unreachable"}, spares)
    assert swaps and swaps[0].into == "s0"
    for node in new:
        assert node.rank in held[node.host], f"{node.host} has rank {node.rank} but holds {held[node.host]}"


# ---- the sending side (gpufleet.replica.Sender, sidecar) and the receiver's forced command ----

RECEIVE = [sys.executable, "-I", "-S", "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
           "from gpufleet.replica import main; sys.exit(main())", str(REPO), "receive"]  # fmt: skip


class LocalSender(Sender):
    """The sender with `receive` run here as the forced command runs it on a peer (python3 -I -S,
    SSH_ORIGINAL_COMMAND the job, HOME the peer's), in place of ssh: the stream, the receiver's
    checks and its exit status are the real ones. A peer named `down` is one ssh cannot reach."""

    def __init__(self, *a, homes, **kw):
        super().__init__(*a, **kw)
        self.homes = homes

    def argv(self, peer):
        if peer == "down":
            return [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(255)"]
        env = {"HOME": str(self.homes[peer]), "SSH_ORIGINAL_COMMAND": self.job, "PATH": os.environ["PATH"]}
        return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *RECEIVE]


def _sender(tmp_path, peers, said=None):
    homes = {p: tmp_path / f"home-{p}" for p in peers}
    for h in homes.values():
        h.mkdir()
    out = said if said is not None else []
    root = tmp_path / "src"
    return LocalSender(root, "job1", peers, 22, "key", "known", say=out.append, homes=homes), homes


def _peer_root(home):
    return lt.default_root(str(home), mounts=())


def test_the_sender_copies_each_ranks_newest_complete_step_once_to_the_next_peer(tmp_path):
    said: list[str] = []
    sender, homes = _sender(tmp_path, ["n1", "n2"], said)
    _own(tmp_path, step=10, rank=2)
    _own(tmp_path, step=20, rank=2)
    _own(tmp_path, step=20, rank=3)
    d = lt.rank_dir(tmp_path / "src", "job1", lt.OWN, 30, 3)
    d.mkdir(parents=True)  # a save under way: no manifest yet, not sent
    assert sender.once() == 2
    root = _peer_root(homes["n1"])
    assert [lt.complete_steps(root, "job1", lt.PEER, r) for r in (2, 3)] == [[20], [20]]
    assert not (homes["n2"] / ".gpufleet").exists()
    assert sender.once() == 0  # nothing new: nothing sent again
    # Each own directory that went out is marked so (the ranks wait for the mark); only those.
    steps = ((10, 2), (20, 2), (20, 3), (30, 3))
    marked = {(s, r) for s, r in steps if lt.was_sent(lt.rank_dir(tmp_path / "src", "job1", lt.OWN, s, r))}
    assert marked == {(20, 2), (20, 3)}
    assert (lt.rank_dir(tmp_path / "src", "job1", lt.OWN, 20, 2) / lt.SENT).read_text() == "n1\n"
    lt.write_manifest(d, 30, 3, 4)
    assert sender.once() == 1 and lt.complete_steps(root, "job1", lt.PEER, 3) == [20, 30]
    assert any(s.startswith("copied step_00000030 of rank 3 to n1") for s in said), said


def test_a_peer_that_cannot_be_reached_is_passed_over_for_the_next_one(tmp_path):
    said: list[str] = []
    sender, homes = _sender(tmp_path, ["down", "n2"], said)
    _own(tmp_path, step=10, rank=1)
    assert sender.once() == 1
    assert lt.complete_steps(_peer_root(homes["n2"]), "job1", lt.PEER, 1) == [10]
    assert any("peer down cannot be reached" in s for s in said), said
    _own(tmp_path, step=20, rank=1)
    assert sender.once() == 1  # `down` is not tried again for a while: no second line about it
    assert sum("cannot be reached" in s for s in said) == 1, said


def test_the_peer_keeps_only_the_newest_two_steps_of_each_rank(tmp_path):
    sender, homes = _sender(tmp_path, ["n1"])
    for step in (10, 20, 30):
        _own(tmp_path, step=step, rank=0)
        sender.once()
    assert lt.complete_steps(_peer_root(homes["n1"]), "job1", lt.PEER, 0) == [20, 30]


def test_the_receiver_refuses_a_job_name_and_a_root_that_is_not_this_accounts_own(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    stream = b"".join(pack(_own(tmp_path)))

    def run(job):
        env = {"HOME": str(home), "SSH_ORIGINAL_COMMAND": job, "PATH": os.environ["PATH"]}
        return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items()), *RECEIVE], input=stream,
                              capture_output=True)  # fmt: skip

    bad = run("../x")
    assert bad.returncode == 2 and b"is not a plain name" in bad.stderr, bad.stderr
    (home / ".gpufleet").mkdir(mode=0o755)
    (home / ".gpufleet" / "local").mkdir(mode=0o777)
    os.chmod(home / ".gpufleet" / "local", 0o777)
    open_dir = run("job1")
    assert open_dir.returncode == 2 and b"writable by other accounts" in open_dir.stderr, open_dir.stderr
    os.chmod(home / ".gpufleet" / "local", 0o700)
    ok = run("job1")
    assert ok.returncode == 0, ok.stderr
    assert lt.complete_steps(_peer_root(home), "job1", lt.PEER, 3) == [10]


def test_the_sidecar_exits_as_its_command_did_after_a_last_copy_of_what_the_command_saved_last(tmp_path):
    """The command writes a complete step just before it exits (as a rank's last save on a
    preemption notice does): the sidecar's last pass copies it, then exits with its status."""
    sender, homes = _sender(tmp_path, ["n1"])
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from gpufleet import local_tier as lt; "
        "d = lt.rank_dir(sys.argv[2], 'job1', lt.OWN, 40, 0); d.mkdir(parents=True); "
        "(d / 'x').write_bytes(b'1'); lt.write_manifest(d, 40, 0, 1); sys.exit(7)"
    )
    rc = sidecar([sys.executable, "-c", script, str(REPO), str(tmp_path / "src")], lambda: sender, poll_s=30)
    assert rc == 7
    assert lt.complete_steps(_peer_root(homes["n1"]), "job1", lt.PEER, 0) == [40]


def test_the_sidecar_reports_a_signal_as_a_shell_does_and_runs_its_command_without_a_sender(tmp_path):
    rc = sidecar([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], lambda: None)
    assert rc == 128 + 9


def test_the_default_root_is_the_boot_disk_without_a_local_ssd_and_the_ssd_when_it_is_this_accounts(tmp_path):
    assert lt.default_root(str(tmp_path), mounts=()) == tmp_path / ".gpufleet" / "local" / "checkpoints"
    assert lt.default_root(str(tmp_path), mounts=[str(tmp_path / "not-mounted")]) == (
        tmp_path / ".gpufleet" / "local" / "checkpoints"
    )


@pytest.mark.parametrize("made_by_other", [True, False])
def test_the_receiver_never_uses_a_local_ssd_directory_another_account_made_or_can_write(
    tmp_path, small_tmpfs, made_by_other
):
    """Two accounts on one node: MOUNT/gpufleet-UID made first by another account (uid 4242), or
    this account's own but open to others, is never the peer tier's root; the boot disk's is (the
    node program's rule, launcher.core.node_local)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a mount, and a directory of another uid")
    mount = small_tmpfs(1 << 20)
    os.chmod(mount, 0o1777)  # a shared SSD: every account may make its own directory there
    mine = mount / f"gpufleet-{os.geteuid()}"
    mine.mkdir(mode=0o700)
    if made_by_other:
        os.chown(mine, 4242, 4242)
    else:
        os.chmod(mine, 0o777)
    home = tmp_path / "home"
    assert lt.default_root(str(home), mounts=[str(mount)]) == home / ".gpufleet" / "local" / "checkpoints"
    os.chown(mine, os.geteuid(), os.getegid())
    os.chmod(mine, 0o700)
    assert lt.default_root(str(home), mounts=[str(mount)]) == mine / "checkpoints"


# ---- after a swap that leaves ranks away from their data: the controller's realignment ----


def test_inventory_lists_each_areas_complete_steps_by_rank(tmp_path):
    _own(tmp_path, step=10, rank=1)
    _own(tmp_path, step=20, rank=1)
    lt.rank_dir(tmp_path / "src", "job1", lt.OWN, 30, 1).mkdir(parents=True)  # a save under way
    receive(tmp_path / "src", "job1", io.BytesIO(b"".join(pack(_own(tmp_path / "other", step=20, rank=0)))))
    assert inventory(tmp_path / "src", "job1") == {"own": {1: [10, 20]}, "peer": {0: [20]}}
    assert inventory(tmp_path / "src", "nojob") == {"own": {}, "peer": {}}


def test_the_moves_put_the_newest_step_every_rank_has_on_each_ranks_new_node():
    # A second swap: n1 (swapped out before, a spare again) takes rank 1, whose newest copies are
    # n2's own; n2 takes rank 2, whose copies the lost s3 sent to n0. Rank 0 stays on n0.
    held = {
        "n0": {"own": {0: [300, 400]}, "peer": {2: [300, 400]}},
        "n1": {"own": {1: [100]}, "peer": {}},  # stale: from before it was lost
        "n2": {"own": {1: [300, 400]}, "peer": {0: [300, 400]}},
    }
    step, moves = plan_moves(["n0", "n1", "n2"], held)
    assert step == 400
    assert moves == [Move(1, 400, "n2", "own", "n1"), Move(2, 400, "n0", "peer", "n2")]
    # A rank whose newest copy is older than the others': the newest step all of them have.
    held["n0"]["peer"][2] = [300]
    assert plan_moves(["n0", "n1", "n2"], held)[0] == 300
    # Already where they belong: the step, nothing to move.
    assert plan_moves(["n0", "n2"], {"n0": {"own": {0: [5]}}, "n2": {"peer": {1: [5]}}}) == (5, [])
    # A rank with no copy on any reachable node: nothing to restore from the local tier.
    assert plan_moves(["n0", "n1"], {"n0": {"own": {0: [5]}}}) == (None, [])


def test_a_node_out_of_service_is_not_asked_so_a_replaced_attempts_step_never_joins_the_restore():
    # n1 was lost at step 40 of attempt 0, its own rank-1 step 40 still on it. Attempt 1 resumed
    # from step 20 on n0 (rank 0) and s3 (rank 1), and s3 was lost as its step 40 was on its way
    # to n0. Asking n1 would restore step 40: rank 0's from attempt 1, rank 1's from attempt 0.
    held = {
        "n0": {"own": {0: [30, 40]}, "peer": {1: [20, 30]}},
        "n1": {"own": {1: [20, 40]}, "peer": {}},
        "n2": {"own": {}, "peer": {}},
    }
    assert plan_moves(["n0", "n2"], held) == (40, [Move(1, 40, "n1", "own", "n2")])  # mixed
    asked = askable(["n0", "n1", "n2", "s3"], {"n1", "s3"})
    assert asked == ["n0", "n2"]
    assert plan_moves(["n0", "n2"], {h: held[h] for h in asked}) == (30, [Move(1, 30, "n0", "peer", "n2")])


def test_one_swap_along_the_ring_is_aligned_and_a_swap_onto_a_rejoined_node_is_not():
    ring = ["n0", "n1", "n2", "s3"]
    assert aligned(["n0", "n1", "n2"], ["n0", "n2", "s3"], ring, {"n1"})
    # n1 was swapped out (the ring without it), s3 lost, n1 back as the spare: the job's order
    # puts it at rank 1, where n2's ranks were; n2 takes rank 2, whose data went to n0.
    assert not aligned(["n0", "n2", "s3"], ["n0", "n1", "n2"], ["n0", "n2", "s3"], {"s3"})
    assert not aligned(["n0", "n1"], ["n0", "n1", "n2"], ring, set())  # another world size


def test_the_ring_after_a_swap_is_the_world_then_the_spares_without_the_nodes_out():
    rep = Replication((("n0", "root@n0"), ("n1", "root@n1"), ("n2", "root@n2"), ("s3", "root@s3")), 22, "/st", "/c")
    world = [Node(0, "n0", "n0"), Node(1, "n2", "n2"), Node(2, "s3", "s3")]
    ring = current_ring(rep, world, (), {"n1"})
    assert [h for h, _ in ring.ring] == ["n0", "n2", "s3"] and ring.peers("s3") == ("root@n0", "root@n2")
    assert (ring.port, ring.state, ring.code) == (22, "/st", "/c")


def test_send_refuses_what_is_not_a_complete_rank_directory_in_one_line(tmp_path):
    home = tmp_path / "h"
    home.mkdir()

    def send(*args):
        code = "import sys; sys.path.insert(0, sys.argv.pop(1)); from gpufleet.replica import main; sys.exit(main())"
        argv = [sys.executable, "-I", "-S", "-c", code, str(REPO), "send", *args]
        return subprocess.run(argv, capture_output=True, text=True, env={"HOME": str(home), "PATH": os.environ["PATH"]})

    r = send("--state", "/st", "--port", "22", "--to", "root@10.0.0.3", "job1", "own", "400", "1")
    assert r.returncode == 2 and "is not a complete rank directory" in r.stderr and r.stderr.count("\n") == 1
    r = send("--state", "/st", "--port", "22", "--to", "-oProxyCommand=x", "job1", "own", "400", "1")
    assert r.returncode == 2 and "is not a plain user@address" in r.stderr, r.stderr
    r = send("--state", "/st", "--port", "22", "--to", "n1", "job1", "elsewhere", "400", "1")
    assert r.returncode == 2 and "neither own nor peer" in r.stderr
    assert send("job1").returncode == 2


def test_a_sender_started_on_steps_already_there_sends_only_what_comes_after(tmp_path):
    # A relaunch's sidecar: what is there at its start went out with the previous attempt, or is
    # a replaced attempt's (removed once the ranks resume). The next save, even an older step
    # number than a replaced one's, goes out.
    for rank in (1, 2):
        _own(tmp_path, step=30, rank=rank)  # the replaced attempt's, past the step the relaunch resumed from
    sender, homes = _sender(tmp_path, ["n1"])
    assert sender.once() == 0
    lt.forget_after(tmp_path / "src", "job1", 10)  # the ranks resumed from step 10
    _own(tmp_path, step=20, rank=1)
    # Rank 2 writes step 30 again: the same number as the replaced attempt's, a new step.
    _own(tmp_path, step=30, rank=2)
    assert sender.once() == 2
    peer = _peer_root(homes["n1"])
    assert [lt.complete_steps(peer, "job1", lt.PEER, r) for r in (1, 2)] == [[20], [30]]


@pytest.mark.parametrize("with_sender", [True, False])
def test_the_sidecar_tells_its_ranks_to_wait_for_copies_only_when_it_copies(tmp_path, monkeypatch, with_sender):
    monkeypatch.setenv(lt.COPIES_VAR, "1")  # inherited from outside: never taken for the sidecar's word
    sender, _ = _sender(tmp_path, ["n1"])
    seen = tmp_path / "seen"
    script = f"import os; open({str(seen)!r}, 'w').write(os.environ.get({lt.COPIES_VAR!r}, 'unset'))"
    assert sidecar([sys.executable, "-c", script], lambda: sender if with_sender else None, poll_s=0.05) == 0
    assert seen.read_text() == ("1" if with_sender else "unset")


def test_a_sidecars_sender_keeps_one_connection_per_peer_in_the_keys_own_directory(tmp_path):
    state = Path("/home/me/.gpufleet/replica/c1-3f2a")  # launcher.code.tree's, in the account's home
    sender = Sender(tmp_path / "src", "job1", ["me@10.0.0.3"], 22, state / "key", state / "known_hosts", mux=True)
    argv = sender.argv("me@10.0.0.3")
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert f"ControlPath={state}/cm-%C" in opts and "ControlMaster=auto" in opts, opts
    assert argv[-3:] == ["--", "10.0.0.3", "job1"]
    # A copy the controller asks for (`send`) keeps nothing open; nor does a sender whose socket
    # path would not fit (a long home directory): each copy is its own connection then.
    deep = state / ("d" * 40)
    for other in (
        Sender(tmp_path / "src", "job1", ["me@10.0.0.3"], 22, state / "key", state / "known_hosts"),
        Sender(tmp_path / "src", "job1", ["me@10.0.0.3"], 22, deep / "key", deep / "known_hosts", mux=True),
    ):
        opts = [a for a in other.argv("me@10.0.0.3") if a.startswith("Control")]
        assert opts == ["ControlMaster=no", "ControlPath=none"], opts
