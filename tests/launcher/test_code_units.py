"""What a launch brings to bare nodes, without a network: the snapshot's ignore rules and hash,
the environment's definition and key, the CUDA index a driver gets, the resolver's reason in one
line, and every refusal of bad input (one line, exit 2, nothing started)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.code import node_agent
from launcher.code.pyenv import TORCH_INDEXES, EnvSpec, requirement_source, workloads_requirements
from launcher.code.snapshot import code_snapshot, parse_rules, parse_size, take_snapshot
from launcher.core.types import UserError
from tests.support import LAUNCH


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_snapshot_honours_gitignore_and_gpufleetignore_at_every_level_and_never_takes_git(tmp_path):
    _tree(
        tmp_path,
        {
            ".gitignore": "*.log\n/build/\ndata/\n!keep.log\n",
            ".gpufleetignore": "*.ckpt\n",
            "train.py": "print(1)\n",
            "keep.log": "kept\n",
            "run.log": "dropped\n",
            "build/out.o": "x",
            "src/build/kept.py": "anchored /build/ is the top one only\n",
            "data/big.bin": "x" * 100,
            "sub/.gitignore": "secret.txt\n",
            "sub/secret.txt": "no\n",
            "sub/model.ckpt": "no\n",
            "sub/ok.txt": "yes\n",
            ".git/HEAD": "ref: refs/heads/main\n",
            "src/.git": "gitdir: ../.git/modules/src\n",
        },
    )
    paths = [f.path for f in take_snapshot(tmp_path).files]
    assert paths == [
        ".gitignore",
        ".gpufleetignore",
        "keep.log",
        "src/build/kept.py",
        "sub/.gitignore",
        "sub/ok.txt",
        "train.py",
    ]


def test_the_snapshot_hash_changes_with_a_file_and_its_mode_and_not_with_time(tmp_path):
    _tree(tmp_path, {"a.py": "1\n", "b.py": "2\n"})
    first = take_snapshot(tmp_path, cache=tmp_path.parent / "hashes.json")
    (tmp_path / "a.py").touch()
    assert take_snapshot(tmp_path, cache=tmp_path.parent / "hashes.json").hash == first.hash
    (tmp_path / "a.py").chmod(0o755)
    moded = take_snapshot(tmp_path)
    assert moded.hash != first.hash
    (tmp_path / "b.py").write_text("3\n")
    changed = take_snapshot(tmp_path, cache=tmp_path.parent / "hashes.json")  # the cache sees the edit
    assert changed.hash not in (first.hash, moded.hash)
    assert [f.sha256 for f in changed.files][0] == [f.sha256 for f in moded.files][0]


def test_gitignore_patterns_follow_git():
    rules = parse_rules("**/tmp/\nfoo/**/bar\n\\#lit\n*.py[co]\n", "")
    from launcher.code.snapshot import _ignored

    assert _ignored(rules, "a/b/tmp", True) and not _ignored(rules, "a/b/tmp", False)
    assert _ignored(rules, "foo/x/y/bar", False) and _ignored(rules, "foo/bar", False)
    assert _ignored(rules, "#lit", False) and _ignored(rules, "m/x.pyc", False) and not _ignored(rules, "x.py", False)


def test_gpufleets_own_code_snapshot_holds_gpufleet_and_workloads_only():
    paths = [f.path for f in code_snapshot().files]
    assert "workloads/train.py" in paths and "gpufleet/contracts.py" in paths
    assert not [p for p in paths if not p.startswith(("gpufleet/", "workloads/")) or p.endswith(".pyc")]


def test_sizes_parse_and_a_bad_one_names_the_flag():
    assert parse_size("100MB") == 100_000_000 and parse_size("2g") == 2_000_000_000 and parse_size("500") == 500
    with pytest.raises(UserError, match="--sync-max '12 parsecs' is not a size"):
        parse_size("12 parsecs")


def test_the_requirements_source_is_uv_lock_then_pyproject_then_requirements_txt(tmp_path):
    _tree(tmp_path, {"requirements.txt": "six\n"})
    assert requirement_source(tmp_path, None) == ("requirements.txt", {"requirements.txt": "six\n"})
    _tree(tmp_path, {"pyproject.toml": "[project]\nname='x'\nversion='0'\ndependencies=['six']\n"})
    assert requirement_source(tmp_path, None)[0] == "pyproject.toml"
    _tree(tmp_path, {"uv.lock": "version = 1\n"})
    kind, files = requirement_source(tmp_path, None)
    assert kind == "uv.lock" and set(files) == {"uv.lock", "pyproject.toml"}
    given = _tree(tmp_path / "other", {"r.txt": "tomli\n"}) / "r.txt"
    assert requirement_source(tmp_path, given) == ("requirements.txt", {"requirements.txt": "tomli\n"})
    assert requirement_source(None, None) is None


def test_the_environment_key_is_what_defines_it():
    base = EnvSpec("requirements.txt", {"requirements.txt": "six==1.16.0\n"})
    assert base.key == EnvSpec("requirements.txt", {"requirements.txt": "six==1.16.0\n"}).key
    assert base.key != EnvSpec("requirements.txt", {"requirements.txt": "six==1.17.0\n"}).key
    assert base.key != EnvSpec("requirements.txt", base.files, index_url="http://10.0.0.9/simple/").key
    assert base.key != EnvSpec("requirements.txt", base.files, find_links=("/wheels",)).key


def test_train_builds_gpufleets_workloads_extra():
    reqs = workloads_requirements().split()
    assert any(r.startswith("torch") for r in reqs) and any(r.startswith("numpy") for r in reqs)
    assert not any(r.startswith(("pytest", "pulumi")) for r in reqs)


@pytest.mark.parametrize(
    "driver, index",
    [
        ("580.82.07", "cu130"),
        ("575.57.08", "cu128"),
        ("570.124.06", "cu128"),
        ("565.57.01", "cu126"),
        ("550.90.07", "cu124"),
        ("535.183.01", None),
    ],
)
def test_a_gpu_node_gets_the_torch_build_its_driver_runs(driver, index):
    url = node_agent.pick_torch_index(driver, [list(t) for t in TORCH_INDEXES])
    assert (url.rsplit("/", 1)[1] if url else None) == index


def test_the_resolvers_reason_is_one_line():
    uv = [
        "Using Python 3.11.2 environment at: /root/.gpufleet/envs/x",
        "  × No solution found when resolving dependencies:",
        "  ╰─▶ Because there is no version of nosuchpkg==9 and you require nosuchpkg==9, we can",
        "      conclude that your requirements are unsatisfiable.",
    ]
    assert node_agent.reason(uv) == (
        "Because there is no version of nosuchpkg==9 and you require nosuchpkg==9, we can "
        "conclude that your requirements are unsatisfiable."
    )
    plain = [  # uv without a terminal
        "Using Python 3.11.2 environment at: /root/.gpufleet/envs/x",
        "error: No solution found when resolving dependencies",
        "  cause: Because nosuchpkg was not found in the package registry and you require nosuchpkg, we can "
        "conclude that your requirements are unsatisfiable.",
    ]
    assert node_agent.reason(plain).startswith("Because nosuchpkg was not found in the package registry")
    assert node_agent.reason(["Collecting x", "ERROR: No matching distribution found for x"]) == (
        "ERROR: No matching distribution found for x"
    )


def test_the_node_agent_runs_on_the_standard_library_alone(tmp_path):
    """`python3 -S -I` (no site-packages, no user paths), its source on the command line, as a
    bare node runs it: an empty request answers with the home and nothing missing."""
    r = subprocess.run(
        [sys.executable, "-S", "-I", "-c", Path(node_agent.__file__).read_text(), "prepare"],
        input=json.dumps({"snapshots": [{"hash": "h", "dest": "snap/h", "files": [["a", "0" * 64, 420]]}]}),
        capture_output=True,
        text=True,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    (line,) = r.stdout.splitlines()
    result = json.loads(line.split(" ", 2)[2])
    assert result["home"] == str(tmp_path) and result["missing"] == ["0" * 64], r.stderr
    assert not (tmp_path / ".gpufleet" / "snap" / "h").exists()  # nothing placed without its files


def _refused(args: list[str], tmp_path: Path) -> str:
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n192.0.2.11\n")  # TEST-NET-1: nothing answers there, nothing may be tried
    r = CliRunner().invoke(main, [args[0], "--hostfile", str(hf), "--runs-dir", str(tmp_path / "runs"), *args[1:]])
    assert r.exit_code == 2, r.output
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert len(lines) == 1, r.output
    assert not (tmp_path / "runs").exists()
    return lines[0]


def test_a_sync_path_that_is_missing_or_a_file_is_one_line(tmp_path):
    line = _refused(["run", "--sync", str(tmp_path / "nope"), "--", "train.py"], tmp_path)
    assert "--sync" in line and "no such directory" in line
    f = _tree(tmp_path, {"train.py": "x"}) / "train.py"
    line = _refused(["exec", "--sync", str(f), "--", "true"], tmp_path)
    assert "is a file" in line and "give the directory" in line


def test_a_snapshot_over_sync_max_lists_its_largest_files_and_the_flag(tmp_path):
    d = _tree(tmp_path / "d", {"big.bin": "x" * 3000, "mid.bin": "x" * 2000, "small.py": "x"})
    line = _refused(["train", "--sync", str(d), "--sync-max", "4KB"], tmp_path)
    assert "is 5.0 kB, over 4.0 kB; largest: big.bin (3.0 kB), mid.bin (2.0 kB), small.py (1 B)" in line
    assert line.endswith("or allow it with --sync-max SIZE")


def test_python_with_a_requirements_source_is_refused(tmp_path):
    req = _tree(tmp_path, {"requirements.txt": "six\n"}) / "requirements.txt"
    line = _refused(["run", "--python", "/usr/bin/python3", "--requirements", str(req), "--", "x.py"], tmp_path)
    assert "--python /usr/bin/python3" in line and "drop one" in line
    line = _refused(["train", "--python", "/usr/bin/python3", "--index-url", "http://x/simple"], tmp_path)
    assert line.startswith("error: --index-url has no use with --python")


def test_the_console_script_lists_the_sync_and_environment_options():
    out = subprocess.run([LAUNCH, "run", "--help"], capture_output=True, text=True).stdout
    for flag in ("--sync DIR", "--sync-max SIZE", "--requirements FILE", "--index-url URL", "--find-links"):
        assert flag in out, flag


def test_a_prepared_job_checks_its_paths_on_the_node_and_its_record_keeps_them(tmp_path, capfd):
    """The node program's `prepared` step: a node that lacks what the launch prepared (a disk
    lost since) says which path, as its own error; the detached job's request carries the paths."""
    from launcher.cluster.discovery import parse_hostfile
    from launcher.core import node_start
    from launcher.core.program import ProgramBuilder
    from launcher.core.types import LaunchConfig, SshConfig, Workload
    from launcher.jobs.record import request_from_json, request_json

    there = tmp_path / "env" / "bin" / "python"
    there.parent.mkdir(parents=True)
    there.write_text("")
    gone = tmp_path / "work" / "job"
    cluster = parse_hostfile("10.0.0.2\n")
    config = LaunchConfig(
        Workload("exec", ("true",)), job_id="20260101-000000-abcdef", prepared=(str(there), str(gone))
    )
    plan = ProgramBuilder(cluster, config).program(cluster.nodes[0]).plan()
    with pytest.raises(node_start.Ended) as ended:  # the node's prepare steps, as the node runs them
        node_start.Start(plan.to_dict(), None).prepare()
    assert ended.value.rc == 71
    assert f"10.0.0.2 lacks {gone}, which the launch prepared" in capfd.readouterr().err
    back = request_from_json(
        json.loads(json.dumps(request_json(cluster, config, SshConfig(key=Path("k"), known_hosts=Path("kh"))))),
        [],
        tmp_path,
        tmp_path,
    )[1]
    assert back.prepared == config.prepared


