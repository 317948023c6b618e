"""--env values off command lines (issue 35, point 3): a node program reads them from stdin
(launcher.core.wire.env_block, read_env_statements), `--env KEY` takes this machine's value,
`--env-file` reads KEY=VALUE lines, mpirun forwards them by name, and neither a dry run nor a log
shows them. The programs run here under bash, as a node's login shell runs them; the simulated
cluster's end-to-end check is tests/launcher/test_secrets_cluster.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core.env import node_env, parse_env_pairs
from launcher.core.program import ProgramBuilder, env_stdin
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.core.wire import CHECKED_MARKER, EXIT_MARKER, env_block, read_env_statements
from launcher.nccl.mpirun import nccl_tests_command
from tests.launcher import dry_runs
from tests.support import LAUNCH

LOCAL = Cluster("c", (Node(0, "127.0.0.1", "127.0.0.1"), Node(1, "127.0.0.1", "127.0.0.1")), local=True)
SECRET = "hf_Zx9-not-a-real-token-7Q"
# A value bash or printf could mangle: backslash escapes (`\c` ends printf %b's output), a newline
# inside and one at the end, quotes, expansions, a format directive, non-ASCII.
NASTY = "a\\cb \\n\\\\x\n'\"$(touch /tmp/no) `id` $HOME %s ${X} é\n"


def _bash(script: str, stdin: bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script], input=stdin, capture_output=True, timeout=60, env=env
    )


@pytest.mark.parametrize("value", [NASTY, "", "plain", "\n", "\\", "=x=y"], ids=repr)
def test_a_value_read_from_stdin_arrives_byte_for_byte(value):
    statements = read_env_statements("K")
    out = _bash("; ".join([*statements, 'printf %s "$K"']), env_block([("K", value)]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == value


def test_a_path_like_value_from_stdin_is_prepended_to_the_nodes():
    script = "; ".join([*read_env_statements("PATH", prepend=True), 'printf %s "$PATH"'])
    out = _bash(script, b"/opt/my bin\n", env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.decode() == "/opt/my bin:/usr/bin:/bin", out.stderr
    # Without a value on the node, nothing is appended.
    script = "; ".join(
        ["unset LD_LIBRARY_PATH", *read_env_statements("LD_LIBRARY_PATH", True), 'printf %s "$LD_LIBRARY_PATH"']
    )
    assert _bash(script, b"/x\n").stdout == b"/x"


def test_end_of_input_before_the_values_runs_nothing():
    out = _bash("; ".join([*read_env_statements("K"), "echo ran"]), b"")
    assert out.returncode == 0 and out.stdout == b""


def _config(tmp_path, **kw) -> LaunchConfig:
    kw.setdefault("job_id", f"sec-{tmp_path.name}"[:40])
    return LaunchConfig(**kw)


@pytest.mark.parametrize("kind", ["exec", "torchrun"])
def test_the_programs_hold_no_env_value_and_the_check_and_the_run_see_it(tmp_path, kind):
    """Every node's rendered program (what ssh's command line carries) names the variables but
    holds none of their values; fed its stdin, the program's check and run both have them."""
    config = _config(
        tmp_path,
        workload=Workload(kind, ("x.py",)),
        env=(("HF_TOKEN", "hf_first_3kq"), ("NASTY", NASTY), ("HF_TOKEN", SECRET), ("PATH", "/opt/venv/bin")),
    )
    programs = ProgramBuilder(LOCAL, config).build()
    for script in programs.values():
        assert SECRET not in script and "hf_first_3kq" not in script and "/opt/venv/bin" not in script
        assert "NASTY" in script and "HF_TOKEN" in script
    # The last value of a key given twice, in the order the program reads them.
    assert env_stdin(config) == env_block([("HF_TOKEN", SECRET), ("NASTY", NASTY), ("PATH", "/opt/venv/bin")])


