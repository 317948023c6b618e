"""Each node's typed plan (gpufleet.node_plan, filled by launcher.core.program from the same parts
its program is rendered from): it round-trips through JSON, it agrees with the program the node
runs, its --env values are never in it, and the readable dry run folds identical nodes so a
16-node launch stays a page. Pure: nothing connects."""

from __future__ import annotations

import json
import shlex

import pytest

from gpufleet.node_plan import SCHEMA_VERSION, CheckKind, EnvSource, EnvVar, NodePlan, PlanError, PrepareKind
from launcher.core.node_plan import container_of
from launcher.core.program import ProgramBuilder
from launcher.core.types import Cluster, LaunchConfig, Node, Workload
from launcher.runner import dry_run, plan

SECRET = "hf_s3cret-value"
HOSTS = [f"10.0.0.{i}" for i in range(2, 18)]  # 16 nodes


def _cluster(n: int = 4, machine_type: str | None = "a3-megagpu-8g", slots: dict[int, int] | None = None) -> Cluster:
    nodes = tuple(Node(i, h, h, slots=(slots or {}).get(i)) for i, h in enumerate(HOSTS[:n]))
    return Cluster("c", nodes, machine_type=machine_type)


def _config(**kw) -> LaunchConfig:
    base = dict(
        workload=Workload("torchrun", ("train.py", "--steps", "3", '"; rm -rf ~')),
        job_id="20260101-120000-abcdef",
        env=(("HF_TOKEN", SECRET), ("PATH", "/opt/env/bin")),
        workdir="/home/USER/job",
        python="/home/USER/env/bin/python",
        prepared=("/home/USER/job", "/home/USER/env/bin/python", "/home/USER/.gpufleet/snap/abc"),
        image="us-docker.pkg.dev/p/r/train:1",
        dry_run=True,
    )
    return LaunchConfig(**{**base, **kw})


def _built(cluster: Cluster, config: LaunchConfig):
    programs = ProgramBuilder(cluster, config).programs()
    return {r: p.plan() for r, p in programs.items()}, {r: p.render() for r, p in programs.items()}


def test_a_plan_round_trips_through_json_and_refuses_another_schema():
    plans, _ = _built(_cluster(), _config())
    for p in plans.values():
        assert NodePlan.from_json(p.to_json()) == p
        assert json.loads(p.to_json())["schema"] == SCHEMA_VERSION
    d = plans[0].to_dict()
    with pytest.raises(PlanError, match=f"plan schema 99; this reads schema {SCHEMA_VERSION}"):
        NodePlan.from_dict({**d, "schema": 99})
    with pytest.raises(PlanError, match="'checks'"):
        NodePlan.from_dict({k: v for k, v in d.items() if k != "checks"})


def test_a_value_on_stdin_is_never_part_of_a_plan():
    with pytest.raises(ValueError, match="HF_TOKEN: a value that travels on stdin"):
        EnvVar("HF_TOKEN", SECRET, EnvSource.STDIN)
    plans, programs = _built(_cluster(), _config())
    for p, program in zip(plans.values(), programs.values()):
        assert SECRET not in p.to_json() and SECRET not in program
        hidden = [v for v in p.env if v.hidden]
        assert [(v.name, v.value) for v in hidden] == [("HF_TOKEN", None), ("PATH", None)]
        # The node reads exactly those from stdin (launcher.core.node_start), PATH before the node's own.
        assert [v.prepend for v in hidden] == [False, True]


def test_the_plan_agrees_with_the_program_it_was_rendered_with():
    plans, programs = _built(_cluster(), _config())
    for rank, p in plans.items():
        program = programs[rank]
        assert (p.node_rank, p.address, p.nnodes, p.procs, p.ranks) == (
            rank,
            HOSTS[rank],
            4,
            8,
            (8 * rank, 8 * rank + 7),
        )
        # The rank command is torchrun's, the hostile argument one literal argument, inside the
        # container's argv; the program hands the plan itself to the node's side
        # (launcher.core.node_run), which starts that argv as it stands.
        assert p.command[-1] == '"; rm -rf ~' and f"--node-rank={rank}" in p.command
        assert program.endswith(" node " + shlex.quote(p.to_json())) and p.argv[-len(p.command) :] == p.command
        assert p.container is not None and p.container.image == "us-docker.pkg.dev/p/r/train:1"
        assert all(any(f"src={m.host},dst={m.container}" in a for a in p.argv) for m in p.container.mounts)
        assert {v.name: v.value for v in p.env}["GPUFLEET_RUN"] == f"20260101-120000-abcdef-{rank}"
        kinds = [c.kind for c in p.checks]
        nics = [c.target for c in p.checks if c.kind is CheckKind.NIC]
        assert len(nics) == 9 and len(set(nics)) == 9
        assert [c.target for c in p.checks if c.kind is CheckKind.RXDM] == ["receive-datapath-manager"]
        assert (CheckKind.RDZV_PORT in kinds) == (rank == 0)
        assert CheckKind.TORCH_VERSION not in kinds  # with --image, torch is the image's
        assert [(s.kind, s.path) for s in p.prepare] == [
            (PrepareKind.WORKDIR, "/home/USER/job"),
            (PrepareKind.DIRECTORY, "/home/USER/job"),
            (PrepareKind.ENVIRONMENT, "/home/USER/env/bin/python"),
            (PrepareKind.PREPARED, "/home/USER/.gpufleet/snap/abc"),
            (PrepareKind.LOCAL_DIR, p.prepare[-1].path),
        ]
        assert len(p.prepare[-1].path) == 16  # the compile caches' key (launcher.core.node_local)
        assert (p.limits.term_grace_s, p.limits.watch_preemption) == (25, True)


