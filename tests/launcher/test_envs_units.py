"""A job's environment as the node agent builds it (launcher.code.node_agent.build_env), for real:
uv pip-installed by its pinned hash, then the environment built with it, from a package index on
this machine (the simulated cluster's wheels, tests/simindex.py, served over HTTP). A lock file
installs with its hashes; a changed marker builds a new directory beside the old one, which a
running job keeps, and swaps the link to it by rename."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.contracts import uv_requirement
from launcher.code import node_agent
from tests.simindex import wheel_cache, write_simple_tree

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    write_simple_tree(wheel_cache(), root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-I", "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/simple/"
    while node_agent.reachable(url) is not None:  # pytest's timeout bounds a server that never answers
        assert server.poll() is None, "the index's http.server exited"
        time.sleep(0.05)
    yield url
    server.kill()
    server.wait()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")  # one per module: uv is installed into it once


def build(home: Path, env: dict) -> subprocess.CompletedProcess:
    source = Path(node_agent.__file__).read_text()
    code = f"{source}\nimport json\nown_state()\nprint('BUILT', *build_env(json.loads({json.dumps(json.dumps(env))})))"
    return subprocess.run(
        [sys.executable, "-S", "-I", "-c", code, "build"],
        capture_output=True,
        text=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )


def spec(index: str, kind: str, files: dict[str, str], key: str) -> dict:
    return {"key": key, "kind": kind, "files": files, "index_url": index, "uv": uv_requirement(), "local_ssd": []}


def test_a_changed_marker_builds_a_new_directory_and_swaps_the_link_leaving_the_old_one(home, index):
    env = spec(index, "requirements.txt", {"requirements.txt": "six==1.16.0\n"}, "swap")
    r = build(home, env)
    assert r.returncode == 0, r.stdout + r.stderr
    first = Path(r.stdout.split("BUILT ", 1)[1].split()[0]).parent.parent
    link = home / ".gpufleet" / "envs" / "swap"
    assert link.is_symlink() and link.resolve() == first and first.name.startswith("swap-")
    # What the node chose changes (here: a torch index): a new directory, the link swapped.
    r = build(home, {**env, "torch_index": index})
    assert r.returncode == 0, r.stdout + r.stderr
    second = Path(r.stdout.split("BUILT ", 1)[1].split()[0]).parent.parent
    assert second != first and link.resolve() == second
    # The old one is whole: a job started on it goes on running it.
    run = subprocess.run([first / "bin" / "python", "-c", "import six; print(six.__version__)"], capture_output=True)
    assert run.stdout.strip() == b"1.16.0" and (first / node_agent.DONE).exists()
    # Built already: nothing built again, and the link names what was asked.
    r = build(home, env)
    assert (
        r.stdout.split("BUILT ", 1)[1].split() == [str(first / "bin" / "python"), "False"] and link.resolve() == first
    )


def test_a_lock_file_installs_with_its_hashes_and_a_wheel_that_does_not_match_is_refused(home, index):
    fixture = REPO / "tests" / "fixtures" / "locked_project"
    files = {name: (fixture / name).read_text() for name in ("uv.lock", "pyproject.toml")}
    r = build(home, spec(index, "uv.lock", files, "locked"))
    assert r.returncode == 0, r.stdout + r.stderr
    python = r.stdout.split("BUILT ", 1)[1].split()[0]
    assert (
        subprocess.run([python, "-c", "import six; print(six.__version__)"], capture_output=True).stdout == b"1.16.0\n"
    )
    # The index's six 1.16.0 wheel is not the file the lock names (its hash changed): refused.
    wheel_hash = "8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254"
    assert wheel_hash in files["uv.lock"]
    files["uv.lock"] = files["uv.lock"].replace(wheel_hash, "0" * 64)
    r = build(home, spec(index, "uv.lock", files, "tampered"))
    assert r.returncode != 0 and "BuildError" in r.stderr and "hash" in r.stderr.lower(), r.stdout + r.stderr
    assert not os.path.exists(home / ".gpufleet" / "envs" / "tampered")  # never pointed at a half-built one


def agent(home: Path, command: str, request: dict) -> subprocess.CompletedProcess:
    """The node agent's `command` as a node runs it (its source, -I -S), `request` on stdin."""
    source = Path(node_agent.__file__).read_text()
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", source, command],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        timeout=600,
    )


def results(r: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line.split(" result ", 1)[1]) for line in r.stdout.splitlines() if " result " in line]


def test_warm_compiles_a_spares_environment_and_gpufleets_code_once_and_only_under_its_own_gpufleet(home, index):
    r = build(home, spec(index, "requirements.txt", {"requirements.txt": "six==1.16.0\n"}, "warmed"))
    assert r.returncode == 0, r.stdout + r.stderr
    link = home / ".gpufleet" / "envs" / "warmed"
    venv = link.resolve()
    (six,) = venv.glob("lib/python*/site-packages/six.py")
    snap = home / ".gpufleet" / "snap" / ("a" * 16)
    (snap / "workloads").mkdir(parents=True)
    (snap / "workloads" / "train.py").write_text("STEPS = 1\n")
    assert not list(six.parent.glob("__pycache__/six.*.pyc"))  # uv installs without bytecode
    r = agent(home, "warm", {"python": str(link / "bin" / "python"), "code": ["a" * 16, "../../etc"]})
    assert r.returncode == 0 and results(r)[0]["compiled"] is True, r.stdout + r.stderr
    assert "compiling its environment to bytecode" in r.stdout
    # What an import reads instead of compiling: the environment's and the code's bytecode.
    assert list(six.parent.glob("__pycache__/six.*.pyc")) and (venv / node_agent.WARMED).exists()
    assert list((snap / "workloads" / "__pycache__").glob("train.*.pyc"))
    # The next job's spare on the same environment: nothing compiled again.
    r = agent(home, "warm", {"python": str(link / "bin" / "python")})
    assert results(r) == [{"compiled": False, "seconds": 0}], r.stdout + r.stderr
    # An interpreter that is not an environment gpufleet built here: refused in one line.
    r = agent(home, "warm", {"python": sys.executable})
    assert r.returncode == 1 and not results(r) and r.stderr.strip().count("\n") == 0, r.stderr
    assert "is not an environment gpufleet built under" in r.stderr
