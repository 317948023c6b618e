"""The node program's builder (launcher.core.program): its sections in order, its extension points
(a prepare step after `go`, a run wrapper around the rank command, attached and supervised alike),
and bad input refused when the builder is made, before anything is rendered. The programs run
here under bash, as a node's login shell would run them."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from launcher.core.program import NodeContext, ProgramBuilder
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.core.wire import CHECKED_MARKER, EXIT_MARKER, read_env_statements

LOCAL = Cluster("c", (Node(0, "127.0.0.1", "127.0.0.1"),), local=True)


def _config(tmp_path, **kw) -> LaunchConfig:
    kw.setdefault("workload", Workload("exec", (sys.executable, "-c", "import os; print('ran in', os.getcwd())")))
    kw.setdefault("job_id", f"prog-{tmp_path.name}"[:40])
    return LaunchConfig(**kw)


def _run(script: str, go: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """As the launcher does: `go` (or end of input), then stdin held open until the node's output
    ends (end of input is a stop)."""
    p = subprocess.Popen(
        ["bash", "--norc", "--noprofile", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    if go:
        p.stdin.write("go\n")
        p.stdin.flush()
    else:
        p.stdin.close()
    out, err = p.stdout.read(), p.stderr.read()
    if go:
        p.stdin.close()
    return subprocess.CompletedProcess(p.args, p.wait(timeout=60), out, err)


def _prepare_into(directory) -> callable:
    def step(ctx: NodeContext) -> list[str]:
        d = shlex.quote(str(directory))
        return [f"mkdir -p {d}", f"echo prepared node {ctx.node.rank} > {d}/mark", f"cd {d}"]

    return step


def _env_wrapper(ctx: NodeContext, argv):
    # A stand-in for `podman run ... IMAGE`: a program that runs the rank command.
    return ["env", f"WRAPPED_FOR={ctx.node.rank}", *argv]


def test_a_prepare_step_runs_after_go_and_before_the_run_in_its_directory(tmp_path):
    work = tmp_path / "job"
    builder = ProgramBuilder(LOCAL, _config(tmp_path)).add_prepare("enter the job directory", _prepare_into(work))
    out = _run(builder.build()[0])
    assert out.returncode == 0, out.stderr
    assert (work / "mark").read_text() == "prepared node 0\n"
    lines = out.stdout.splitlines()
    assert lines[0] == CHECKED_MARKER and f"ran in {work}" in lines and lines[-1] == f"{EXIT_MARKER} 0"


def test_without_go_no_prepare_step_runs(tmp_path):
    work = tmp_path / "job"
    builder = ProgramBuilder(LOCAL, _config(tmp_path)).add_prepare("enter", _prepare_into(work))
    out = _run(builder.build()[0], go=False)
    assert out.returncode == 0 and out.stdout.splitlines() == [CHECKED_MARKER]
    assert not work.exists()


@pytest.mark.parametrize("detached", [False, True], ids=["attached", "supervised"])
def test_a_run_wrapper_wraps_the_rank_command_attached_and_supervised(tmp_path, monkeypatch, detached):
    monkeypatch.setenv("HOME", str(tmp_path))  # the supervised run's directory is under $HOME
    prog = "import os; print('wrapped for', os.environ.get('WRAPPED_FOR'), os.environ.get('GPUFLEET_RUN'))"
    config = _config(
        tmp_path, workload=Workload("exec", (sys.executable, "-c", prog)), controller_grace_s=5 if detached else None
    )
    builder = ProgramBuilder(LOCAL, config).wrap_run("env", _env_wrapper)
    program = builder.program(LOCAL.nodes[0])
    assert list(program.argv[:2]) == ["env", "WRAPPED_FOR=0"]
    out = _run(program.render(), env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert f"wrapped for 0 {config.job_id}-0" in out.stdout
    assert out.stdout.splitlines()[-1] == f"{EXIT_MARKER} 0"


def test_wrappers_apply_in_order_the_last_added_outermost(tmp_path):
    builder = (
        ProgramBuilder(LOCAL, _config(tmp_path, workload=Workload("exec", ("true",))))
        .wrap_run("inner", lambda ctx, argv: ["inner", *argv])
        .wrap_run("outer", lambda ctx, argv: ["outer", *argv])
    )
    assert list(builder.program(LOCAL.nodes[0]).argv) == ["outer", "inner", "true"]
    assert builder.steps() == ["prepare:node-local", "wrap:inner", "wrap:outer"]


def test_the_sections_come_in_order_and_the_prologue_before_the_environment(tmp_path):
    config = _config(tmp_path, env=(("A", "1"),), workdir=str(tmp_path))
    builder = (
        ProgramBuilder(LOCAL, config)
        .add_prologue("first", ["echo first"])
        .add_prepare("mine", lambda ctx: ["echo mine"])
    )
    sections = builder.program(LOCAL.nodes[0]).sections()
    assert [name for name, _ in sections] == ["prologue", "environment", "checks", "gate", "prepare", "run"]
    named = dict(sections)
    # The user's --env is read from stdin (its value is on no command line).
    assert named["prologue"] == ["echo first"] and read_env_statements("A")[0] in named["environment"]
    # --workdir's cd is the first prepare step; the added step comes last, after the builder's own
    # (the node's per-account local directory).
    assert named["prepare"][0].startswith("cd ") and named["prepare"][-1] == "echo mine"
    assert any("GPUFLEET_LOCAL_DIR" in s for s in named["prepare"][1:-1])


def test_bad_input_is_refused_when_the_builder_is_made(tmp_path):
    cluster = Cluster("c", (Node(0, "10.0.0.2", "10.0.0.2"),), machine_type="a3-mega")
    with pytest.raises(UserError, match="a3-mega"):
        ProgramBuilder(cluster, _config(tmp_path, workload=Workload("torchrun", ("t.py",))))


def test_an_environment_given_is_the_one_exported(tmp_path):
    config = _config(tmp_path, env=(("A", "from-config"),))
    program = ProgramBuilder(LOCAL, config, env={"B": "given"}).program(LOCAL.nodes[0])
    environment = dict(program.sections())["environment"]
    # The given environment is exported as is; the config's own --env value (A) is read from
    # stdin after it, so it is never in the program's text.
    assert environment[0] == "export B=given" and "from-config" not in "\n".join(environment)