def test_ranks_follow_the_slots_and_are_unknown_under_c10d_and_for_a_plain_command():
    plans, _ = _built(_cluster(3, machine_type=None, slots={0: 2, 1: 1, 2: 4}), _config(image=None))
    assert [(p.procs, p.ranks) for p in plans.values()] == [(2, (0, 1)), (1, (2, 2)), (4, (3, 6))]
    assert all(CheckKind.TORCH_VERSION in [c.kind for c in p.checks] for p in plans.values())
    c10d, _ = _built(_cluster(2), _config(max_restarts=2))
    assert [(p.procs, p.ranks) for p in c10d.values()] == [(8, None), (8, None)]
    plain, _ = _built(_cluster(2), _config(workload=Workload("exec", ("hostname",)), image=None))
    assert [(p.procs, p.ranks, p.command, p.argv, p.container) for p in plain.values()] == [
        (1, None, ("hostname",), ("hostname",), None)
    ] * 2


def test_an_argv_that_is_no_containers_has_no_container():
    assert container_of(["python3", "-m", "torch.distributed.run", "t.py"]) == (
        None,
        ["python3", "-m", "torch.distributed.run", "t.py"],
    )


def test_a_16_node_dry_run_is_node_0_in_full_and_a_line_per_other_node():
    p = plan(_cluster(16), _config())
    lines = dry_run.text(p)
    assert lines[0] == "node 0  10.0.0.2  ranks 0-7 (8 processes)"
    fold = lines.index(
        "nodes 1-15: as node 0 without the rendezvous-port lock, each with its own address, node rank and ranks:"
    )
    assert lines[fold + 1 :] == [
        f"  node {i}  {HOSTS[i]}  ranks {8 * i}-{8 * i + 7} (8 processes)" for i in range(1, 16)
    ]
    assert fold < 40 and len("\n".join(lines)) < 6000, "\n".join(lines)
    text = "\n".join(lines)
    assert SECRET not in text and "HF_TOKEN=<hidden: --env, on stdin>" in text
    assert "  run      /home/USER/env/bin/python -m torch.distributed.run --nnodes=16 --nproc-per-node=8" in text
    assert shlex.quote('"; rm -rf ~') in text
    assert "  image    us-docker.pkg.dev/p/r/train:1 as container gpufleet-20260101-120000-abcdef-0" in text
    assert "  prepare  cd /home/USER/job" in text and "  mounts   /var/lib/tcpxo/lib64 (read-only)" in text


def test_a_node_that_differs_gets_a_block_of_its_own():
    # Node 2 runs 4 ranks where the others run 8: its command differs (--nproc-per-node), so it
    # is not folded into node 0's; nodes 1 and 3 are.
    p = plan(_cluster(4, slots={2: 4}), _config(image=None))
    text = dry_run.text(p)
    headers = [line for line in text if line.startswith(("node", "nodes", "  node"))]
    assert headers == [
        "node 0  10.0.0.2  ranks 0-7 (8 processes)",
        "node 1: as node 0 without the rendezvous-port lock, each with its own address, node rank and ranks:",
        "  node 1  10.0.0.3  ranks 8-15 (8 processes)",
        "node 2  10.0.0.4  ranks 16-19 (4 processes)",
        "node 3: as node 0 without the rendezvous-port lock, each with its own address, node rank and ranks:",
        "  node 3  10.0.0.5  ranks 20-27 (8 processes)",
    ]


def test_the_json_dry_run_holds_every_plan_and_program():
    p = plan(_cluster(4), _config())
    doc = json.loads(dry_run.as_json(p))
    assert doc["schema"] == SCHEMA_VERSION and doc["stdin"] == ["HF_TOKEN", "PATH"]
    assert [NodePlan.from_dict(n["plan"]) for n in doc["nodes"]] == [p.plans[r] for r in range(4)]
    assert [n["program"] for n in doc["nodes"]] == [p.programs[r] for r in range(4)]
    assert [shlex.split(n["remote"])[-1] for n in doc["nodes"]] == [p.programs[r] for r in range(4)]
    assert SECRET not in dry_run.as_json(p)
