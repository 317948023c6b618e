"""The node program's builder (launcher.core.program): one line that starts the node's side with
its typed plan, its parts in order (the prepare steps after `go`), its extension points (a typed
prologue step, a run wrapper around the rank command, attached and supervised alike), and bad
input refused when the builder is made, before anything is rendered. The programs run here under
bash, as a node's login shell would run them."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from gpufleet.node_plan import EnvSource, EnvVar, PrepareKind, PrologueKind, PrologueStep
from launcher.core.program import NodeContext, ProgramBuilder, env_stdin
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.core.wire import CHECKED_MARKER, EXIT_MARKER

LOCAL = Cluster("c", (Node(0, "127.0.0.1", "127.0.0.1"),), local=True)


def _config(tmp_path, **kw) -> LaunchConfig:
    kw.setdefault("workload", Workload("exec", (sys.executable, "-c", "import os; print('ran in', os.getcwd())")))
    kw.setdefault("job_id", f"prog-{tmp_path.name}"[:40])
    return LaunchConfig(**kw)


def _run(script: str, go: bool = True, env: dict | None = None, first: str = "") -> subprocess.CompletedProcess:
    """As the launcher does: `first` (the --env values), `go` (or end of input), then stdin held
    open until the node's output ends (end of input is a stop)."""
    p = subprocess.Popen(
        ["bash", "--norc", "--noprofile", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    p.stdin.write(first)
    if go:
        p.stdin.write("go\n")
        p.stdin.flush()
    else:
        p.stdin.close()
    out, err = p.stdout.read(), p.stderr.read()
    if go:
        p.stdin.close()
    return subprocess.CompletedProcess(p.args, p.wait(timeout=60), out, err)


def _env_wrapper(ctx: NodeContext, argv):
    # A stand-in for `podman run ... IMAGE`: a program that runs the rank command.
    return ["env", f"WRAPPED_FOR={ctx.node.rank}", *argv]


def test_after_go_the_node_enters_the_workdir_and_exports_its_local_directory_then_runs(tmp_path):
    work = tmp_path / "job"
    work.mkdir()
    prog = "import os; print('ran in', os.getcwd(), os.environ.get('GPUFLEET_LOCAL_DIR'))"
    config = _config(tmp_path, workload=Workload("exec", (sys.executable, "-c", prog)), workdir=str(work))
    out = _run(ProgramBuilder(LOCAL, config).build()[0], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    local = tmp_path / ".gpufleet" / "local"
    # The check says the --workdir is there; the run comes after the gate, in it.
    assert lines[:2] == ["workdir=ok", CHECKED_MARKER] and lines[2:] == [f"ran in {work} {local}", f"{EXIT_MARKER} 0"]
    assert local.stat().st_mode & 0o777 == 0o700


def test_without_go_nothing_is_prepared_or_run(tmp_path):
    config = _config(tmp_path, workdir=str(tmp_path))
    out = _run(ProgramBuilder(LOCAL, config).build()[0], go=False, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.splitlines() == ["workdir=ok", CHECKED_MARKER]
    assert not (tmp_path / ".gpufleet").exists()


def test_a_missing_workdir_is_the_nodes_own_one_line_error_after_go(tmp_path):
    config = _config(tmp_path, workdir=str(tmp_path / "gone"))
    out = _run(ProgramBuilder(LOCAL, config).build()[0], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 71 and "ran in" not in out.stdout
    assert out.stderr.splitlines() == [f"gpufleet: --workdir {tmp_path / 'gone'} does not exist on 127.0.0.1"]


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
    assert builder.steps() == ["wrap:inner", "wrap:outer"]


def test_the_program_is_one_line_that_starts_the_node_side_with_the_plan_in_order(tmp_path):
    config = _config(tmp_path, env=(("A", "secret"),), workdir=str(tmp_path))
    entry = 'from="10.0.0.2" ssh-ed25519 AAAA gpufleet-c'
    program = (
        ProgramBuilder(LOCAL, config).add_prologue(PrologueStep(PrologueKind.AUTHORIZE, entry)).program(LOCAL.nodes[0])
    )
    line, plan = program.render(), program.plan()
    assert line.startswith("exec python3 -I -S -c ") and "secret" not in line
    assert shlex.split(line)[-2:] == ["node", plan.to_json()]  # the plan, whole, as its last argument
    assert plan.prologue == (PrologueStep(PrologueKind.AUTHORIZE, entry),)
    # The user's --env is read from stdin (its value is on no command line).
    assert [v for v in plan.env if v.name == "A"] == [EnvVar("A", None, EnvSource.STDIN)]
    # --workdir's cd is the first prepare step, the account's local directory the last.
    assert [s.kind for s in plan.prepare] == [PrepareKind.WORKDIR, PrepareKind.LOCAL_DIR]


def test_bad_input_is_refused_when_the_builder_is_made(tmp_path):
    cluster = Cluster("c", (Node(0, "10.0.0.2", "10.0.0.2"),), machine_type="a3-mega")
    with pytest.raises(UserError, match="a3-mega"):
        ProgramBuilder(cluster, _config(tmp_path, workload=Workload("torchrun", ("t.py",))))


def test_an_environment_given_is_the_one_exported_and_the_env_values_come_from_stdin(tmp_path):
    config = _config(
        tmp_path,
        env=(("A", "from-config"),),
        workload=Workload("exec", (sys.executable, "-c", "import os; print(os.environ['A'], os.environ['B'])")),
    )
    program = ProgramBuilder(LOCAL, config, env={"B": "given"}).program(LOCAL.nodes[0])
    assert [(v.name, v.value) for v in program.plan().env[:2]] == [("B", "given"), ("A", None)]
    first = env_stdin(config).decode()
    p = _run(program.render(), env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, first=first)
    assert "from-config given" in p.stdout.splitlines() and p.returncode == 0, p.stderr
