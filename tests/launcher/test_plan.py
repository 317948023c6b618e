"""The launch plan (launcher.runner): what a launch will do, decided before it connects to run
anything; --dry-run prints it and connects to nothing; each node's program is rendered once per
launch, attached or detached."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.core import program
from launcher.core.program import ProgramBuilder
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.runner import plan, plan_detached
from tests.launcher import dry_runs
from tests.launcher.test_jobs_cluster import cluster as detached_cluster
from tests.support import source_args, torch_args

# TEST-NET-1 (RFC 5737): nothing answers there; a dry run never tries.
HOSTS = ["192.0.2.10", "192.0.2.11", "192.0.2.12"]


@pytest.fixture
def ssh_spy(tmp_path, monkeypatch) -> Path:
    """An `ssh` first on PATH that records that it ran (and fails): a dry run must never run it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "ssh-called"
    spy = bin_dir / "ssh"
    spy.write_text(f'#!/bin/sh\necho "$@" >> {called}\nexit 255\n')
    spy.chmod(spy.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return called


@pytest.fixture
def render_count(monkeypatch) -> list[int]:
    """How many node programs this process renders."""
    count = [0]
    render = program.NodeProgram.render

    def counted(self):
        count[0] += 1
        return render(self)

    monkeypatch.setattr(program.NodeProgram, "render", counted)
    return count


def _hostfile(tmp_path: Path) -> Path:
    f = tmp_path / "hosts"
    f.write_text("".join(f"{h}\n" for h in HOSTS))
    return f


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--steps", "2"],
        ["run", "--", "train.py"],
        ["exec", "--", "hostname"],
        ["nccl-tests", "-b", "1M", "-e", "1M"],
    ],
    ids=["train", "run", "exec", "nccl-tests"],
)
def test_a_dry_run_prints_the_plan_and_connects_to_nothing(tmp_path, ssh_spy, render_count, args):
    kind, rest = args[0], args[1:]
    r = CliRunner().invoke(main, [kind, "--hostfile", str(_hostfile(tmp_path)), "--dry-run", *rest])
    assert r.exit_code == 0, r.output
    # A block per node, or a line for each node folded under node 0's.
    assert dry_runs.headers(r.stdout) == list(enumerate(HOSTS)), r.stdout
    assert not ssh_spy.exists(), ssh_spy.read_text()
    assert render_count[0] == len(HOSTS)  # each node's program rendered once
    # Nothing written for a connection: no known_hosts file was made.
    assert not (tmp_path / "state" / "known_hosts").exists()


@pytest.mark.parametrize(
    "args", [["train", "--steps", "2"], ["run", "--", "train.py"], ["exec", "--", "hostname"]], ids=str
)
def test_a_json_dry_run_holds_each_nodes_remote_command_and_connects_to_nothing(tmp_path, ssh_spy, args):
    kind, rest = args[0], args[1:]
    r = CliRunner().invoke(main, [kind, "--hostfile", str(_hostfile(tmp_path)), "--dry-run=json", *rest])
    assert r.exit_code == 0, r.output
    lines = dry_runs.remote_lines(r.stdout)
    assert [host for host, _ in lines] == HOSTS
    assert all(remote.startswith("exec bash --norc --noprofile -c ") for _, remote in lines)
    assert not ssh_spy.exists(), ssh_spy.read_text()


def test_json_is_only_for_the_commands_that_launch(tmp_path):
    r = CliRunner().invoke(main, ["hosts", "--hostfile", str(_hostfile(tmp_path)), "--dry-run=json"])
    assert r.exit_code == 2 and "json is for launch run, train, exec, nccl-tests; use --dry-run here" in r.output


def test_the_plan_holds_the_order_the_programs_and_the_typed_plans(tmp_path):
    nodes = tuple(Node(i, h, h) for i, h in enumerate(HOSTS))
    cluster = Cluster("c", nodes)
    config = LaunchConfig(Workload("torchrun", ("train.py",)), job_id="plan1", dry_run=True)
    p = plan(cluster, config)
    assert p.cluster.nodes == nodes and "given" in p.order_message
    assert dict(p.programs) == ProgramBuilder(cluster, config).build()
    assert dict(p.plans) == ProgramBuilder(cluster, config).plans()
    assert p.remote_commands() == [p.transport.display(n, p.programs[n.rank]) for n in nodes]


