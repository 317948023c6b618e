"""--image without a container runtime: the wiring per machine family (gpufleet.containers), the
runtime argv (launcher.core.container), the dry run of every family, the bad-input refusals, the
pull's verdict lines and the RxDM pre-start check. No network; the rendered wrapper runs for real
under local bash with a recording runtime where its shell behaviour matters."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpufleet.catalog import lookup
from gpufleet.containers import GPU_DEVICES, GPUS_ALL, wiring
from gpufleet.node_plan import CheckKind, EnvVar, Limits, NodePlan
from launcher.cli import main
from launcher.core.container import (
    check_image_ref,
    container_argv,
    container_name,
    parse_pull_line,
)
from launcher.core.node_plan import container_of, hardware_checks
from launcher.core.preflight import Probe
from launcher.core.program import _node_run_source
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.health import prestart_verdict
from tests.launcher import dry_runs

IMAGE = "us-docker.pkg.dev/proj/train/torch:2.13"


def _mounts(w):
    return {m.host: (m.container, m.read_only) for m in w.mounts}


def test_a3_high_on_cos_gets_tcpx_the_rxdm_sockets_the_cos_driver_and_the_gpu_devices():
    w = wiring(lookup("a3-highgpu-8g"))  # COS is its default image
    assert w.gpus == GPU_DEVICES
    assert w.devices == (*(f"/dev/nvidia{i}" for i in range(8)), "/dev/nvidia-uvm", "/dev/nvidiactl")
    m = _mounts(w)
    assert m["/var/lib/tcpx/lib64"] == ("/var/lib/tcpx/lib64", True)
    assert m["/run/tcpx"] == ("/run/tcpx", False)
    assert m["/var/lib/nvidia/lib64"] == ("/usr/local/nvidia/lib64", True)
    assert w.library_path == ("/var/lib/tcpx/lib64", "/usr/local/nvidia/lib64")
    assert ("--ulimit", "memlock=-1") in w.options and ("--cap-add", "IPC_LOCK") in w.options


def test_a3_mega_gets_tcpxo_and_the_aperture_devices_with_the_container_toolkit_on_ubuntu():
    w = wiring(lookup("a3-megagpu-8g"))
    assert w.gpus == GPUS_ALL and w.devices == ()
    m = _mounts(w)
    assert m["/var/lib/tcpxo/lib64"] == ("/var/lib/tcpxo/lib64", True)
    assert m["/dev/aperture_devices"] == ("/dev/aperture_devices", False)
    assert "/var/lib/nvidia/lib64" not in m
    cos = wiring(lookup("a3-megagpu-8g"), "cos")
    assert (
        cos.gpus == GPU_DEVICES and "/var/lib/nvidia/lib64" in _mounts(cos) and "/dev/aperture_devices" in _mounts(cos)
    )


def test_a2_gets_the_fast_socket_plugin_and_no_machine_type_gets_no_gpus():
    w = wiring(lookup("a2-highgpu-8g"))
    assert w.gpus == GPUS_ALL and "/usr/lib/libnccl-net.so" in _mounts(w)
    plain = wiring(None)
    assert plain.gpus is None and plain.mounts == () and plain.devices == () and plain.options == ()


def test_the_argv_passes_variables_by_name_prepends_library_paths_and_names_the_container():
    env = {"NCCL_SOCKET_IFNAME": "eth0", "WANDB_API_KEY": "s3cret", "LD_LIBRARY_PATH": "/var/lib/tcpxo/lib64"}
    argv = container_argv(wiring(lookup("a3-megagpu-8g")), IMAGE, "gpufleet-j-1", "j-1", env, ["python3", "x.py"])
    assert argv[:3] == ["gpufleet-container", "gpufleet-j-1", "all"]  # node_run's `container`, NAME, GPUS
    assert "s3cret" not in " ".join(argv)  # values stay off the command line
    i = argv.index(IMAGE)
    opts, command = argv[: i + 1], argv[i + 1 :]
    assert ["-e", "WANDB_API_KEY"] == opts[opts.index("WANDB_API_KEY") - 1 : opts.index("WANDB_API_KEY") + 1]
    assert "GPUFLEET_RUN=j-1" in opts and "LD_LIBRARY_PATH" not in opts
    for flag in ("--network", "--ipc", "--pid"):
        assert opts[opts.index(flag) + 1] == "host"
    assert (
        command[:2] == ["sh", "-c"] and "export LD_LIBRARY_PATH=/var/lib/tcpxo/lib64${LD_LIBRARY_PATH:+" in command[2]
    )
    assert command[-2:] == ["python3", "x.py"]
    assert container_name("20260101-000000-abc123", 3) == "gpufleet-20260101-000000-abc123-3"


def _wrapper(argv: list[str]) -> list[str]:
    """The wrapper `argv` names, as the node program runs it (launcher.core.node_run's `container`,
    its code as it travels, in the system python3)."""
    assert argv[0] == "gpufleet-container"
    return ["/usr/bin/python3", "-I", "-S", "-c", _node_run_source(), "container", *argv[1:]]


@pytest.fixture
def fake_runtime(tmp_path):
    """A runtime that records each call and, for `run`, runs the command after the image in the
    background the way a runtime client waits on its container."""
    log = tmp_path / "calls"
    rt = tmp_path / "rt"
    rt.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {shlex.quote(str(log))}\n'
        '[ "$1" = run ] || exit 0\n'
        'while [ "$1" != IMAGE ]; do shift; done; shift; "$@" & wait $!\n'
    )
    rt.chmod(0o755)
    return rt, log


def test_the_wrapper_outlives_sigterm_and_removes_its_container_after_the_run_ends(fake_runtime, tmp_path):
    rt, log = fake_runtime
    done = tmp_path / "done"
    argv = container_argv(
        wiring(None), "IMAGE", "gpufleet-j-0", "j-0", {}, ["bash", "-c", f"sleep 1; echo ok > {done}"]
    )
    proc = subprocess.Popen(_wrapper(argv), cwd=tmp_path, env={**os.environ, "GPUFLEET_CONTAINER_RUNTIME": str(rt)})
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # the stop's SIGTERM to the group: the wrapper waits on
    assert proc.wait(timeout=20) == 0
    calls = log.read_text().splitlines()
    assert calls[0].startswith("run --rm --name gpufleet-j-0 --user ") and f"src={tmp_path},dst={tmp_path}" in calls[0]
    assert calls[-1] == "rm -f gpufleet-j-0" and done.read_text() == "ok\n"  # a stop reached it
    log.unlink()
    clean = subprocess.run(_wrapper(argv), cwd=tmp_path, env={**os.environ, "GPUFLEET_CONTAINER_RUNTIME": str(rt)})
    assert clean.returncode == 0 and len(log.read_text().splitlines()) == 1  # --rm removed it: no rm -f


def test_the_wrapper_carries_no_run_token_and_passes_it_into_the_container(tmp_path):
    """Started by the node's run (node_run `run`), the wrapper's own environment has no token (the
    watchdog's SIGKILL of token processes spares it, to remove the container); `-e` passes it in."""
    log, rt = tmp_path / "calls", tmp_path / "rt"
    rt.write_text(f'#!/bin/bash\necho "token=[$GPUFLEET_RUN] $*" >> {shlex.quote(str(log))}\n')
    rt.chmod(0o755)
    argv = container_argv(wiring(None), "IMAGE", "gpufleet-j-0", "j-0", {}, ["true"])
    plan = NodePlan(
        job_id="j", attempt=0, node_rank=0, nnodes=1, host="h", address="127.0.0.1", procs=1, ranks=None,
        command=("true",), argv=tuple(argv), workload="exec",
        env=(EnvVar("GPUFLEET_RUN", "j-0"),), limits=Limits(5.0, False), container=container_of(argv)[0],
    )  # fmt: skip
    env = {**os.environ, "GPUFLEET_CONTAINER_RUNTIME": str(rt)}
    p = subprocess.Popen(
        ["python3", "-I", "-S", "-c", _node_run_source(), "run", plan.to_json()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = p.stdout.read()  # the launcher's stdin stays open: its end would be a stop
    p.stdin.close()
    assert p.wait(timeout=60) == 0 and out.endswith(b"__GPUFLEET_EXIT__ 0\n"), out
    (call,) = log.read_text().splitlines()
    assert call.startswith("token=[] run --rm --name gpufleet-j-0 ") and "GPUFLEET_RUN=j-0" in call


def test_the_node_local_directory_and_its_variables_reach_the_container_only_where_the_node_has_them(tmp_path):
    log, rt = tmp_path / "calls", tmp_path / "rt"
    rt.write_text(f"#!/bin/bash\nprintf '[%s]' \"$@\" >> {shlex.quote(str(log))}; echo >> {shlex.quote(str(log))}\n")
    rt.chmod(0o755)  # records each word of each call in brackets
    # A user's --env value of one of them travels as the node exports it: by the wrapper, once.
    argv = container_argv(wiring(None), "IMAGE", "gpufleet-j-0", "j-0", {"TRITON_CACHE_DIR": "/t"}, ["true"])
    assert "TRITON_CACHE_DIR" not in argv
    local = tmp_path / "home with space" / ".gpufleet" / "local"  # as node_local exports it
    local.mkdir(parents=True)
    exported = {
        "GPUFLEET_LOCAL_DIR": str(local),
        "GPUFLEET_LOCAL_CHECKPOINT_DIR": f"{local}/checkpoints",
        "TORCHINDUCTOR_CACHE_DIR": f"{local}/compile/k/inductor",
        "TRITON_CACHE_DIR": f"{local}/compile/k/triton",
    }
    base = {k: v for k, v in os.environ.items() if k not in exported}
    base["GPUFLEET_CONTAINER_RUNTIME"] = str(rt)
    assert subprocess.run(_wrapper(argv), cwd=tmp_path, env={**base, **exported}).returncode == 0
    (run,) = log.read_text().splitlines()
    assert f"[--mount][type=bind,src={local},dst={local}]" in run  # one word, spaces and all, read-write
    assert all(f"[-e][{name}]" in run for name in exported) and run.count("TRITON_CACHE_DIR") == 1
    assert run.index(str(local)) < run.index("[IMAGE]")  # run options, before the image
    log.unlink()
    # No directory found on the node (nothing exported): no mount, no variable.
    assert subprocess.run(_wrapper(argv), cwd=tmp_path, env=base).returncode == 0
    (run,) = log.read_text().splitlines()
    assert str(local) not in run and not any(name in run for name in exported)


def test_no_runtime_on_the_node_is_one_error_line(tmp_path):
    argv = container_argv(wiring(None), "IMAGE", "n", "t", {}, ["true"])
    r = subprocess.run(
        _wrapper(argv), capture_output=True, text=True, env={"PATH": str(tmp_path)}
    )  # no docker, no podman
    assert r.returncode == 127 and r.stderr.count("\n") == 1 and "no container runtime" in r.stderr


@pytest.mark.parametrize("bad", ["repo/UPPER", "img; rm -rf ~", "a b", "-rm", "x:tag with space", ""])
def test_a_bad_image_reference_is_refused(bad):
    with pytest.raises(ValueError, match="not an image reference"):
        check_image_ref(bad)
    assert check_image_ref("localhost:5000/gpufleet/py:1") and check_image_ref(f"{IMAGE}@sha256:{'a' * 64}")


def test_pull_lines_parse():
    assert parse_pull_line("gpufleet-image: ok sha256:ab present") == ("present", "sha256:ab", "")
    assert parse_pull_line("gpufleet-image: ok sha256:ab pulled") == ("pulled", "sha256:ab", "")
    assert parse_pull_line("gpufleet-image: ok sha256:ab local Error: x: y") == ("local", "sha256:ab", "Error: x: y")
    assert parse_pull_line("gpufleet-image: error manifest unknown") == ("error", "", "manifest unknown")
    assert parse_pull_line("Copying blob 123") is None


# ---- the CLI: dry runs of every family, and the refusals -------------------------------------


def _outputs(tmp_path: Path, machine_type: str, image: str | None = None) -> Path:
    doc = {
        "cluster": "demo",
        "zone": "us-central1-a",
        "machineType": machine_type,
        "nodes": [
            {"name": f"n{i}", "index": i, "internalIp": f"192.0.2.{10 + i}", "externalIp": None} for i in range(2)
        ],
    }
    if image:
        doc["image"] = image
    f = tmp_path / f"{machine_type}.json"
    f.write_text(json.dumps(doc))
    return f


def _dry(tmp_path, *args, command="run"):
    """The JSON dry run of a launch on the two nodes: (its result, each node's program as bash
    gets it, in rank order)."""
    argv = [command, *args, "--dry-run=json", "--runs-dir", str(tmp_path / "runs"), "--"]
    r = CliRunner().invoke(main, [*argv, "t.py"] if command == "run" else [*argv, "nvidia-smi"])
    assert r.exit_code == 0, r.output
    lines = dry_runs.remote_lines(r.stdout)
    assert len(lines) == 2
    programs = dry_runs.programs(r.stdout)
    assert [shlex.split(remote)[-1] for _, remote in lines] == programs
    return r, programs


@pytest.mark.parametrize(
    "machine_type, image_os, want, absent",
    [
        ("a2-highgpu-8g", None, [" all ", "src=/usr/lib/libnccl-net.so"], ["/dev/nvidia0", "tcpx"]),
        (
            "a3-highgpu-8g",
            None,
            [
                "src=/var/lib/tcpx/lib64",
                "src=/run/tcpx,dst=/run/tcpx",
                "--device /dev/nvidia7",
                "/usr/local/nvidia/lib64",
            ],
            ["aperture"],
        ),
        (
            "a3-megagpu-8g",
            None,
            ["src=/var/lib/tcpxo/lib64", "src=/dev/aperture_devices", "-e NCCL_FASTRAK_IFNAME", " all "],
            ["/dev/nvidia0", "/var/lib/nvidia"],
        ),
        (
            "a3-megagpu-8g",
            "cos",
            [
                "src=/var/lib/nvidia/lib64,dst=/usr/local/nvidia/lib64",
                "--device /dev/nvidiactl",
                "src=/dev/aperture_devices",
            ],
            [],
        ),
    ],
)
def test_dry_run_prints_each_nodes_container_command_with_its_familys_wiring(
    tmp_path, machine_type, image_os, want, absent
):
    extra = ["--image-os", image_os] if image_os else []
    r, programs = _dry(tmp_path, "--outputs", str(_outputs(tmp_path, machine_type)), "--image", IMAGE, *extra)
    for rank, (program, plan) in enumerate(zip(programs, dry_runs.plans(r.stdout))):
        # The typed plan names the container its run starts (its argv): image, name and mounts.
        c, inner = plan.container, shlex.join(plan.argv)
        assert c is not None and c.image == IMAGE and c.name.endswith(f"-{rank}")
        assert program.endswith(" node " + shlex.quote(plan.to_json()))
        assert c.mounts and all(f"src={m.host},dst={m.container}" in inner for m in c.mounts)
        assert plan.command[:3] == ("python3", "-m", "torch.distributed.run") and plan.command[-1] == "t.py"
        assert f" {IMAGE} " in inner and "--network host --ipc host --pid host" in inner
        assert "gpufleet-container gpufleet-" in inner and f"-{rank} " in inner.split("gpufleet-container ")[1][:40]
        assert "-m torch.distributed.run" in inner and "python3" in inner
        for w in want:
            assert w in inner, (w, machine_type)
        for a in absent:
            assert a not in inner.split("gpufleet-container")[1], (a, machine_type)
        # The node's torch is not asked about: it is the image's.
        assert all(c.kind is not CheckKind.TORCH_VERSION for c in plan.checks)
    assert f"container {IMAGE} on every node" in r.stderr


def test_the_stacks_image_output_is_the_default_and_image_overrides_it(tmp_path):
    out = _outputs(tmp_path, "a3-megagpu-8g", image="us-docker.pkg.dev/p/r/default:1")
    r, _ = _dry(tmp_path, "--outputs", str(out))
    assert all(" us-docker.pkg.dev/p/r/default:1 " in shlex.join(p.argv) for p in dry_runs.plans(r.stdout))
    r, programs = _dry(tmp_path, "--outputs", str(out), "--image", IMAGE)
    assert all("default:1" not in p and IMAGE in p for p in programs)
    r, plain = _dry(tmp_path, "--outputs", str(_outputs(tmp_path, "a3-megagpu-8g")))
    assert all(plan.container is None for plan in dry_runs.plans(r.stdout))


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--image", IMAGE, "--python", "/opt/py/bin/python"], "--image runs the image's own python3"),
        (["--image", "Not An Image"], "--image 'Not An Image' is not an image reference"),
    ],
)
def test_bad_image_input_is_one_line_and_exit_2(tmp_path, args, culprit):
    r = CliRunner().invoke(
        main, ["run", "--outputs", str(_outputs(tmp_path, "a3-highgpu-8g")), *args, "--dry-run", "--", "t.py"]
    )
    assert r.exit_code == 2, r.output
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert line.startswith("error: ") and culprit in line


def test_a_bad_image_output_names_the_stack_config(tmp_path):
    r = CliRunner().invoke(
        main, ["run", "--outputs", str(_outputs(tmp_path, "a2-highgpu-8g", image="x y")), "--dry-run", "--", "t.py"]
    )
    assert r.exit_code == 2 and "output `image` is 'x y'" in r.output and "gpufleet:containerImage" in r.output


def test_exec_takes_image_too(tmp_path):
    r, programs = _dry(
        tmp_path, "--outputs", str(_outputs(tmp_path, "a2-highgpu-8g")), "--image", IMAGE, command="exec"
    )
    assert all(shlex.join(q.argv).endswith(f"{IMAGE} nvidia-smi") for q in dry_runs.plans(r.stdout))
    assert (
        len(programs) == 2
        and [(q.command, q.container.image) for q in dry_runs.plans(r.stdout)] == [(("nvidia-smi",), IMAGE)] * 2
    )


# ---- RxDM before a job on A3 High / Mega -------------------------------------------------------


def _probe(node: Node, **facts: str) -> Probe:
    gpu = "0, NVIDIA H100 80GB HBM3, GPU-0, 00000000:04:00.0, 81559, 580.159.04, Enabled, 0, No, No, 30, 70, 0"
    base = {"smi_rc": "0", **{f"gpu.{i}": gpu.replace("0, NVIDIA", f"{i}, NVIDIA", 1) for i in range(8)}}
    base.update({f"nic.eth{i}": "up 8244 0x1003" for i in range(5)})
    return Probe(node, ok=True, facts={**base, **facts})


def test_the_check_asks_for_rxdm_on_tcpx_and_tcpxo_nodes_only():
    for mt, asks in (("a3-highgpu-8g", True), ("a3-megagpu-8g", True), ("a2-highgpu-8g", False)):
        c = Cluster("c", (Node(0, "a", "a"),), mt)
        assert any(ch.kind is CheckKind.RXDM for ch in hardware_checks(c, None)) is asks


def test_rxdm_down_on_a_node_refuses_the_launch_naming_that_node():
    nodes = (Node(0, "10.0.0.2", "10.0.0.2"), Node(1, "10.0.0.3", "10.0.0.3"))
    c = Cluster("c", nodes, "a3-highgpu-8g")
    config = LaunchConfig(Workload("torchrun", ("t.py",)), job_id="j", image=IMAGE)
    up = {0: _probe(nodes[0], rxdm_rc="0", rxdm="3f2a9c1e7b44"), 1: _probe(nodes[1], rxdm_rc="0", rxdm="9a")}
    assert prestart_verdict(c, up, config) == []
    down = {**up, 1: _probe(nodes[1], rxdm_rc="0", rxdm="")}
    with pytest.raises(UserError) as e:
        prestart_verdict(c, down, config)
    msg = str(e.value)
    assert "node 1 (10.0.0.3): receive-datapath-manager (RxDM) is not running" in msg and "node 0" not in msg
    assert "nothing was started" in msg and "\n" not in msg
    no_docker = {**up, 0: _probe(nodes[0], rxdm_rc="127", rxdm="")}
    with pytest.raises(UserError, match=r"node 0 \(10.0.0.2\): docker is not installed"):
        prestart_verdict(c, no_docker, config)


def test_gpufleets_code_snapshot_on_pythonpath_is_mounted_read_only_and_the_images_own_paths_are_not():
    """A stock PyTorch image has torch but not gpufleet's workloads: the snapshot launcher.code
    sent (~/.gpufleet/snap/HASH, on PYTHONPATH) goes in at the same path; /app is the image's."""
    snap = "/home/ana/.gpufleet/snap/0123abcd"
    env = {"PYTHONPATH": f"{snap}:/app"}
    argv = container_argv(wiring(lookup("a3-highgpu-8g"), "cos"), IMAGE, "n", "t", env, ["python3", "-m", "x"])
    opts = argv[: argv.index(IMAGE)]
    mounts = [opts[i + 1] for i, o in enumerate(opts) if o == "--mount"]
    assert f"type=bind,src={snap},dst={snap},readonly" in mounts
    assert not any("/app" in m for m in mounts)
    assert ["-e", "PYTHONPATH"] == opts[opts.index("PYTHONPATH") - 1 : opts.index("PYTHONPATH") + 1]
    plain = container_argv(wiring(None), IMAGE, "n", "t", {"PYTHONPATH": "/app"}, ["true"])
    assert not any(".gpufleet/snap" in a for a in plain)


def _cos_outputs(tmp_path: Path, image: str | None) -> Path:
    """A3 High outputs as infra exports them on its default boot image, with or without an image."""
    from gpufleet.contracts import boot_image_output

    f = _outputs(tmp_path, "a3-highgpu-8g", image=image)
    doc = json.loads(f.read_text())
    doc["bootImage"] = boot_image_output("projects/cos-cloud/global/images/family/cos-105-lts")
    f.write_text(json.dumps(doc))
    return f


def test_a_cos_stack_without_an_image_refuses_the_launch_naming_image(tmp_path):
    out = _cos_outputs(tmp_path, None)
    runs = tmp_path / "runs"
    r = CliRunner().invoke(main, ["run", "--outputs", str(out), "--runs-dir", str(runs), "--", "t.py"])
    assert r.exit_code == 2, r.output
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert line.startswith("error: the nodes of demo boot Container-Optimized OS") and "--image" in line
    assert not runs.exists()  # nothing started, nothing recorded
    # With the stack's default image (infra sets one on COS) or --image, it goes on; exec needs none.
    r, _ = _dry(tmp_path, "--outputs", str(_cos_outputs(tmp_path, IMAGE)))
    assert all(p.container is not None and p.argv[0] == "gpufleet-container" for p in dry_runs.plans(r.stdout))
    _dry(tmp_path, "--outputs", str(out), "--image", IMAGE)
    r = CliRunner().invoke(main, ["exec", "--outputs", str(out), "--dry-run", "--", "nvidia-smi"])
    assert r.exit_code == 0, r.output


def test_the_boot_image_output_names_the_nics_without_image_os(tmp_path):
    """A3 High on Ubuntu (the stack's gpufleet:image): its bootImage output, not the catalog's
    default (COS), picks the interface names."""
    from gpufleet.contracts import boot_image_output

    f = _outputs(tmp_path, "a3-highgpu-8g", image=IMAGE)
    doc = json.loads(f.read_text())
    doc["bootImage"] = boot_image_output(
        "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accelerator-2404-amd64-with-nvidia-580"
    )
    f.write_text(json.dumps(doc))
    r = CliRunner().invoke(main, ["run", "--outputs", str(f), "--dry-run", "--", "t.py"])
    assert r.exit_code == 0, r.output
    assert "enp0s12" in r.stdout and "NCCL_SOCKET_IFNAME=eth0" not in r.stdout