def test_an_artifact_registry_index_gets_the_nodes_token_and_no_url_goes_on_a_command_line():
    ar = "https://us-central1-python.pkg.dev/proj/pypi/simple/"
    assert (
        node_agent.credentialed(ar, "T0K")
        == "https://oauth2accesstoken:T0K@us-central1-python.pkg.dev/proj/pypi/simple/"
    )
    assert node_agent.credentialed("http://10.0.0.9:8080/simple/", "T0K") == "http://10.0.0.9:8080/simple/"
    assert node_agent.credentialed("https://me:pw@x-python.pkg.dev/p/r/simple/", "T0K").startswith("https://me:pw@")
    assert node_agent.credentialed(ar, None) == ar
    spec = {
        "index_url": "http://10.0.0.9/simple/",
        "extra_index_urls": ["http://e/simple/"],
        "find_links": ["/w", "/v"],
    }
    uv = node_agent.index_env(spec, "UV_", "https://download.pytorch.org/whl/cu128")
    assert uv == {
        "UV_INDEX_URL": "http://10.0.0.9/simple/",
        "UV_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cu128 http://e/simple/",
        "UV_FIND_LINKS": "/w,/v",
    }
    assert node_agent.index_env(spec, "PIP_")["PIP_FIND_LINKS"] == "/w /v"


