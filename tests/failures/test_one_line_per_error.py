"""A failing worker, as the user sees it: real torchrun groups under `launch run --local`.

The live stream shows the worker's own error line once and a traceback of the user's code once
(from the first rank that raised it); torchrun's agent lines and its `ChildFailedError` report
stay in the node's log, whose path the launcher's one line prints; the launcher exits with the
worker's own status, the same on every run."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.support import LAUNCH
from tests.workloads.conftest import free_port

# Every rank reaches init_process_group, so the gloo group forms and the excepthook prefixes
# each traceback line with "[rankN]: "; then each rank fails on its own, all the same way.
SCRIPT = textwrap.dedent(
    """\
    import sys
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()


    def check(rows):
        raise ValueError(f"the data has {rows} rows on rank {rank}")


    if sys.argv[1] == "exit":
        if rank == 0:
            print("error: the data has 3 rows, fewer than the world size", file=sys.stderr, flush=True)
        sys.exit(7)
    check(3)
    """
)
AGENT_LINE = re.compile(r"^(?:\[node \d\] )?[IWEF]\d{4} \d\d:\d\d:\d\d", re.M)


def _run(tmp_path: Path, nodes: int, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    runs = tmp_path / "runs"
    p = subprocess.run(
        [LAUNCH, "run", "--local", "--nodes", str(nodes), "--rdzv-port", str(free_port()), "--runs-dir", str(runs)]
        + ["--", str(script), mode],
        capture_output=True,
        text=True,
        timeout=240,
    )
    return p, runs


def _failed_first(p: subprocess.CompletedProcess) -> tuple[int, Path]:
    """The launcher's one line on the failure: the node it names and the log it points to."""
    (line,) = [x for x in p.stderr.splitlines() if "failed first" in x]
    m = re.match(r"node (\d+) \(localhost\) failed first: .*; its log: (\S+)$", line)
    assert m, line
    return int(m.group(1)), Path(m.group(2))


def _nothing_of_torchruns_live(p: subprocess.CompletedProcess) -> None:
    live = p.stdout + p.stderr
    assert "ChildFailedError" not in live and "Root Cause" not in live, live
    assert not AGENT_LINE.search(live), live
    assert "torch/distributed/run.py" not in live, live


@pytest.mark.parametrize("attempt", range(3))
def test_a_worker_error_line_is_shown_once_and_the_launcher_exits_with_the_workers_status(tmp_path, attempt):
    p, runs = _run(tmp_path, 3, "exit")
    out = p.stdout + p.stderr
    # The worker's status, every time: not torchrun's 1, nor the 143 of a node the launcher stopped.
    assert p.returncode == 7, out
    assert p.stdout.count("error: the data has 3 rows") == 1, out
    (error_line,) = [x for x in p.stdout.splitlines() if "error: the data has 3 rows" in x]
    node, log = _failed_first(p)
    assert error_line.startswith(f"[node {node}] error: "), out  # the cause is the node that said why
    assert "worker local_rank 0" in out and "exit 7" in out, out
    _nothing_of_torchruns_live(p)
    # What the live stream left out is in the named node's log.
    assert log.parent.parent == runs and log.is_file(), log
    text = log.read_text()
    assert "error: the data has 3 rows" in text
    assert "failed (exitcode: 7)" in text and "ChildFailedError" in text, text


def test_a_user_traceback_raised_on_every_rank_is_shown_once_and_torchruns_report_is_in_the_log(tmp_path):
    p, runs = _run(tmp_path, 2, "raise")
    out = p.stdout + p.stderr
    assert p.returncode == 1, out  # Python's status for an uncaught exception
    assert p.stdout.count("Traceback (most recent call last):") == 1, out
    assert len(re.findall(r"ValueError: the data has 3 rows on rank \d", p.stdout)) == 1, out
    assert re.search(r'\[node \d\] \[rank\d\]:   File ".*fails.py", line \d+, in check', p.stdout), out
    _nothing_of_torchruns_live(p)
    node, log = _failed_first(p)
    assert log.is_file(), log
    text = log.read_text()
    assert "ValueError: the data has 3 rows" in text and "ChildFailedError" in text, text
    assert "failed (exitcode: 1)" in text
    # Every node's own traceback stays in its own log.
    for other in runs.glob("*/node-*.log"):
        assert "[rank" in other.read_text(), other


# ---- an unknown machine type: one line, exit 2, on every path ---------------------------------

# Every command that takes a cluster, and the paths through them that check the workload against
# the nodes (GPU count, memory plan, NICs) before anything starts: attached, dry run, detached.
UNKNOWN_TYPE_PATHS = [
    ["train", "--dry-run"],
    ["train"],
    ["train", "--detach"],
    ["train", "--dry-run", "--nproc-per-node", "2", "--tp", "2"],
    ["run", "--dry-run", "--", "a.py"],
    ["run", "--detach", "--", "a.py"],
    ["exec", "--", "true"],
    ["nccl-tests", "--dry-run"],
    ["nccl-tests", "--detach"],
    ["nccl-tests", "--impl", "nccl-tests", "--dry-run"],
    ["doctor", "--dry-run"],
    ["hosts", "--dry-run"],
    ["top", "--dry-run"],
    ["jobs"],
]


def _outputs(tmp_path: Path, machine_type: str) -> Path:
    nodes = [
        {"name": f"dev-{i}", "index": i, "internalIp": f"192.0.2.{10 + i}", "externalIp": None, "zone": "us-central1-a"}
        for i in range(2)
    ]
    path = tmp_path / "o.json"
    path.write_text(
        json.dumps(
            {"cluster": "dev", "project": "p", "zone": "us-central1-a", "machineType": machine_type, "nodes": nodes}
        )
    )
    return path


@pytest.mark.parametrize("args", UNKNOWN_TYPE_PATHS, ids=" ".join)
def test_an_unknown_machine_type_in_the_outputs_is_one_line_with_the_known_types(tmp_path, args):
    outputs = _outputs(tmp_path, "a3-mega")
    cmd, rest = args[0], args[1:]
    runs = tmp_path / "runs"
    p = subprocess.run(
        [LAUNCH, cmd, "--outputs", str(outputs), "--runs-dir", str(runs), *rest],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith(f"error: {outputs}: machineType 'a3-mega' is unknown; one of: "), lines[0]
    assert "a3-megagpu-8g" in lines[0] and not runs.exists()


def test_an_unknown_machine_type_given_for_a_hostfile_names_the_flag(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("192.0.2.10\n")
    p = subprocess.run(
        [LAUNCH, "train", "--hostfile", str(hosts), "--machine-type", "a3-mega", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("error: --machine-type: machineType 'a3-mega' is unknown; one of: ")
