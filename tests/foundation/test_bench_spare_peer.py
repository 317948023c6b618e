"""bench/bench_spare_peer.py's verdict from a job's record and output: the ratio to the anchor,
the restore's source and the steps thrown away, each against its target."""

from __future__ import annotations

from bench.bench_spare_peer import gcs_reads, report


def _run(to_train_s=12.0, source="peer", restored=120, last_seen=135, state="SUCCEEDED"):
    swap = {"rank": 1, "out": "10.0.0.3", "into": "10.0.0.4"}
    job = {
        "id": "j1",
        "state": state,
        "recoveries": [{"swaps": [swap]}],
        "goodput": {
            "failures": [{"to_train_s": to_train_s, "restored_from": source, "restored_step": restored}],
        },
    }
    out = (
        "".join(f"[node 0] step {s}/1500 | loss 1.0\n" for s in range(last_seen - 2, last_seen + 1))
        + f"[node 0] resumed from the local tier ... restored step {restored} from {source}\n"
        + "[node 0] step 1500/1500 | loss 0.5\n"
    )
    return {"job": job, "out": out, "copied_before": restored}


def test_every_target_met(capsys):
    assert report([9.0, 10.0, 12.0], _run(), 20)
    said = capsys.readouterr().out
    assert "1.20x the anchor (target <= 1.5x: met)" in said and "steps thrown away: 15" in said
    assert "first step in 10.0 s (the median of 9.0, 10.0, 12.0 s)" in said


def test_a_slow_relaunch_a_durable_restore_or_too_much_work_lost_misses(capsys):
    assert not report([9.0, 10.0, 12.0], _run(to_train_s=16.0), 20)
    assert not report([9.0, 10.0, 12.0], _run(source="durable"), 20)
    assert not report([9.0, 10.0, 12.0], _run(restored=100, last_seen=135), 20)  # 35 steps thrown away
    assert not report([9.0, 10.0, 12.0], _run(state="FAILED"), 20)
    assert capsys.readouterr().out.count("MISSED") == 3


def test_the_durable_tier_is_judged_by_its_checkpoint_reads_after_the_loss(tmp_path, capsys):
    log = tmp_path / "gcs.log"
    before = '"GET /download/storage/v1/b/ckpt/o/spare%2Fstep_00000700%2F__0_0.distcp?alt=media HTTP/1.1" 200 -\n'
    log.write_text("[SERVER] All services started\n" + before)
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write('"GET /download/storage/v1/b/ckpt/o/spare%2Flatest?alt=media HTTP/1.1" 200 -\n')
        f.write('"GET /storage/v1/b/ckpt/o/spare%2Fstep_00000700%2F.metadata?fields=name HTTP/1.1" 200 -\n')
    # The pointer and an existence check after the loss: no checkpoint read.
    assert gcs_reads(log, offset) == (2, [])
    assert report([9.0, 10.0, 12.0], {**_run(), "gcs": gcs_reads(log, offset)}, 20)
    assert "2 requests, 0 checkpoint reads (target 0 while a peer copy exists: met)" in capsys.readouterr().out
    with log.open("a") as f:
        f.write(before)
    assert gcs_reads(log, offset) == (3, [before.strip()])
    assert not report([9.0, 10.0, 12.0], {**_run(), "gcs": gcs_reads(log, offset)}, 20)  # restored from peer
    assert "1 checkpoint reads (target 0 while a peer copy exists: MISSED)" in capsys.readouterr().out
    # A durable restore (its step newer than any peer copy) reads it, and says so.
    assert not report([9.0, 10.0, 12.0], {**_run(source="durable"), "gcs": gcs_reads(log, offset)}, 20)
    assert "a durable restore reads it" in capsys.readouterr().out
