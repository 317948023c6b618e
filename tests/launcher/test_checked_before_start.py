"""What the launching machine refuses or warns about before any node starts: sweep sizes the nodes
would refuse, a --term-grace longer than a Spot VM's notice allows, and ids and variable names with
a trailing newline (checked with re.fullmatch; `$` also matches before a final newline)."""

from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.core.env import parse_env_pairs
from launcher.core.types import UserError
from launcher.jobs.record import check_job_id
from tests.launcher.fake_gpu_node import FakeMetadata
from tests.simcluster import SimCluster
from tests.support import LAUNCH, source_args


@pytest.mark.parametrize(
    "flags, line",
    [
        (["-b", "8G", "-e", "8"], "error: -b 8G -e 8 -f 2: minbytes 8G is larger than maxbytes 8; swap -b and -e"),
        (["-b", "8Q"], "error: -b 8Q: size '8Q' is not understood;"),
        (["-e", "1T"], "error: -e 1T: size '1T' is not understood;"),
        (["-b", "0", "-e", "8"], "error: -b 0 -e 8 -f 2: minbytes 0 with a step factor never grows"),
    ],
)
@pytest.mark.parametrize("mode", [[], ["--detach"], ["--impl", "nccl-tests"], ["--find-bad-nodes"]])
def test_sweep_sizes_the_nodes_would_refuse_are_refused_here_before_anything_starts(tmp_path, flags, line, mode):
    hosts = tmp_path / "hosts"
    hosts.write_text("192.0.2.10\n192.0.2.11\n")  # TEST-NET-1: a launch that got as far as SSH would fail there
    runs = tmp_path / "runs"
    r = CliRunner().invoke(main, ["nccl-tests", "--hostfile", str(hosts), "--runs-dir", str(runs), *mode, *flags])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(line) and r.output.count("\n") == 1, r.output
    assert not runs.exists()


def test_a_sweep_that_steps_by_bytes_is_accepted():
    r = CliRunner().invoke(
        main, ["nccl-tests", "--local", "--nodes", "1", "-b", "8", "-e", "8M", "-f", "1", "--dry-run"]
    )
    assert r.exit_code == 0, r.output
    assert "-b 8 -e 8M -f 1" in r.output


def test_a_term_grace_longer_than_a_spot_notice_is_warned_about_before_the_start(tmp_path):
    # Real sshd nodes, each asking its own metadata server (GCE_METADATA_HOST) as a VM does:
    # node 1 is a Spot VM, node 0 is not.
    c = SimCluster(2, workdir=tmp_path / "sim")
    metadata = [FakeMetadata(None, reach_at=c.gateway, spot=spot) for spot in (False, True)]
    c.node_env = {i: {"GCE_METADATA_HOST": m.host} for i, m in enumerate(metadata)}
    try:
        c.start()
        src = source_args(c, tmp_path)

        def launch(*grace: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [LAUNCH, "exec", *src, *grace, "--", "true"], capture_output=True, text=True, timeout=120
            )

        p = launch("--term-grace", "40s")
        assert p.returncode == 0, p.stderr
        said = [line for line in p.stderr.splitlines() if "Spot nodes" in line]
        assert said == [
            f"--term-grace 40 s on Spot nodes (node 1 ({c.addresses[1]})): a preemption gives 30 s from "
            "notice to stop, so the ranks may be killed with the VM before their grace ends; give at most 25s "
            "(https://cloud.google.com/compute/docs/instances/spot)"
        ], p.stderr
        asked = [q for m in metadata for q in m.requests if q == FakeMetadata.PREEMPTIBLE]
        assert len(asked) == 2
        # Within the notice, or the default 25 s: nothing said, and nothing asked.
        for grace in (["--term-grace", "25s"], []):
            p = launch(*grace)
            assert p.returncode == 0 and "Spot" not in p.stderr, p.stderr
        assert len([q for m in metadata for q in m.requests if q == FakeMetadata.PREEMPTIBLE]) == 2
    finally:
        c.stop()
        for m in metadata:
            m.close()


@pytest.mark.parametrize(
    "job_id", ["20260101-120000-abcdef\n", "20260101-120000-abcdef\n\n", " 20260101-120000-abcdef"]
)
def test_a_job_id_with_a_newline_is_refused(job_id):
    with pytest.raises(UserError, match="is not a job id"):
        check_job_id(job_id)
    r = CliRunner().invoke(main, ["logs", job_id, "--hostfile", "/nonexistent", "--dry-run"])
    assert r.exit_code == 2 and "is not a job id" in r.output


@pytest.mark.parametrize("pair", ["KEY\n=1", "PATH\n=x"])
def test_an_env_key_with_a_trailing_newline_is_refused(pair):
    with pytest.raises(UserError, match="is not a shell variable name"):
        parse_env_pairs([pair])
    assert parse_env_pairs(["KEY=1\n"]) == (("KEY", "1\n"),)  # a value may hold anything
