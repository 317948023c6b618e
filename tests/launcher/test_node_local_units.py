"""The node's per-account local directory (launcher.core.node_start.local_dir, keyed by
launcher.core.node_local.compile_cache_key), run for real as a node runs it (the system python3,
isolated, nothing of gpufleet on its path): where the local checkpoint tier and the compile caches
go, and what is never used."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from launcher.core import node_start
from launcher.core.node_local import compile_cache_key
from launcher.core.types import LaunchConfig, Workload

VARS = ("GPUFLEET_LOCAL_DIR", "GPUFLEET_LOCAL_CHECKPOINT_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _key(config) -> str:
    return compile_cache_key(config.python, config.env, config.image)


def _config(**kw) -> LaunchConfig:
    return LaunchConfig(workload=Workload("exec", ("true",)), job_id="j", **kw)


# node_start's code as it travels (it imports nothing of gpufleet), then the step and the variables it exported.
SOURCE = Path(node_start.__file__).read_text() + (
    "\nimport sys\nlocal_dir(sys.argv[1])\nfor v in sys.argv[2:]:\n    print(v + '=' + os.environ.get(v, 'unset'))\n"
)


def _run(config: LaunchConfig, home: Path, env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The node's step, then the variables it exported; and stderr."""
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    base.update(HOME=str(home), GPUFLEET_LOCAL_SSD_MOUNT=str(home / "no-ssd"))
    base.update(env or {})
    argv = ["python3", "-I", "-S", "-c", SOURCE, _key(config), *VARS]
    p = subprocess.run(argv, env=base, capture_output=True, text=True, check=True)
    return dict(line.split("=", 1) for line in p.stdout.splitlines()), p.stderr


def test_without_a_local_ssd_everything_goes_under_a_private_home_directory(tmp_path):
    config = _config(python="/h/.gpufleet/envs/k/bin/python")
    out, err = _run(config, tmp_path)
    local = tmp_path / ".gpufleet" / "local"
    key = _key(config)
    assert out == {
        "GPUFLEET_LOCAL_DIR": str(local),
        "GPUFLEET_LOCAL_CHECKPOINT_DIR": f"{local}/checkpoints",
        "TORCHINDUCTOR_CACHE_DIR": f"{local}/compile/{key}/inductor",
        "TRITON_CACHE_DIR": f"{local}/compile/{key}/triton",
    }
    for p in (tmp_path / ".gpufleet", local, local / "compile", local / "compile" / key):
        assert p.stat().st_mode & 0o777 == 0o700, p
    assert err == ""


def test_the_compile_caches_are_keyed_by_the_environment_not_by_the_job():
    a = _config(python="/e/1/bin/python", env=(("VIRTUAL_ENV", "/e/1"),))
    assert _key(a) == _key(
        LaunchConfig(workload=Workload("exec", ("x",)), job_id="other", python="/e/1/bin/python", env=a.env)
    )
    assert _key(a) != _key(_config(python="/e/2/bin/python", env=(("VIRTUAL_ENV", "/e/2"),)))
    assert _key(a) != _key(_config(python="/e/1/bin/python", env=a.env, image="img:1"))


def test_the_users_own_values_win(tmp_path):
    out, _ = _run(_config(), tmp_path, {"TRITON_CACHE_DIR": "/mine", "GPUFLEET_LOCAL_CHECKPOINT_DIR": "/ckpt"})
    assert out["TRITON_CACHE_DIR"] == "/mine" and out["GPUFLEET_LOCAL_CHECKPOINT_DIR"] == "/ckpt"
    assert out["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / ".gpufleet" / "local"))


def test_a_local_directory_open_to_other_accounts_is_never_used(tmp_path):
    local = tmp_path / ".gpufleet" / "local"
    local.mkdir(parents=True, mode=0o700)
    local.chmod(0o777)  # another account could have put caches here for us to load
    out, _ = _run(_config(), tmp_path)
    assert set(out.values()) == {"unset"}


def test_a_link_in_place_of_the_local_directory_is_never_followed(tmp_path):
    (tmp_path / ".gpufleet").mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / ".gpufleet" / "local").symlink_to(tmp_path / "elsewhere")
    out, _ = _run(_config(), tmp_path)
    assert set(out.values()) == {"unset"}


def test_the_peer_tiers_receiver_finds_the_root_the_node_program_gives_the_ranks(tmp_path, small_tmpfs):
    """The receiver of peer copies (gpufleet.local_tier.default_root, in Python: it runs under
    sshd's forced command, with no node program around it) and the node program follow one
    rule: without a local SSD, with one, and with one whose directory another account made."""
    from gpufleet.local_tier import default_root

    if os.geteuid() != 0:
        import pytest

        pytest.skip("needs root: a mount, and a directory of another uid")
    mount = small_tmpfs(1 << 20)
    os.chmod(mount, 0o1777)
    for case in ("no ssd", "ssd", "ssd of another account"):
        home = tmp_path / case.replace(" ", "-")
        home.mkdir()
        mounts = [] if case == "no ssd" else [str(mount)]
        if case == "ssd of another account":
            other = mount / f"gpufleet-{os.geteuid()}"
            other.chmod(0o700)
            os.chown(other, 4242, 4242)
        out, _ = _run(_config(), home, env={"GPUFLEET_LOCAL_SSD_MOUNT": mounts[0] if mounts else str(home / "x")})
        assert out["GPUFLEET_LOCAL_CHECKPOINT_DIR"] == str(default_root(str(home), mounts=mounts)), case