def test_a_dry_run_says_what_each_node_would_get_and_connects_to_nothing(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n192.0.2.11\n")  # TEST-NET-1: a connection would hang, not pass
    d = _tree(tmp_path / "proj", {"train.py": "x", "requirements.txt": "six\n"})
    r = subprocess.run(
        [LAUNCH, "run", "--hostfile", str(hf), "--dry-run", "--sync", str(d), "--", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    snap = take_snapshot(d)
    key = EnvSpec("requirements.txt", {"requirements.txt": "six\n"}).key
    assert f"each node gets: --sync {snap.hash} (2 files); environment {key} from requirements.txt (PyPI)" in r.stderr


def test_the_stack_output_package_index_is_the_default_and_index_url_wins():
    from launcher.cli.code_options import code_request
    from launcher.cluster.discovery import cluster_from_outputs

    ar = "https://us-central1-python.pkg.dev/proj/gpufleet-pypi/simple/"
    outputs = {"nodes": [{"name": "n0", "index": 0, "internalIp": "10.0.0.2"}], "packageIndex": ar}
    cluster = cluster_from_outputs(outputs)
    assert cluster.package_index == ar
    assert code_request({}, cluster, builtin=True).env.index_url == ar
    assert code_request({"index_url": "http://10.0.0.9/simple/"}, cluster, builtin=True).env.index_url == (
        "http://10.0.0.9/simple/"
    )
    del outputs["packageIndex"]
    assert code_request({}, cluster_from_outputs(outputs), builtin=True).env.index_url is None  # PyPI


def test_with_an_image_nothing_is_built_and_the_sync_directory_still_goes(tmp_path):
    from launcher.cli.code_options import code_request
    from launcher.cluster.discovery import parse_hostfile

    cluster = parse_hostfile("10.0.0.2\n")
    d = _tree(tmp_path / "proj", {"train.py": "x", "requirements.txt": "six\n"})
    request = code_request({"image": "localhost/py:1", "sync": d}, cluster, builtin=False)
    assert request.env is None and request.code is None and request.sync.hash == take_snapshot(d).hash
    # launch train / nccl-tests: gpufleet's own code goes too (a stock PyTorch image lacks it).
    builtin = code_request({"image": "localhost/py:1", "sync": d}, cluster, builtin=True)
    assert builtin.env is None and builtin.code is not None and builtin.sync.hash == request.sync.hash
    assert "workloads/train.py" in {f.path for f in builtin.code.files}
    with pytest.raises(UserError, match="--requirements builds an environment on the nodes, but the ranks run in"):
        code_request({"image": "localhost/py:1", "requirements": d / "requirements.txt"}, cluster, builtin=False)


def test_a_node_without_uv_installs_the_version_the_startup_script_pins_and_refuses_another_file(tmp_path):
    """find_uv pip-installs gpufleet.contracts.UV (the startup script's pin, infra/pins.py) by its
    hash: an index that offers a uv wheel of that version with other content is refused."""
    from gpufleet.contracts import UV, uv_requirement
    from infra import pins

    assert pins.UV is UV
    # A PEP 503 index (file://) whose uv page links a wheel of the pinned version, not PyPI's file.
    wheel = f"uv-{UV['version']}-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
    (tmp_path / "index" / "simple" / "uv").mkdir(parents=True)
    (tmp_path / "index" / wheel).write_bytes(b"not uv")
    (tmp_path / "index" / "simple" / "uv" / "index.html").write_text(f'<a href="../../{wheel}">{wheel}</a>\n')
    spec = EnvSpec(
        "requirements.txt", {"requirements.txt": "six\n"}, index_url=(tmp_path / "index" / "simple").as_uri()
    )
    env = spec.request(None)
    assert env["uv"] == uv_requirement() == f"uv=={UV['version']} --hash=sha256:{UV['sha256']}"
    source = Path(node_agent.__file__).read_text()
    r = subprocess.run(
        [
            sys.executable,
            "-S",
            "-I",
            "-c",
            f"{source}\nimport json\nfind_uv(json.loads({json.dumps(json.dumps(env))}))",
            "find-uv",
        ],
        capture_output=True,
        text=True,
        env={"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert r.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in r.stderr, r.stdout + r.stderr
    requirements = tmp_path / "home" / ".gpufleet" / "uv" / "requirements.txt"
    assert requirements.read_text() == uv_requirement() + "\n"
    assert not (tmp_path / "home" / ".gpufleet" / "uv" / node_agent.DONE).exists()


def test_a_launch_with_a_hang_timeout_asks_for_pinned_py_spy_from_the_jobs_own_index():
    from launcher.code.prepare import CodeRequest, _request
    from launcher.core.stacks import PYSPY_TOOLS, PYSPY_VERSION

    env = EnvSpec(
        "requirements.txt",
        {"requirements.txt": "torch\n"},
        index_url="http://10.0.0.9:8080/simple/",
        extra_index_urls=("http://10.0.0.8/simple/",),
        find_links=("/wheels",),
    )
    tools = _request(CodeRequest(env=env), "j", stacks=True)["tools"]
    # Where the node agent builds it (~/.gpufleet/tools/KEY) is where the stacks program looks.
    assert f".gpufleet/tools/{tools['key']}" == PYSPY_TOOLS and tools["program"] == "py-spy"
    assert tools["files"] == {"requirements.txt": f"py-spy=={PYSPY_VERSION}\n"}
    assert (tools["index_url"], tools["extra_index_urls"], tools["find_links"]) == (
        "http://10.0.0.9:8080/simple/",
        ["http://10.0.0.8/simple/"],
        ["/wheels"],
    )
    assert tools["torch_indexes"] == []  # py-spy's wheel is one binary: no CUDA index
    assert _request(CodeRequest(env=env), "j", stacks=False)["tools"] is None
    assert _request(CodeRequest(), "j", stacks=True)["tools"] is None  # nothing built: nothing to add


def test_the_tools_environment_is_not_built_where_the_jobs_environment_has_py_spy(tmp_path, monkeypatch):
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "py-spy").write_text("#!/bin/sh\n")
    (bin_dir / "py-spy").chmod(0o755)
    built = []
    monkeypatch.setattr(node_agent, "build_env", lambda *a, **k: built.append(a))
    tools = {"key": "py-spy-0.4.3", "program": "py-spy"}
    assert node_agent.build_tools(tools, str(bin_dir / "python")) is None and built == []
    (bin_dir / "py-spy").unlink()
    assert node_agent.build_tools(tools, str(bin_dir / "python")) is None
    assert [b[:2] for b in built] == [(tools, "tools")]

    def fail(*a, **k):
        raise node_agent.BuildError("Because py-spy==0.4.3 was not found in the package registry")

    monkeypatch.setattr(node_agent, "build_env", fail)
    assert node_agent.build_tools(tools, str(bin_dir / "python")).startswith("Because py-spy")


@pytest.mark.parametrize(
    "url",
    [
        "https://evil.example?.pkg.dev/simple/",
        "https://evil.example#.pkg.dev/simple/",
        "https://evil.example/.pkg.dev/simple/",
        "https://us-python.pkg.dev.evil.example/p/r/simple/",
        "http://us-python.pkg.dev/p/r/simple/",  # plain HTTP: the token would cross the network in clear
    ],
)
def test_the_token_goes_only_to_a_host_that_is_artifact_registrys(url):
    assert node_agent.credentialed(url, "T0K") == url
    assert not node_agent.artifact_registry(url)


def test_credentials_in_an_index_url_are_redacted_everywhere_they_could_be_shown(capsys):
    assert node_agent.redact("from https://me:s3cret@idx.example/simple/ and http://tok@h/") == (
        "from https://me:****@idx.example/simple/ and http://****@h/"
    )
    node_agent.say("progress", "installing uv (pip, from https://me:s3cret@idx.example/simple/)")
    assert (
        capsys.readouterr().out
        == "gpufleet-prepare: progress installing uv (pip, from https://me:****@idx.example/simple/)\n"
    )
    env = {"index_url": "http://me:s3cret@10.0.0.9:8080/simple/", "extra_index_urls": ["https://x/simple/"]}
    assert node_agent.trusted_hosts(env) == ["10.0.0.9"]


def test_an_index_url_with_a_user_and_password_is_probed_with_them_as_a_header(tmp_path):
    import http.server
    import threading

    seen: list[str | None] = []

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization"))
            self.send_response(200 if seen[-1] else 404)
            self.end_headers()
            self.wfile.write(b"<html></html>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://me:s%40cret@127.0.0.1:{server.server_port}/simple/"
        assert node_agent.reachable(url) is None
        assert seen == ["Basic bWU6c0BjcmV0"]  # base64 of me:s@cret
    finally:
        server.shutdown()
    # Unreachable, the node's error names the index without its password.
    env = {
        "key": "k" * 16,
        "kind": "requirements.txt",
        "files": {},
        "index_url": "http://me:s3cret@127.0.0.1:1/simple/",
    }
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c", Path(node_agent.__file__).read_text(), "prepare"],
        input=json.dumps({"env": env}).encode(),
        capture_output=True,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    result = json.loads(r.stdout.decode().splitlines()[-1].split(" ", 2)[2])
    assert "http://me:****@127.0.0.1:1/simple/ cannot be reached" in result["error"]
    assert b"s3cret" not in r.stdout + r.stderr


def test_a_dry_run_shows_no_index_password(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n")
    d = _tree(tmp_path / "proj", {"train.py": "x", "requirements.txt": "six\n"})
    argv = ["run", "--hostfile", str(hf), "--dry-run", "--sync", str(d), "--index-url", "https://me:s3cret@idx/simple/"]
    r = CliRunner().invoke(main, [*argv, "--", "train.py"])
    assert r.exit_code == 0, r.output
    assert "(https://me:****@idx/simple/)" in r.output and "s3cret" not in r.output


def test_a_snapshot_keeps_owner_only_modes_and_never_widens_one(tmp_path):
    _tree(tmp_path, {"secret.env": "K=v\n", "run.sh": "#!/bin/sh\n", "shared.txt": "x", "group.txt": "y"})
    (tmp_path / "secret.env").chmod(0o600)
    (tmp_path / "run.sh").chmod(0o700)
    (tmp_path / "shared.txt").chmod(0o644)
    (tmp_path / "group.txt").chmod(0o664)
    modes = {f.path: oct(f.mode) for f in take_snapshot(tmp_path).files}
    assert modes == {"group.txt": "0o644", "run.sh": "0o700", "secret.env": "0o600", "shared.txt": "0o644"}


def test_a_copied_snapshot_on_the_node_keeps_its_files_modes(tmp_path, monkeypatch):
    store = tmp_path / ".gpufleet" / "objects"
    store.mkdir(parents=True)
    body = b"K=v\n"
    sha = hashlib.sha256(body).hexdigest()
    (store / sha).write_bytes(body)
    monkeypatch.setattr(node_agent, "G", str(tmp_path / ".gpufleet"))
    monkeypatch.setattr(node_agent, "OBJECTS", str(store))
    node_agent.place({"dest": "work/j1", "files": [["secret.env", sha, 0o600]], "copy": True})
    assert oct((tmp_path / ".gpufleet" / "work" / "j1" / "secret.env").stat().st_mode & 0o777) == "0o600"


def test_a_link_leaving_the_directory_is_refused_naming_it_unless_followed(tmp_path):
    outside = _tree(tmp_path / "outside", {"id_key": "PRIVATE\n"})
    proj = _tree(tmp_path / "proj", {"train.py": "x", "data/inner.txt": "in\n"})
    (proj / "inner-link").symlink_to(proj / "data" / "inner.txt")
    assert "inner-link" in [f.path for f in take_snapshot(proj).files]  # a link inside DIR is fine
    (proj / "key").symlink_to(Path("..") / "outside" / "id_key")
    with pytest.raises(
        UserError, match=r"key is a link to .*outside/id_key, outside the directory.*--sync-follow-links"
    ):
        take_snapshot(proj)
    assert "key" in [f.path for f in take_snapshot(proj, follow_links=True).files]
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n")  # TEST-NET-1: nothing is reached
    r = CliRunner().invoke(main, ["run", "--hostfile", str(hf), "--dry-run", "--sync", str(proj), "--", "x"])
    assert outside.is_dir() and r.exit_code == 2 and "outside the directory" in r.output, r.output


def test_git_info_exclude_and_core_excludes_file_are_honoured_as_git_orders_them(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _tree(
        repo, {".gitignore": "!keep.tmp\n", "a.tmp": "", "keep.tmp": "", "b.key": "", "sub/c.key": "", "sub/x.py": ""}
    )
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("*.tmp\n/sub/c.key\n")
    home = tmp_path / "home"
    (home / ".config" / "git").mkdir(parents=True)
    (home / ".config" / "git" / "ignore").write_text("*.key\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    paths = [f.path for f in take_snapshot(repo).files]
    # .gitignore's `!keep.tmp` outranks info/exclude's `*.tmp`, as in git.
    assert paths == [".gitignore", "keep.tmp", "sub/x.py"]
    git = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "--others", "--exclude-standard"], capture_output=True, text=True
    )
    assert sorted(git.stdout.split()) == paths
    # A subdirectory of the repository: the rules anchored at its top still apply.
    assert [f.path for f in take_snapshot(repo / "sub").files] == ["x.py"]
    # core.excludesFile replaces the default file.
    (tmp_path / "mine").write_text("x.py\n")
    subprocess.run(["git", "-C", str(repo), "config", "core.excludesFile", str(tmp_path / "mine")], check=True)
    paths = [f.path for f in take_snapshot(repo).files]
    assert paths == [".gitignore", "b.key", "keep.tmp"]
    git = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "--others", "--exclude-standard"], capture_output=True, text=True
    )
    assert sorted(git.stdout.split()) == paths


def test_a_name_that_is_not_utf8_is_one_line(tmp_path):
    _tree(tmp_path, {"ok.py": "x"})
    (tmp_path / os.fsdecode(b"caf\xe9.txt")).write_text("latin-1 name")
    with pytest.raises(UserError, match=r"the name b'caf\\xe9.txt' is not UTF-8; rename it"):
        take_snapshot(tmp_path)
    (tmp_path / ".gpufleetignore").write_text("caf*\n")
    assert [f.path for f in take_snapshot(tmp_path).files] == [".gpufleetignore", "ok.py"]


@pytest.mark.parametrize(
    ("pattern", "ignored", "kept"),
    [
        ("[z-a]", ["z"], ["a", "m", "-"]),  # a reversed range: its first character alone, in git
        ("[[:alpha:]]", ["a", "Z"], ["1", "_"]),
        ("x[[:digit:]x]", ["x1", "xx"], ["xa"]),
        ("[!a]", ["b"], ["a"]),
        ("[^a]", ["b"], ["a"]),
        ("[]]", ["]"], ["a"]),
        ("[a-]", ["a", "-"], ["b"]),
        ("[abc", [], ["[abc", "a"]),  # unclosed: git's wildmatch matches nothing
    ],
)
def test_bracket_expressions_are_read_as_git_reads_them(tmp_path, pattern, ignored, kept):
    from launcher.code.snapshot import _ignored

    rules = parse_rules(pattern + "\n")
    assert [n for n in ignored + kept if _ignored(rules, n, False)] == ignored
    # git agrees (check-ignore exits 0 for an ignored path, 1 for one it keeps)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(pattern + "\n")
    for name in ignored + kept:
        r = subprocess.run(["git", "-C", str(tmp_path), "check-ignore", "-q", "--no-index", name])
        assert r.returncode == (0 if name in ignored else 1), name


def test_an_unknown_character_class_is_one_line_naming_the_file_and_line(tmp_path):
    _tree(tmp_path, {".gitignore": "*.log\n[[:vowel:]]\n", "a.py": ""})
    with pytest.raises(UserError, match=r"\.gitignore line 2: the pattern '\[\[:vowel:\]\]' cannot be read"):
        take_snapshot(tmp_path)
