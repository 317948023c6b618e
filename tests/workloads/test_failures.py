"""What training does when things break (the training side): kill -9 during a save, a slow rank,
an error on one rank, a corrupt checkpoint. A full disk, SIGTERM and a worker killed under
torchrun --max-restarts are checked where a user meets them, through the launcher on the
simulated cluster (tests/failures/test_scenarios.py): the same assertions, one torchrun start
each instead of two."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from tests.faults import HALF_WRITTEN_SAVE
from tests.support import site_dir
from tests.workloads.conftest import (
    kill_tree,
    one_line_exit,
    start,
    train,
    wait_for,
)
from workloads.checkpoint.store import load_checkpoint


def _latest(ckpt) -> str:
    return (ckpt / "latest").read_text().strip()


def _site(tmp_path, code: str) -> dict[str, str]:
    """Env that runs `code` at interpreter start-up in every rank (test-only fault injection from
    outside the product, through Python's sitecustomize hook)."""
    site = site_dir(tmp_path, code)
    return {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_latest_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--global-batch", "4", "--micro-batch", "2", "--checkpoint-dir", str(ckpt), "--straggler-every", "0"]
    # One plain process: every rank's writes stall alike, so more ranks would show nothing more
    # (tests/failures kills one rank of two nodes mid-save).
    proc = start(args + ["--steps", "100", "--checkpoint-every", "2"], env=_site(tmp_path, HALF_WRITTEN_SAVE), nproc=0)
    try:

        def half_written() -> bool:
            return any(f.stat().st_size for d in ckpt.glob(".step_00000004.tmp-*") for f in d.iterdir())

        wait_for(half_written, timeout=120, interval=0.01, proc=proc)
    finally:
        # The machine "dies": every process at once, no handler runs anywhere.
        kill_tree(proc)
    assert [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]  # the torn file is there...
    assert _latest(ckpt) == "step_00000002"  # ...but latest still names the whole one
    assert load_checkpoint(ckpt / "step_00000002")["step"] == 2
    # A resumed run drops the torn file and continues from latest.
    run = train(args + ["--steps", "3", "--resume"], nproc=0)
    assert run.returncode == 0, run.stderr
    assert "at step 2" in run.stdout
    assert not [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]
    assert _latest(ckpt) == "step_00000003"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_slow_rank_is_named_with_its_node_and_host(tmp_path):
    # Rank 1's forward sleeps 50 ms.
    env = _site(
        tmp_path,
        """
        import os, time
        if os.environ.get("RANK") == "1":
            import workloads.model as m
            forward = m.GPT.forward
            def slow(self, *a, **k):
                time.sleep(0.05)
                return forward(self, *a, **k)
            m.GPT.forward = slow
    """,
    )
    run = train(["--steps", "6", "--global-batch", "4", "--micro-batch", "2", "--straggler-every", "3"], env=env)
    assert run.returncode == 0, run.stderr
    warnings = [ln for ln in run.stderr.splitlines() if "straggler:" in ln]
    assert len(warnings) == 2, run.stderr  # one per check (steps 3 and 6), naming only rank 1
    assert f"rank 1 (node 0, host {socket.gethostname()})" in warnings[0]
    assert "rank 0" not in "".join(warnings)


def test_an_error_on_one_rank_only_is_printed_by_that_rank_with_its_host(tmp_path):
    import numpy as np

    data = tmp_path / "tokens.bin"
    (np.arange(4096) % 64).astype(np.uint16).tofile(data)
    # Node 1 lacks the file: rank 1 looks for it under a name that does not exist.
    env = _site(
        tmp_path,
        """
        import os
        if os.environ.get("RANK") == "1":
            import workloads.data as d
            init = d.TokenFile.__init__
            d.TokenFile.__init__ = lambda self, path, *a: init(self, path + ".not-on-this-node", *a)
    """,
    )
    run = train(
        ["--steps", "2", "--global-batch", "4", "--micro-batch", "2", "--data", str(data), "--straggler-every", "0"],
        env=env,
        timeout=90,
    )
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, run.stderr  # rank 0 stops too, quietly: it has nothing to add
    assert errors[0].startswith(
        f"error: rank 1 (host {socket.gethostname()}): --data {data}.not-on-this-node: cannot map it"
    ), errors
    assert "[rank" not in run.stderr and "Traceback" not in run.stderr.split("exitcode")[0]
    assert "exitcode  : 2" in run.stderr


def test_a_corrupt_checkpoint_stops_every_rank_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--global-batch", "4", "--micro-batch", "2", "--checkpoint-dir", str(ckpt), "--straggler-every", "0"]
    assert train(args + ["--steps", "2"], nproc=0).returncode == 0
    shard = ckpt / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    run = train(args + ["--steps", "4", "--resume"], timeout=90)
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith(f"error: {ckpt / 'step_00000002'} is not a readable checkpoint (rank 0: ")
    assert f"point {ckpt / 'latest'} at an older step_*" in errors[0]
    assert "[rank" not in run.stderr and "Traceback" not in run.stderr.split("exitcode")[0]
    assert "exitcode  : 1" in run.stderr
    # A full-state file of the previous release that loads but is not this trainer's checkpoint
    # (no "meta", ...) is named the same way.
    torn = ckpt / "step_00000002.pt"
    torch.save({"step": 2}, torn)
    (ckpt / "latest").write_text("step_00000002.pt\n")
    line, _ = one_line_exit(args + ["--steps", "4", "--resume"], 1)  # main in this process
    assert f"{torn} is not a checkpoint of workloads.train (no model, optimizer" in line