def test_a_program_run_with_its_stdin_gives_the_workload_every_value(tmp_path):
    show = "import os; print(repr((os.environ['HF_TOKEN'], os.environ['NASTY'], os.environ['PATH'].split(':')[0])))"
    config = _config(
        tmp_path,
        workload=Workload("exec", (sys.executable, "-c", show)),
        env=(("HF_TOKEN", SECRET), ("NASTY", NASTY), ("PATH", "/opt/venv/bin")),
    )
    script = ProgramBuilder(LOCAL, config).build()[0]
    # As the launcher does: the values first, then `go` once the node has checked, and stdin held
    # open until the output ends (end of input is a stop).
    p = subprocess.Popen(
        ["bash", "--norc", "--noprofile", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    p.stdin.write(env_stdin(config) + b"go\n")
    p.stdin.flush()
    out, err = p.stdout.read(), p.stderr.read()
    p.stdin.close()
    assert p.wait(timeout=60) == 0, err
    lines = out.decode().splitlines()
    assert lines[0] == CHECKED_MARKER and lines[-1] == f"{EXIT_MARKER} 0", err
    assert repr((SECRET, NASTY, "/opt/venv/bin")) in lines


def test_the_check_sees_a_path_that_came_on_stdin(tmp_path):
    """`--env PATH=VENV/bin` still decides which python3 the check asks for torch."""
    import importlib.metadata

    venv_bin = str(Path(sys.executable).parent)
    config = _config(tmp_path, workload=Workload("torchrun", ("x.py",)), env=(("PATH", venv_bin),))
    script = ProgramBuilder(LOCAL, config).program(LOCAL.nodes[0]).render()
    assert venv_bin not in script
    out = _bash(script, env_stdin(config), env={"PATH": "/usr/bin:/bin"})
    facts = dict(l.split("=", 1) for l in out.stdout.decode().splitlines() if "=" in l)
    assert facts["torch"] == importlib.metadata.version("torch"), out.stdout + out.stderr


def test_more_values_than_a_pipe_holds_are_refused_when_the_builder_is_made(tmp_path):
    config = _config(tmp_path, workload=Workload("exec", ("true",)), env=(("BIG", "x" * 40000),))
    with pytest.raises(UserError, match="--env values come to 40001 bytes"):
        ProgramBuilder(LOCAL, config)


# ---- --env KEY, --env-file ------------------------------------------------------------------------


def test_env_key_alone_takes_this_machines_value_and_an_unset_one_is_refused():
    assert parse_env_pairs(["HF_TOKEN", "A=b=c"], environ={"HF_TOKEN": SECRET}) == (("HF_TOKEN", SECRET), ("A", "b=c"))
    with pytest.raises(
        UserError, match=r"^--env 'HF_TOKEN': HF_TOKEN is not set here; set it, or write HF_TOKEN=VALUE$"
    ):
        parse_env_pairs(["HF_TOKEN"], environ={})


@pytest.mark.parametrize("bad", ["1BAD=x", "A\n=x", "A-B=x", "=x", " A=x"])
def test_a_key_that_is_not_a_variable_name_is_refused(bad):
    with pytest.raises(UserError, match="is not a shell variable name"):
        parse_env_pairs([bad], environ={})


def test_an_env_file_is_read_with_comments_and_blank_lines_and_env_wins(tmp_path):
    f = tmp_path / "job.env"
    f.write_text(f"# tokens\n\nHF_TOKEN={SECRET}\n  # indented comment\nURL=http://x/?a=b\nFROM_HERE\nA=file\n")
    got = parse_env_pairs(["A=flag"], [str(f)], environ={"FROM_HERE": "here"})
    assert got == (("HF_TOKEN", SECRET), ("URL", "http://x/?a=b"), ("FROM_HERE", "here"), ("A", "file"), ("A", "flag"))
    assert dict(got)["A"] == "flag"


def test_a_bad_env_file_line_is_named_by_file_and_line(tmp_path):
    f = tmp_path / "job.env"
    f.write_text("A=1\nexport B=2\n")
    with pytest.raises(UserError, match=rf"^--env-file {f}:2: 'export B' is not a shell variable name"):
        parse_env_pairs([], [str(f)], environ={})
    with pytest.raises(UserError, match=r"^--env-file /no/such\.env: No such file or directory"):
        parse_env_pairs([], ["/no/such.env"], environ={})


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, *args], capture_output=True, text=True, timeout=120, env=env)


