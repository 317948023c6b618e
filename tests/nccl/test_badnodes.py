"""The bad-node finder in bounded time: the round plan it hands the sweep, the
rule that skips the confirming pass, and the finder on a simulated cluster with a throttled link."""

from __future__ import annotations

import json
import re
import signal

import pytest
from click.testing import CliRunner

from gpufleet.contracts import JSON_MARKER
from gpufleet.groups import format_rounds, group_documents, parse_rounds
from launcher.cli.main import main
from launcher.nccl import badnodes
from tests.support import Launch, source_args, torch_args, wait_for, workers

# ---- the plan: launcher -> sweep -------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 4, 7, 16])
def test_the_pair_schedule_survives_the_plan_text(n):
    hosts = [f"h{i}" for i in range(n)]
    plan = [[tuple(hosts.index(h) for h in p) for p in rnd] for rnd in badnodes.pair_schedule(hosts)]
    text = format_rounds(plan)
    assert parse_rounds(text) == plan
    assert text.count(";") == len(plan) - 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0+1,1+2", "round 1: node 1 appears twice"),
        ("0+1;2+2", "round 2: node 2 appears twice"),
        ("0+1,a+2", "round 1: group 'a+2' is not node ranks"),
        ("0+1,,2+3", "round 1: group '' is not node ranks"),
        ("0-1", "group '0-1' is not node ranks"),
    ],
)
def test_a_bad_plan_names_the_round_and_the_part(text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_rounds(text)


def test_group_documents_are_the_json_lines_with_nodes_and_skip_a_torn_one():
    doc = {"version": 1, "round": 0, "nodes": [0, 3], "nranks": 2, "rows": [{"size": 8}]}
    plain = {"version": 1, "nranks": 2, "rows": []}  # a sweep without --rounds
    text = "\n".join(
        [
            "# round 1: nodes 0+3",
            JSON_MARKER + json.dumps(doc),
            JSON_MARKER + json.dumps(plain),
            JSON_MARKER + json.dumps(doc)[:20],  # its node died mid-line
        ]
    )
    assert group_documents(text) == [doc]


# ---- when the pairs settle it ------------------------------------------------------------------


def _pairs(nodes: list[str], slow: set[str], fast: float = 10.0, slow_bw: float = 0.1) -> dict:
    return {(a, b): (slow_bw if {a, b} & slow else fast) for i, a in enumerate(nodes) for b in nodes[i + 1 :]}


def test_a_node_far_below_every_other_pair_is_decisive():
    nodes = [f"n{i}" for i in range(6)]
    report = badnodes.rank_nodes(_pairs(nodes, {"n4"}))
    assert report.bad == ["n4"] and report.decisive


def test_overlapping_pairs_are_not_decisive_and_need_the_halves():
    nodes = [f"n{i}" for i in range(6)]
    pairs = _pairs(nodes, {"n4"}, slow_bw=5.0)
    pairs[("n0", "n1")] = 5.5  # one healthy pair nearly as slow as the suspect's
    report = badnodes.rank_nodes(pairs)
    assert report.bad == ["n4"]
    assert not report.decisive  # 5.0 is not below 0.8 x 5.5


def test_nothing_named_or_no_clean_pair_is_not_decisive():
    nodes = [f"n{i}" for i in range(4)]
    assert not badnodes.rank_nodes(_pairs(nodes, set())).decisive
    three = {("a", "b"): 0.1, ("a", "c"): 0.1, ("b", "c"): 0.1}
    assert not badnodes.BadNodeReport({}, {"a": {"b": 0.1}, "b": {"a": 0.1}}, 0.1, 0.8, ["a", "b"]).decisive
    assert not badnodes.rank_nodes(three).decisive


def test_a_bad_pair_budget_is_one_line_before_anything_runs(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n192.0.2.11\n192.0.2.12\n")  # TEST-NET-1: nothing answers there
    for value in ("0", "-1", "nan"):
        r = CliRunner().invoke(
            main,
            [
                "nccl-tests",
                "--hostfile",
                str(hf),
                "--find-bad-nodes",
                "--pair-budget",
                value,
                "--runs-dir",
                str(tmp_path / "runs"),
            ],
        )
        assert r.exit_code == 2, r.output
        assert f"error: --pair-budget {float(value)} must be a number of seconds > 0" in r.output
    assert not (tmp_path / "runs").exists()


# ---- the finder on a cluster with a throttled link ---------------------------------------------

# 8 MiB all_reduce: one call between the throttled node and another moves 8 MiB each way, ~1.7 s
# at 40 Mbit/s. Timed in full (-w 1, then per block 1 untimed + -n 20 + -c 1) a slow pair makes
# 45 calls, ~75 s, in each of the 3 rounds: over 200 s. Under --pair-budget 0.5 it makes one.
BOUNDED = ["--ops", "all_reduce", "-b", "8M", "-e", "8M", "-n", "20", "-w", "1", "-c", "1", "--pair-budget", "0.5"]


@pytest.mark.cluster
@pytest.mark.slow
def test_a_throttled_node_is_named_in_bounded_time_by_its_pairs_one_call_each(sim_cluster, tmp_path):
    c = sim_cluster(4, mode="netns")
    c.throttle(2, "40mbit")
    slow = c.nodes[2].address
    r = CliRunner().invoke(main, ["nccl-tests", *source_args(c, tmp_path), *torch_args(), *BOUNDED, "--find-bad-nodes"])
    assert r.exit_code == 1, r.output
    assert f"--exclude {slow}\n" in r.output and f"{slow}: busbw " in r.output
    pair_lines = [l for l in r.output.splitlines() if l.startswith("pair ")]
    assert len(pair_lines) == 6
    # Every pair with the slow node was answered by its first call alone; no other pair was.
    for line in pair_lines:
        cut = "(1 of 20 timed calls fit --pair-budget 0.5 s)" in line
        assert cut == (slow in line.split(":")[0]), line
    # The rows behind them say so too: one timed call, the in-place block not run.
    (parent,) = (tmp_path / "runs").iterdir()
    (pairs_run,) = parent.glob("*-pairs")
    text = "".join(p.read_text() for p in pairs_run.glob("node-*.log"))
    docs = group_documents(text)
    assert len(docs) == 6
    for doc in docs:
        (row,) = doc["rows"]
        has_slow = 2 in doc["nodes"]
        assert (row["iters"] == 1 and row["ip_busbw"] is None) == has_slow, doc
        assert row["oop_wrong"] == 0  # the one call was checked
    assert "no confirming pass" in r.output
    c.assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.slow
def test_when_the_pairs_do_not_settle_it_the_halves_run_in_one_more_launch(sim_cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(badnodes.BadNodeReport, "decisive", property(lambda self: False))
    c = sim_cluster(4, mode="netns")
    c.throttle(1, "40mbit")
    slow = c.nodes[1].address
    r = CliRunner().invoke(
        main,
        [
            "nccl-tests",
            *source_args(c, tmp_path),
            *torch_args(),
            "--ops",
            "all_reduce",
            "-b",
            "512K",
            "-e",
            "512K",
            "-n",
            "5",
            "--find-bad-nodes",
        ],
    )
    assert r.exit_code == 1, r.output
    (line,) = [l for l in r.output.splitlines() if l.startswith("clean half ")]
    clean, suspect = (re.search(rf"{name} half (\S+): ([\d.]+) GB/s", line).groups() for name in ("clean", "suspect"))
    assert slow in suspect[0].split(",") and slow not in clean[0].split(",")
    assert float(suspect[1]) < 0.8 * float(clean[1])
    assert "did not confirm" not in r.output and f"--exclude {slow}\n" in r.output
    (parent,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name.rsplit("-", 1)[1] for p in parent.iterdir() if p.is_dir()) == ["halves", "pairs"]
    c.assert_nothing_left()


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_pairs_stops_every_node_and_gives_no_verdict(sim_cluster, tmp_path, signum):
    """The search leaves signals to Launch: the running launch stops its nodes in order, the
    search starts no other launch, and it ends with 128+signal and no verdict."""
    c = sim_cluster(3, mode="netns")
    # Long enough that the signal lands while the pairs' sweep runs: 1000 timed 8 MiB calls a size.
    args = [
        "nccl-tests",
        *source_args(c, tmp_path),
        *torch_args(),
        "--ops",
        "all_reduce",
        "-b",
        "8M",
        "-e",
        "8M",
        "-n",
        "1000",
        "--pair-budget",
        "600",
        "--find-bad-nodes",
    ]
    run = Launch(args, tmp_path / "launch.out")
    try:
        wait_for(lambda: all(workers(c, i) for i in range(3)), 120, "sweep workers on every node", run)
        run.signal(signum)
        assert run.wait(60) == 128 + signum, run.out
    finally:
        run.kill()
    name = signal.Signals(signum).name
    assert f"stopped on {name}; no verdict" in run.out, run.out
    assert "--exclude" not in run.out and not [l for l in run.out.splitlines() if l.startswith("pair ")]
    (parent,) = (tmp_path / "runs").iterdir()
    assert [p.name.rsplit("-", 1)[1] for p in parent.iterdir() if p.is_dir()] == ["pairs"]  # no halves
    c.assert_nothing_left()
