"""Hostile or broken input for the launcher and the stack config: each case gets one
clear line and exit 2, never a traceback, and nothing runs on any node.

The launcher cases point at real simulated nodes, and the command they would run creates a
marker file: had anything started on a node, the marker (or a runs/ directory, or a process
on a node) would exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from infra.config import KEYS
from infra.config import main as check_stack
from launcher.cli.main import main
from tests.infra.test_config import WRONG_TYPES
from tests.simcluster import SimCluster
from tests.support import LAUNCH, REPO

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("hostile_input")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with SimCluster(2, workdir=tmp_path_factory.mktemp("sim")) as c:
        yield c


def _files(c: SimCluster, d) -> dict[str, str]:
    a, b = c.addresses
    node = lambda i, ip, **kw: {"name": f"n{i}", "index": i, "internalIp": ip, "externalIp": None, **kw}  # noqa: E731
    texts = {
        "empty.hosts": "",
        "comments.hosts": "# nothing but comments\n\n   # and blanks\n",
        "dupes.hosts": f"{a}\n{b}\n{a}\n",
        "spaces.hosts": f"{a}\nnode one\n",
        "semicolon.hosts": f"{a};touch${{IFS}}/tmp/pwned\n",
        "subshell.hosts": f"{a}\n$(touch${{IFS}}/tmp/pwned)\n",
        "backticks.hosts": f"`id`\n{b}\n",
        "pipe.hosts": f"{a}|sh\n",
        "redirect.hosts": f"{a}>/tmp/pwned\n",
        "quote.hosts": f"{a}'\n",
        "dash.hosts": "-oProxyCommand=touch${IFS}/tmp/pwned\n",
        "slots0.hosts": f"{a} slots=0\n",
        "slotsx.hosts": f"{a} slots=many\n",
        "good.hosts": f"{a}\n{b}\n",
        "nonodes.json": json.dumps({"cluster": "x", "zone": "us-central1-a"}),
        "nodesnotlist.json": json.dumps({"nodes": "n0,n1"}),
        "nodesempty.json": json.dumps({"nodes": []}),
        "noip.json": json.dumps({"nodes": [{"name": "n0", "index": 0}]}),
        "metaip.json": json.dumps({"nodes": [node(0, f"{a}; touch /tmp/pwned")]}),
        "dupindex.json": json.dumps({"nodes": [node(0, a), node(0, b)]}),
        "boolindex.json": json.dumps({"nodes": [node(0, a, index=True)]}),
        "toplist.json": json.dumps([node(0, a)]),
        "notjson.json": "{nodes: [",
        "emptyfile.json": "",
    }
    paths = {}
    for name, text in texts.items():
        (d / name).write_text(text)
        paths[name] = str(d / name)
    (d / "binary.hosts").write_bytes(b"\xff\xfe\x00garbage\n")
    (d / "binary.json").write_bytes(b"\xff\xfe{\x00}")
    (d / "adir.hosts").mkdir()
    for name in ("binary.hosts", "binary.json", "adir.hosts"):
        paths[name] = str(d / name)
    paths["missing.hosts"] = str(d / "missing.hosts")
    return paths


# (source args, extra args, what the one line must name)
CASES = [
    (["--hostfile", "@empty.hosts"], [], "lists no hosts"),
    (["--hostfile", "@comments.hosts"], [], "lists no hosts"),
    (["--hostfile", "@dupes.hosts"], [], "listed more than once"),
    (["--hostfile", "@spaces.hosts"], [], "line 2: 'one' is not understood"),
    (["--hostfile", "@semicolon.hosts"], [], "is not a valid host name"),
    (["--hostfile", "@subshell.hosts"], [], "line 2"),
    (["--hostfile", "@backticks.hosts"], [], "'`id`' is not a valid host name"),
    (["--hostfile", "@pipe.hosts"], [], "is not a valid host name"),
    (["--hostfile", "@redirect.hosts"], [], "is not a valid host name"),
    (["--hostfile", "@quote.hosts"], [], "is not a valid host name"),
    (["--hostfile", "@dash.hosts"], [], "is not a valid host name"),
    (["--hostfile", "@slots0.hosts"], [], "'slots=0' is not understood"),
    (["--hostfile", "@slotsx.hosts"], [], "'slots=many' is not understood"),
    (["--hostfile", "@binary.hosts"], [], "is not UTF-8 text"),
    (["--hostfile", "@adir.hosts"], [], "cannot be read"),
    (["--hostfile", "@missing.hosts"], [], "cannot be read"),
    (["--hostfile", "@good.hosts"], ["--nodes", "0"], "--nodes 0 is not allowed"),
    (["--hostfile", "@good.hosts"], ["--nodes", "-1"], "--nodes -1 is not allowed"),
    (["--hostfile", "@good.hosts"], ["--nodes", "3"], "--nodes 3 asks for more nodes than exist: 2 found"),
    (["--hostfile", "@good.hosts"], ["--nodes", "two"], "Invalid value for '--nodes'"),
    (["--hostfile", "@good.hosts"], ["--exclude", "10.255.255.1"], "--exclude names 10.255.255.1"),
    (["--hostfile", "@good.hosts"], ["--env", "GPUFLEET_TEST_UNSET_VAR"], "GPUFLEET_TEST_UNSET_VAR is not set here"),
    (["--hostfile", "@good.hosts"], ["--env", "A;B=1"], "'A;B' is not a shell variable name"),
    (["--hostfile", "@good.hosts"], ["--ssh-option", "ProxyCommand"], "--ssh-option 'ProxyCommand'"),
    (["--hostfile", "@good.hosts", "--local"], [], "give exactly one node source"),
    ([], [], "give exactly one node source"),
    (["--outputs", "@nonodes.json"], [], "'nodes' is missing"),
    (["--outputs", "@nodesnotlist.json"], [], "'nodes' is not a list"),
    (["--outputs", "@nodesempty.json"], [], "'nodes' is empty"),
    (["--outputs", "@noip.json"], [], "nodes[0] has no internalIp"),
    (["--outputs", "@metaip.json"], [], "is not a valid host name"),
    (["--outputs", "@dupindex.json"], [], "node indexes repeat"),
    (["--outputs", "@boolindex.json"], [], "nodes[0].index is True"),
    (["--outputs", "@toplist.json"], [], "top level is list"),
    (["--outputs", "@notjson.json"], [], "is not JSON"),
    (["--outputs", "@emptyfile.json"], [], "is not JSON"),
    (["--outputs", "@binary.json"], [], "is not UTF-8 text"),
]

TORCHRUN_CASES = [
    (["--max-restarts", "-1"], "--max-restarts -1 must be 0 or more"),
    (["--rdzv-port", "22"], "--rdzv-port 22 must be between 1024 and 65535"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0 must be at least 1"),
    (["--image-os", "windows"], "Invalid value for '--image-os'"),
]


def _assert_refused(c: SimCluster, out: str, code: int, culprit: str, runs, marker) -> None:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == 2, out
    assert len(lines) == 1, out
    assert lines[0].startswith("error: ") and culprit in lines[0], out
    assert "Traceback" not in out
    assert not runs.exists() and not marker.exists()
    assert not c.processes()


@pytest.mark.parametrize("source, extra, culprit", CASES, ids=[f"{i}-{c[2][:30]}" for i, c in enumerate(CASES)])
def test_a_bad_node_source_or_flag_is_one_line_exit_2_and_nothing_runs(cluster, tmp_path, source, extra, culprit):
    paths = _files(cluster, tmp_path)
    marker = tmp_path / "ran"
    runs = tmp_path / "runs"
    args = [
        "exec",
        *[paths[a[1:]] if a.startswith("@") else a for a in source],
        *extra,
        *cluster.launch_flags,
        "--runs-dir",
        str(runs),
        "--",
        "touch",
        str(marker),
    ]
    r = CliRunner().invoke(main, args)
    _assert_refused(cluster, r.output, r.exit_code, culprit, runs, marker)


@pytest.mark.parametrize("extra, culprit", TORCHRUN_CASES)
def test_a_bad_torchrun_option_is_one_line_exit_2_and_nothing_runs(cluster, tmp_path, extra, culprit):
    marker, runs = tmp_path / "ran", tmp_path / "runs"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w')\n")
    r = CliRunner().invoke(
        main,
        [
            "run",
            "--hostfile",
            str(cluster.hostfile),
            *cluster.launch_flags,
            *extra,
            "--runs-dir",
            str(runs),
            "--",
            str(script),
        ],
    )
    _assert_refused(cluster, r.output, r.exit_code, culprit, runs, marker)


def test_the_installed_console_script_refuses_hostile_hosts_without_a_traceback(cluster, tmp_path):
    """The same through `launch` itself (a real process: real stderr, real exit status)."""
    paths = _files(cluster, tmp_path)
    marker, runs = tmp_path / "ran", tmp_path / "runs"
    for name, culprit in [
        ("subshell.hosts", "line 2"),
        ("dash.hosts", "is not a valid host name"),
        ("binary.hosts", "is not UTF-8 text"),
        ("empty.hosts", "lists no hosts"),
    ]:
        r = subprocess.run(
            [
                LAUNCH,
                "train",
                "--hostfile",
                paths[name],
                *cluster.launch_flags,
                "--runs-dir",
                str(runs),
                "--",
                "--steps",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        _assert_refused(cluster, r.stdout + r.stderr, r.returncode, culprit, runs, marker)
        assert r.stdout == ""  # the error is on stderr
    assert not Path("/tmp/pwned").exists()


# ---- the stack config ------------------------------------------------------------------------

BASE = {"gcp:project": "gpufleet-test", "gcp:zone": "us-central1-a"}


def _stack_file(tmp_path, config) -> str:
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(yaml.safe_dump({"config": config}))
    return str(path)


@pytest.mark.parametrize("key", sorted(WRONG_TYPES))
def test_a_stack_file_with_a_wrong_type_for_a_key_is_one_line_exit_2(tmp_path, capsys, key):
    extra = {"gpufleet:provisioning": "flex-start"} if key == "maxRunHours" else {}
    full = key if ":" in key else f"gpufleet:{key}"
    path = _stack_file(tmp_path, {**BASE, **extra, full: WRONG_TYPES[key]})
    assert check_stack([path]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: config {full}"), err


def test_every_stack_key_is_in_the_corpus():
    assert {f"gpufleet:{k}" for k in KEYS} | {"gcp:project", "gcp:zone"} == {
        k if ":" in k else f"gpufleet:{k}" for k in WRONG_TYPES
    }


@pytest.mark.parametrize(
    "text, culprit",
    [
        ("config: [unclosed\n", "is not YAML at line"),
        ("- just\n- a list\n", "needs a `config:` map"),
        ("config: 5\n", "needs a `config:` map"),
        ("config:\n  gcp:zone: us-central1-a\n", "gcp:project is not set"),
        (
            "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n  nodez: 3\n",
            "gpufleet:nodez is not a gpufleet setting",
        ),
        (
            "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n  gpufleet:nodes:\n    secure: AAAA\n",
            "gpufleet:nodes is encrypted",
        ),
        # YAML dates stay text, as Pulumi reads them; an explicit tag JSON cannot hold names its key.
        (
            "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n  gpufleet:name: 2024-01-01\n",
            "config gpufleet:name = '2024-01-01' is not allowed",
        ),
        (
            "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n"
            "  gpufleet:labels: {created: !!timestamp 2024-01-01}\n",
            "config gpufleet:labels is not allowed: it holds a date value",
        ),
        (
            "config:\n  gcp:project: gpufleet-test\n  gcp:zone: us-central1-a\n"
            "  gpufleet:labels: {blob: !!binary aGk=}\n",
            "config gpufleet:labels is not allowed: it holds a bytes value",
        ),
    ],
)
def test_a_broken_stack_file_is_one_line_exit_2(tmp_path, capsys, text, culprit):
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_text(text)
    assert check_stack([str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and culprit in err, err


def test_the_stack_check_runs_as_a_module_and_accepts_the_example(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "infra.config", str(REPO / "Pulumi.example.yaml")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("ok: llm-dev: 2 x a3-megagpu-8g"), ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "infra.config", _stack_file(tmp_path, {**BASE, "gpufleet:nodes": "two"})],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert (
        bad.stderr.strip()
        == "error: config gpufleet:nodes = 'two' is not allowed: a whole number from 1 to 4092 (e.g. 2)"
    )
