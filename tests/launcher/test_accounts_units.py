"""Two accounts on one machine (real users, made with useradd; the real node program and the real
node agent run as each with runuser): each account's node state is its own (launcher.code.node_agent), and
the holds registry (launcher.core.holds) says who holds a node, believed only from its owner
and only while its program runs. The registry here is a directory of the test's own (root's,
1777, as /run/gpufleet-holds is on a node): other tests' launches on this machine never see it."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from launcher.code import node_agent
from launcher.core import node_start
from launcher.core.holds import HeldError, Hold, held_by_others, holds_script, parse_holds, refuse_held
from launcher.core.types import UserError
from launcher.jobs.holds import HoldsWatch, holds_summary, refuse_others_job
from tests.simcluster import make_accounts
from tests.support import require_netns, wait_for

A, B = "gfu1", "gfu2"
JOB_A, JOB_B = "20261128-010000-aaaaaa", "20261128-010001-bbbbbb"


@pytest.fixture(scope="module")
def accounts():
    require_netns("two accounts need root (useradd, runuser)")
    make_accounts((A, B))
    return {n: pwd.getpwnam(n) for n in (A, B)}


@pytest.fixture
def shared():
    """A directory the accounts can reach (pytest's tmp_path lies under a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="gpufleet-accounts-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def holds(shared) -> Path:
    d = shared / "holds"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


RUNUSER = shutil.which("runuser", path=f"{os.defpath}:/usr/sbin:/sbin") or "runuser"
SYSTEM_PYTHON = "/usr/bin/python3"  # a node's; this venv's lies under root's home, closed to the accounts


def as_user(user: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([RUNUSER, "-u", user, "--", *argv], capture_output=True, text=True, timeout=60, **kw)


# The node's hold (launcher.core.node_start, its code as it travels: nothing of gpufleet), kept for
# `seconds`, in the registry `holds`; its release when the program ends.
_HOLD = Path(node_start.__file__).read_text() + (
    "\nimport sys\ns = Start({'job_id': sys.argv[1]}, None)\ntry:\n    s.hold(['n0', 'n1'], (sys.argv[2],))\n"
    "    time.sleep(float(sys.argv[3]))\nfinally:\n    s.release()\n"
)


def program(holds: Path, job: str, seconds: float = 0) -> str:
    return shlex.join([SYSTEM_PYTHON, "-I", "-S", "-c", _HOLD, job, str(holds), str(seconds)])


def facts(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_a_job_holds_the_node_while_it_runs_and_the_other_account_reads_whose_and_since_when(accounts, holds):
    first = subprocess.Popen(
        [RUNUSER, "-u", A, "--", "bash", "-c", program(holds, JOB_A, 30)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        since = float(facts(first.stdout.readline())["hold_since"])
        (f,) = holds.iterdir()
        assert f.name == f"gpufleet-hold.{accounts[A].pw_uid}.{JOB_A}"
        assert stat.S_IMODE(f.stat().st_mode) == 0o644 and f.stat().st_uid == accounts[A].pw_uid
        r = as_user(B, ["bash", "-c", program(holds, JOB_B)])
        got = facts(r.stdout)
        assert got["hold.1"] == f"{A} {JOB_A} {got['hold.1'].split()[2]} n0,n1"
        (held,) = held_by_others(got)
        assert (held.account, held.job, held.nodes) == (A, JOB_A, ("n0", "n1")) and held.since == pytest.approx(since)
        listed = parse_holds(as_user(B, ["bash", "-c", holds_script((str(holds),))]).stdout)
        assert [(h.account, h.job) for h in listed] == [(A, JOB_A)]  # B's own ended with its program
        # B cannot remove A's hold (sticky directory), and A's own account does not refuse itself.
        assert as_user(B, ["rm", "-f", str(f)]).returncode != 0 and f.exists()
        assert "hold.1" not in facts(as_user(A, ["bash", "-c", program(holds, JOB_B)]).stdout)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # runuser and the program under it, no cleanup run
        first.wait()
    # Killed before its cleanup: the hold is stale, believed by no one, and A's next program removes it.
    assert "hold.1" not in facts(as_user(B, ["bash", "-c", program(holds, JOB_B)]).stdout)
    as_user(A, ["bash", "-c", program(holds, JOB_B)])
    assert list(holds.iterdir()) == []


def test_a_hold_forged_in_another_accounts_name_is_not_believed(accounts, holds):
    # B writes a file naming A, with B's own live shell as its program.
    forged = holds / f"gpufleet-hold.{accounts[A].pw_uid}.{JOB_A}"
    line = (
        'printf "v1 %s %s %s 1 %s %s n0\\n" '
        + f"{A} {accounts[A].pw_uid} {JOB_A} "
        + '$$ "$(cut -d" " -f22 /proc/$$/stat)"'
    )
    r = as_user(B, ["bash", "-c", f"{line} > {forged}; " + program(holds, JOB_B)])
    assert forged.exists() and forged.stat().st_uid == accounts[B].pw_uid
    assert "hold.1" not in facts(r.stdout), r.stdout


def test_only_holds_older_than_the_launchs_own_refuse_it_so_of_two_racing_launches_one_goes():
    older = {"hold.1": "gfu1 J1 100.5 n0", "hold_since": "101.0"}
    younger = {"hold.1": "gfu2 J2 101.0 n0", "hold_since": "100.5"}
    assert [h.job for h in held_by_others(older)] == ["J1"] and held_by_others(younger) == []
    assert [h.job for h in held_by_others({"hold.1": "gfu1 J1 100.5 n0"})] == ["J1"]  # could not register
    # Each node registered the job at its own moment: one job, since the earliest.
    later = {**older, "hold.1": "gfu1 J1 100.7 n0"}
    with pytest.raises(HeldError) as e:
        refuse_held({0: "node 0 (n0)", 1: "node 1 (n1)"}, {0: later, 1: older})
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(100.5))
    held = f"gfu1's job J1, since {at}, holds node 0 (n0), node 1 (n1)"
    assert str(e.value) == f"{held}; nothing was started. Add --wait to wait for the nodes"
    assert e.value.holds == {Hold("gfu1", "J1", 100.5, ("n0",)): ["node 0 (n0)", "node 1 (n1)"]}


def _agent(home: Path, code: str, user: str, command: str = "x", stdin: str = "") -> subprocess.CompletedProcess:
    """The node agent as `user` (`code` after its source; `command`: what its __main__ runs)."""
    source = Path(node_agent.__file__).read_text()
    # runuser sets HOME to the account's own: env gives the test's.
    argv = ["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", SYSTEM_PYTHON, "-S", "-I", "-c", f"{source}\n{code}"]
    return as_user(user, [*argv, command], cwd="/", input=stdin)


@pytest.fixture
def homes(shared, accounts) -> dict[str, Path]:
    out = {}
    for name, pw in accounts.items():
        h = shared / name
        h.mkdir()
        os.chown(h, pw.pw_uid, pw.pw_gid)
        h.chmod(0o755)  # Debian's default home
        out[name] = h
    return out


def test_the_state_directory_is_made_private_whatever_the_umask(homes):
    # An older gpufleet made it 0755 under umask 022: made private before use.
    old = homes[A] / ".gpufleet"
    assert _agent(homes[A], "import os; os.umask(0o022); os.mkdir(G, 0o755); own_state()", A).returncode == 0
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    assert stat.S_IMODE((old / "objects").stat().st_mode) == 0o700
    fresh = _agent(homes[B], "import os; os.umask(0); own_state(); print(oct(os.stat(G).st_mode & 0o777))", B)
    assert fresh.stdout.strip() == "0o700", fresh.stderr


@pytest.mark.parametrize(
    ("setup", "why"),
    [
        ("import os; os.symlink('/tmp', G)", "is not a directory but a link or file"),
        ("import os; os.mkdir(G); os.chmod(G, 0o777)", "has mode 0777, open to other accounts"),
    ],
)
def test_a_state_directory_that_is_wrong_is_refused_in_one_line(homes, setup, why):
    assert _agent(homes[A], setup, A).returncode == 0
    r = _agent(homes[A], "", A, "prepare", "{}")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and why in r.stderr and ".gpufleet" in r.stderr


def test_the_local_ssd_cache_is_the_accounts_own_and_one_another_account_planted_is_never_used(shared, homes, accounts):
    ssd = shared / "ssd"
    ssd.mkdir()
    # A file system of its own, root's and 1777, as the startup script leaves the SSD's RAID.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=4m", "gfs-localssd", str(ssd)], check=True)
    try:
        mine = _agent(homes[A], f"own_state(); print(local_cache([{str(ssd)!r}]))", A)
        assert mine.stdout.strip() == f"{ssd}/gpufleet-{accounts[A].pw_uid}/uv-cache", mine.stderr
        d = ssd / f"gpufleet-{accounts[A].pw_uid}"
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == accounts[A].pw_uid
        # A plants B's directory first (open to all): B's build never uses it, and says so.
        planted = ssd / f"gpufleet-{accounts[B].pw_uid}"
        assert as_user(A, ["mkdir", "-m", "777", str(planted)]).returncode == 0
        theirs = _agent(homes[B], f"own_state(); print(local_cache([{str(ssd)!r}]))", B)
        out = theirs.stdout.strip().splitlines()
        assert out[-1] == f"{homes[B]}/.gpufleet/uv-cache", theirs.stderr
        assert f"not using the local SSD's cache: {planted} belongs to uid {accounts[A].pw_uid}" in out[0]
    finally:
        subprocess.run(["umount", str(ssd)], check=True)


def test_stopping_another_accounts_job_is_refused_naming_whose_it_is_and_tops_heading_names_the_holders():
    h = Hold("gfu1", JOB_A, 100.0, ("n0", "n1"))
    held = {h: ["node 0 (n0)", "node 1 (n1)"]}
    with pytest.raises(
        UserError, match=rf"^job {JOB_A} is gfu1's \(gfu1's job {JOB_A}, since .* holds node 0 \(n0\), "
    ):
        refuse_others_job(JOB_A, "gfu2", held)
    refuse_others_job(JOB_A, "gfu1", held)  # one's own: the record says the rest
    refuse_others_job(JOB_B, "gfu2", held)  # not held: `no job` comes from the record
    assert holds_summary(held) == f"held: gfu1's job {JOB_A} (2 nodes)" and holds_summary({}) == "held by no job"
    watch = HoldsWatch(lambda: held, every_s=0.01).start()
    try:
        wait_for(lambda: watch.summary() == f"  (held: gfu1's job {JOB_A} (2 nodes))", 60, "the first read")
    finally:
        watch.stop()