def test_bad_input_is_refused_before_any_node_is_asked(tmp_path, ssh_spy):
    """An unknown machine type with --rank-order topology (which asks the nodes where they sit):
    one UserError naming the type, and ssh never ran."""
    nodes = tuple(Node(i, h, h) for i, h in enumerate(HOSTS))
    cluster = Cluster("c", nodes, machine_type="a3-mega")
    config = LaunchConfig(Workload("torchrun", ("train.py",)), job_id="plan2", rank_order="topology")
    with pytest.raises(UserError, match="a3-mega"):
        plan(cluster, config)
    assert not ssh_spy.exists()


def test_a_detached_plan_refuses_local_and_dry_run(tmp_path):
    local = Cluster("l", (Node(0, "127.0.0.1", "127.0.0.1"),), local=True)
    config = LaunchConfig(Workload("exec", ("true",)), job_id="plan3", controller_grace_s=60)
    with pytest.raises(UserError, match="--detach needs SSH nodes"):
        plan_detached(local, config)
    ssh = Cluster("c", (Node(0, HOSTS[0], HOSTS[0]),))
    with pytest.raises(UserError, match="--detach and --dry-run"):
        plan_detached(ssh, LaunchConfig(Workload("exec", ("true",)), job_id="plan4", dry_run=True))


@pytest.mark.cluster
def test_a_detached_launch_renders_each_node_program_once_on_the_launching_machine(sim_cluster, tmp_path, render_count):
    c = detached_cluster(sim_cluster, tmp_path, 2)
    r = CliRunner().invoke(main, ["exec", *source_args(c, tmp_path), "--detach", "--", "true"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("job ")
    # The check's programs, with the key authorization as their prologue; the controller renders
    # its own on node 0 (another process) from the same request.
    assert render_count[0] == 2


def _config_walk(invoke) -> list[str]:
    """The launcher modules a detached launch's config walks through, in order: every call into a
    launcher module whose arguments hold the LaunchConfig (or a plan, or a `self` holding one),
    from the first call that gets the detached config (controller_grace_s set); the config's own
    methods (a property read) left out; consecutive calls in one module are one stop."""
    launcher_dir = str(Path(program.__file__).resolve().parents[1])
    stops: list[str] = []
    started = False

    def holds(v) -> LaunchConfig | None:
        if isinstance(v, LaunchConfig):
            return v
        cfg = getattr(v, "config", None)
        return cfg if isinstance(cfg, LaunchConfig) else None

    def profile(frame, event, arg) -> None:
        nonlocal started
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(launcher_dir):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if names[:1] == ("self",) and isinstance(frame.f_locals.get("self"), LaunchConfig):
            return
        held = [c for c in (holds(frame.f_locals.get(n)) for n in names) if c is not None]
        if not held or not (started or any(c.controller_grace_s is not None for c in held)):
            return
        started = True
        module = Path(code.co_filename).relative_to(Path(launcher_dir).parent).with_suffix("").as_posix()
        if not stops or stops[-1] != module:
            stops.append(module)

    sys.setprofile(profile)
    try:
        invoke()
    finally:
        sys.setprofile(None)
    return stops


@pytest.mark.cluster
def test_a_detached_launchs_config_enters_each_module_at_most_twice(sim_cluster, tmp_path):
    c = detached_cluster(sim_cluster, tmp_path, 2)
    args = ["train", *source_args(c, tmp_path), *torch_args(), "--detach", "--", "--steps", "1"]
    result = []
    walk = _config_walk(lambda: result.append(CliRunner().invoke(main, args)))
    assert result[0].exit_code == 0, result[0].output
    entered = {m: walk.count(m) for m in walk}
    assert {"launcher/runner/plan", "launcher/core/program", "launcher/jobs/handoff"} <= entered.keys(), walk
    assert max(entered.values()) <= 2, " -> ".join(walk)