def test_the_cli_takes_env_key_and_env_file_and_a_bad_one_is_one_line_exit_2(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.9.0.1\n10.9.0.2\n")
    envf = tmp_path / "job.env"
    envf.write_text("# mine\nFROM_FILE=also-secret-1234\n")
    env = {**os.environ, "HF_TOKEN": SECRET, "GPUFLEET_STATE_DIR": str(tmp_path / "state")}
    r = _cli(
        "exec",
        "--hostfile",
        str(hosts),
        "--env",
        "HF_TOKEN",
        "--env-file",
        str(envf),
        "--dry-run",
        "--",
        "true",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    # The dry run: each node's plan with neither value, the names hidden; the names on stderr.
    assert SECRET not in r.stdout + r.stderr and "also-secret-1234" not in r.stdout + r.stderr
    assert len(dry_runs.headers(r.stdout)) == 2
    assert "FROM_FILE=<hidden: --env, on stdin>" in r.stdout and "HF_TOKEN=<hidden: --env, on stdin>" in r.stdout
    assert "FROM_FILE=<from --env, hidden> HF_TOKEN=<from --env, hidden>" in r.stderr  # the file first
    # Whole, as JSON: the exact programs (each reads the values from stdin) and the plans, by name.
    argv = ["exec", "--hostfile", str(hosts), "--env", "HF_TOKEN", "--env-file", str(envf), "--dry-run=json"]
    j = _cli(*argv, "--", "true", env=env)
    assert j.returncode == 0 and SECRET not in j.stdout and "also-secret-1234" not in j.stdout, j.stderr
    assert dry_runs.doc(j.stdout)["stdin"] == ["FROM_FILE", "HF_TOKEN"]
    for plan, program in zip(dry_runs.plans(j.stdout), dry_runs.programs(j.stdout)):
        hidden = [(v.name, v.value) for v in plan.env if v.hidden]
        assert hidden == [("FROM_FILE", None), ("HF_TOKEN", None)] and "HF_TOKEN" in program
    del env["HF_TOKEN"]
    r = _cli("exec", "--hostfile", str(hosts), "--env", "HF_TOKEN", "--dry-run", "--", "true", env=env)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: --env 'HF_TOKEN': HF_TOKEN is not set here; set it, or write HF_TOKEN=VALUE\n"
    envf.write_text("OK=1\nnot a pair\n")
    r = _cli("exec", "--hostfile", str(hosts), "--env-file", str(envf), "--dry-run", "--", "true", env=env)
    assert (
        r.returncode == 2 and r.stderr.startswith(f"error: --env-file {envf}:2: ") and len(r.stderr.splitlines()) == 1
    )


def test_nccl_tests_binary_dry_run_forwards_env_values_to_mpirun_by_name(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.9.0.1\n10.9.0.2\n")
    env = {**os.environ, "HF_TOKEN": SECRET, "GPUFLEET_STATE_DIR": str(tmp_path / "state")}
    r = _cli(
        "nccl-tests", "--hostfile", str(hosts), "--impl", "nccl-tests", "--nproc-per-node", "1", "--ops", "all_reduce",
        "--env", "HF_TOKEN", "--dry-run", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout + r.stderr
    assert "-x HF_TOKEN " in r.stdout and "HF_TOKEN=<from --env, hidden>" in r.stderr


def test_mpirun_gets_the_users_variables_by_name_only():
    argv = nccl_tests_command(
        "/opt/nccl-tests/all_reduce_perf", ["h1", "h2"], 8, ["-g", "1"], {"NCCL_ALGO": "Ring", "HF_TOKEN": SECRET},
        inherit={"HF_TOKEN"},
    )  # fmt: skip
    assert SECRET not in " ".join(argv)
    assert argv[argv.index("HF_TOKEN") - 1] == "-x" and "NCCL_ALGO=Ring" in argv
    with pytest.raises(ValueError, match="not valid"):
        nccl_tests_command("b", ["h1"], 1, [], {"A\n": "x"})


def test_an_override_of_the_profile_is_logged_without_its_value(caplog):
    cluster = Cluster("c", (Node(0, "10.0.0.2", "10.0.0.2"),), machine_type="a3-megagpu-8g")
    config = LaunchConfig(Workload("torchrun", ("x.py",)), env=(("NCCL_BUFFSIZE", "1048576"),), job_id="j")
    with caplog.at_level(logging.WARNING, logger="launcher.core.env"):
        node_env(cluster, config)
    assert "--env NCCL_BUFFSIZE overrides the profile value NCCL_BUFFSIZE=8388608" in caplog.text
    assert "1048576" not in caplog.text


def test_a_hand_off_whose_controller_never_starts_leaves_no_env_values_behind(tmp_path):
    """The job host unpacks the archive (env.json inside, mode 600); when the controller dies
    before writing its record, the client reports it and env.json goes with it."""
    from launcher.cluster.key import NODE_KEY_DIR
    from launcher.jobs.handoff import _archive, _handoff_script
    from launcher.jobs.record import CONTROLLER_SH, JOBS_DIR

    config = _config(tmp_path, workload=Workload("exec", ("true",)), env=(("HF_TOKEN", SECRET),))
    job = config.job_id
    archive = _archive(
        {
            f"{NODE_KEY_DIR}/c-x/id_ed25519": b"key",
            f"{JOBS_DIR}/{job}/env.json": f'[["HF_TOKEN", "{SECRET}"]]'.encode(),
            # A controller that dies at once: the pid of a process already gone.
            f"{JOBS_DIR}/{job}/{CONTROLLER_SH}": b"sh -c 'exit 3' & wait $!; echo $!\n",
        }
    )
    r = subprocess.run(
        ["bash", "-c", _handoff_script(config, "0" * 16, "c-x", "python3")],
        input=archive,
        capture_output=True,
        timeout=60,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert r.returncode == 1 and b"the controller did not start" in r.stderr
    jobdir = tmp_path / JOBS_DIR / job
    assert jobdir.is_dir() and not (jobdir / "env.json").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
