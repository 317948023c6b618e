"""Startup scripts: rendered for every family and image OS, they pass bash -n and shellcheck, and a
rendered script run twice on a (stubbed) node converges: same ready marker, no work the second time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.catalog import MACHINE_TYPES, NetStack, lookup
from gpufleet.contracts import (
    CONTROLLER_READY_MARKER,
    CONTROLLER_VENV,
    HOLDS_DIR,
    READY_MARKER,
    RXDM_CONTAINER,
    RXDM_SOCKET_DIR,
)
from infra import pins
from infra.pins import NCCL_TESTS, UV
from infra.startup import (
    COMPUTE_REQUIREMENT,
    LAUNCH_LINK,
    STACK_TEMPLATES,
    render_controller_script,
    render_startup_script,
)

# Its module fixture runs once: every test of the module on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("startup")

SCRIPTS = [(t, os_) for t in sorted(MACHINE_TYPES) for os_ in ("ubuntu", "cos")]


def test_every_network_stack_has_a_template():
    assert set(STACK_TEMPLATES) == set(NetStack)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("scripts")
    paths = {}
    for name, os_ in SCRIPTS:
        p = out / f"{name}-{os_}.sh"
        p.write_text(render_startup_script(lookup(name), cluster="demo", image_os=os_))
        paths[(name, os_)] = p
    return paths


def test_every_rendered_script_passes_bash_n(rendered):
    for (name, os_), path in rendered.items():
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, f"{name}/{os_}: {r.stderr}"


def test_every_rendered_script_passes_shellcheck(rendered):
    assert shutil.which("shellcheck"), "shellcheck is not installed (.ci/run installs it)"
    # One shellcheck call for all of them: it reports each file by name.
    r = subprocess.run(["shellcheck", "-s", "bash", *map(str, rendered.values())], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


@pytest.mark.parametrize("name, os_", SCRIPTS)
def test_rendered_script_carries_the_machines_facts(name, os_):
    t = lookup(name)
    s = render_startup_script(t, cluster="demo", image_os=os_)
    assert "@@" not in s
    assert f"readonly GPU_COUNT={t.gpu_count}" in s
    assert f"readonly LOCAL_SSD_COUNT={t.local_ssd_count}" in s
    assert f"readonly READY_MARKER={READY_MARKER}" in s
    gpu_names = [n for nic, n in zip(t.nics, t.interface_names(os_)) if nic.role == "gpu"]
    assert f"readonly GPU_NICS=({' '.join(gpu_names)})" in s
    stack_marker = {
        NetStack.TCPX: "tcpgpudmarxd-dev:v2.0.12",
        NetStack.TCPXO: "--num_hops=2",
        NetStack.RDMA: "nccl-gib",
        NetStack.FAST_SOCKET: "google-fast-socket",
        NetStack.NONE: "PLUGIN_VERSION=none",
    }[t.net_stack]
    assert stack_marker in s


def test_unknown_image_os_is_refused():
    with pytest.raises(ValueError, match="image OS 'windows' is unknown; one of: ubuntu, cos"):
        render_startup_script(lookup("a2-highgpu-8g"), cluster="demo", image_os="windows")


# ---- run it: a one-GPU Ubuntu node, every tool it calls stubbed, / kept intact ------------
# The script runs in a private mount namespace with tmpfs over /var/lib and limits.d, so it
# writes nothing on this machine. Stubs log each call so a second run can prove it did no work.
STUB = textwrap.dedent(
    r"""
    #!/bin/bash
    tool=$(basename "$0")
    echo "$tool $*" >>"$STUB_LOG"
    case "$tool" in
      nvidia-smi)
        case "$*" in
          -L) for ((i = 0; i < ${STUB_GPUS:-1}; i++)); do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done ;;
          *query-gpu*) echo "580.65.06" ;;
          "-pm 1") ;;
          *) echo "| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: 13.0 |" ;;
        esac ;;
      dpkg-query)
        case "$*" in
          *Status*) echo "install ok installed" ;;
          *Version*libnccl2*) echo "2.27.5-1+cuda12.9" ;;
          *) ;;
        esac ;;
      git)
        case "$*" in
          init*) mkdir -p "${@: -1}" ;;
          *rev-parse*) echo "${STUB_GIT_HEAD:?}" ;;
        esac ;;
      python3)  # python3 -m venv DIR: a venv whose python is this stub
        dir=${@: -1}; mkdir -p "$dir/bin"; cp "$0" "$dir/bin/python" ;;
      python)  # python -m pip install ... -r FILE: the uv that FILE pins
        venv=$(dirname "$(dirname "$0")")
        version=$(sed -n 's/^uv==\([^ ]*\) .*/\1/p' "${@: -1}")
        printf '#!/bin/sh\necho "uv %s"\n' "$version" >"$venv/bin/uv"; chmod +x "$venv/bin/uv" ;;
      make)
        for a in "$@"; do
          if [[ "$a" == BUILDDIR=* ]]; then
            d=${a#BUILDDIR=}; mkdir -p "$d"; printf '#!/bin/sh\n' >"$d/all_reduce_perf"; chmod +x "$d/all_reduce_perf"
          fi
        done ;;
    esac
    exit 0
    """
).lstrip()
STUBBED = (
    "nvidia-smi",
    "dpkg-query",
    "apt-get",
    "git",
    "make",
    "curl",
    "dpkg",
    "modprobe",
    "ubuntu-drivers",
    "python3",
)


@pytest.fixture
def node(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in STUBBED:
        (bindir / tool).write_text(STUB)
        (bindir / tool).chmod(0o755)
    script = tmp_path / "startup.sh"
    script.write_text(render_startup_script(lookup("a3-highgpu-1g"), cluster="demo", image_os="ubuntu"))
    log = tmp_path / "calls.log"
    state = tmp_path / "state"

    def boot(
        gpus: int = 1, head: str = NCCL_TESTS.commit
    ) -> tuple[subprocess.CompletedProcess, dict | None, str | None, list[str]]:
        """One boot: run the script; return (process, ready marker, error file, stub calls).
        `head`: the commit a fetch of nccl-tests gives."""
        log.write_text("")
        # /var/lib is a tmpfs that survives across boots by being copied in and out of `state`;
        # /usr/local/bin (the uv link) is a fresh tmpfs, its link kept in `state`/link.
        inner = f"""
            set -e
            mount -t tmpfs none /var/lib
            mount -t tmpfs none /etc/security/limits.d
            mount -t tmpfs none /usr/local/bin
            mount -t tmpfs none /run  # the holds registry (make_holds_dir): the boot's own, not this machine's
            mkdir -p {state}/lib && cp -a {state}/lib/. /var/lib/
            rc=0; PATH={bindir}:$PATH STUB_LOG={log} STUB_GPUS={gpus} STUB_GIT_HEAD={head} bash {script} || rc=$?
            readlink /usr/local/bin/uv >{state}/link || true
            rm -rf {state}/lib && mkdir -p {state}/lib && cp -a /var/lib/. {state}/lib/
            exit $rc
        """
        proc = subprocess.run(["unshare", "-m", "bash", "-c", inner], capture_output=True, text=True, timeout=60)
        lib = state / "lib"
        marker = lib / READY_MARKER.removeprefix("/var/lib/")
        err = lib / "gpufleet" / "startup-error.txt"
        return (
            proc,
            json.loads(marker.read_text()) if marker.exists() else None,
            err.read_text() if err.exists() else None,
            log.read_text().splitlines(),
        )

    boot.state = state
    return boot


def state_dir(boot) -> Path:
    return boot.state


def test_startup_script_writes_the_ready_marker_with_versions_and_is_idempotent(node):
    proc, marker, error, calls = node()
    assert proc.returncode == 0, proc.stderr
    assert error is None
    assert {
        k: marker[k] for k in ("cluster", "machine_type", "net_stack", "driver", "cuda", "nccl", "plugin", "nccl_tests")
    } == {
        "cluster": "demo",
        "machine_type": "a3-highgpu-1g",
        "net_stack": "none",
        "driver": "580.65.06",
        "cuda": "13.0",
        "nccl": "2.27.5-1+cuda12.9",
        "plugin": "none",
        "nccl_tests": NCCL_TESTS.commit[:7],
    }
    # nccl-tests: the pinned commit, fetched by its hash (no clone of whatever HEAD is).
    assert any(
        c.startswith("git -C") and f"fetch -q --depth 1 {NCCL_TESTS.url} {NCCL_TESTS.commit}" in c for c in calls
    )
    assert any(c.startswith("make") for c in calls) and not any(c.startswith("git clone") for c in calls)
    # uv: the pinned wheel, by its hash, linked on the PATH.
    assert any("pip install" in c and "--require-hashes" in c for c in calls), calls
    assert (state_dir(node) / "lib/gpufleet/uv/requirements.txt").read_text() == (
        f"uv=={UV['version']} --hash=sha256:{UV['sha256']}\n"
    )
    assert (state_dir(node) / "link").read_text().strip() == "/var/lib/gpufleet/uv/bin/uv"

    proc, again, error, calls = node()
    assert proc.returncode == 0, proc.stderr
    assert {k: v for k, v in again.items() if k != "booted_at"} == {k: v for k, v in marker.items() if k != "booted_at"}
    # Nothing rebuilt, nothing installed on the second boot.
    work = [
        c
        for c in calls
        if c.split()[0] in ("git", "make", "apt-get", "curl", "dpkg", "python3", "python") and "rev-parse" not in c
    ]
    assert work == [], work
    assert "nvidia-smi -pm 1" in calls


def test_a_fetch_that_is_not_the_pinned_commit_is_not_built(node):
    proc, marker, error, calls = node(head="0" * 40)
    assert proc.returncode != 0 and marker is None
    assert f"nccl-tests: fetched {'0' * 40}, not the pinned {NCCL_TESTS.commit}" in proc.stderr
    assert not any(c.startswith("make") for c in calls)


def test_a_failed_boot_leaves_no_ready_marker_and_says_where_it_failed(node):
    assert node()[0].returncode == 0  # a good boot first: its marker must not survive a bad one
    proc, marker, error, _ = node(gpus=0)
    assert proc.returncode != 0
    assert marker is None
    assert "expected 1 GPUs on a3-highgpu-1g, nvidia-smi lists 0" in proc.stderr
    assert error is not None and error.startswith("line ")


# ---- the controller VM's script ----------------------------------------------------------------

CONTROLLER_SOURCE = "git+https://github.com/me/gpufleet.git@v0.1.0"


@pytest.mark.parametrize("source", [CONTROLLER_SOURCE, None])
def test_the_controller_script_passes_bash_n_and_shellcheck(tmp_path, source):
    assert shutil.which("shellcheck"), "shellcheck is not installed (.ci/run installs it)"
    path = tmp_path / "controller.sh"
    path.write_text(render_controller_script(cluster="demo", source=source))
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]


def test_the_controller_script_carries_its_facts_and_quotes_them():
    s = render_controller_script(cluster="demo", source=CONTROLLER_SOURCE)
    assert "@@" not in s
    assert f"readonly SOURCE={CONTROLLER_SOURCE}" in s
    assert f"readonly VENV={CONTROLLER_VENV}" in s and f"readonly READY_MARKER={CONTROLLER_READY_MARKER}" in s
    # The helpers are the nodes' own (one common.sh), not a copy.
    node = render_startup_script(lookup("a2-highgpu-8g"), cluster="demo", image_os="ubuntu")
    for helper in ("apt_install() {", "on_error() {", "json_str() {"):
        assert s.count(helper) == 1 and node.count(helper) == 1
    # Whatever the source holds, it stays one word: the render quotes it.
    hostile = "https://example.com/x.whl; touch /tmp/owned"
    assert f"readonly SOURCE='{hostile}'" in render_controller_script(cluster="demo", source=hostile)
    # Without a source: the Compute Engine client alone, and nothing of gpufleet to import.
    bare = render_controller_script(cluster="demo", source=None)
    assert "readonly SOURCE=''" in bare and f"readonly REQUIREMENT='{COMPUTE_REQUIREMENT}'" in bare
    assert "readonly IMPORTS=google.cloud.compute_v1" in bare


def test_the_compute_requirement_is_the_one_gpufleet_itself_depends_on():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert COMPUTE_REQUIREMENT in pyproject["project"]["dependencies"]


# Run it: python3, its venv and pip stubbed, in a private mount namespace (tmpfs over /var/lib, /opt
# and /usr/local/bin, carried between boots), as the node script runs above.
CONTROLLER_STUB = textwrap.dedent(
    r"""
    #!/bin/bash
    tool=$(basename "$0")
    echo "$tool $*" >>"$STUB_LOG"
    case "$tool" in
      dpkg-query) echo "install ok installed" ;;
      python3)  # python3 -m venv DIR: a venv whose python is this stub
        dir=${@: -1}; mkdir -p "$dir/bin"; cp "$0" "$dir/bin/python" ;;
      python)
        venv=$(dirname "$(dirname "$0")")
        case "$*" in
          "-m pip install"*)
            [[ -z "${STUB_PIP_FAIL:-}" ]] || exit 1
            touch "$venv/installed"
            if [[ "${@: -1}" == gpufleet* ]]; then
              printf '#!/bin/sh\n' >"$venv/bin/launch"; chmod +x "$venv/bin/launch"
            fi ;;
          "-m pip uninstall"*) rm -f "$venv/bin/launch" ;;
          *importlib.metadata*)
            [[ "${@: -1}" == gpufleet ]] && echo 0.1.0 || echo 1.40.0 ;;
          *) [[ -e "$venv/installed" ]] ;;  # -c 'import launcher.cli, google.cloud.compute_v1'
        esac ;;
    esac
    """
).lstrip()


@pytest.fixture
def controller(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("python3", "dpkg-query", "apt-get"):
        (bindir / tool).write_text(CONTROLLER_STUB)
        (bindir / tool).chmod(0o755)
    log = tmp_path / "calls.log"
    state = tmp_path / "state"
    dirs = ("/var/lib", "/opt", "/usr/local/bin", "/root")

    def boot(source: str | None = CONTROLLER_SOURCE, pip_fails: bool = False):
        """One boot; returns (process, ready marker, error file, the `launch` link's target, calls)."""
        script = tmp_path / "controller.sh"
        script.write_text(render_controller_script(cluster="demo", source=source))
        log.write_text("")
        restore = "\n".join(f"mount -t tmpfs none {d}; mkdir -p {state}{d}; cp -a {state}{d}/. {d}/" for d in dirs)
        save = "\n".join(f"rm -rf {state}{d}; mkdir -p {state}{d}; cp -a {d}/. {state}{d}/" for d in dirs)
        inner = f"""
            set -e
            {restore}
            rc=0; PATH={bindir}:$PATH STUB_LOG={log} STUB_PIP_FAIL={"1" if pip_fails else ""} bash {script} || rc=$?
            readlink {LAUNCH_LINK} >{tmp_path}/link || true
            {save}
            exit $rc
        """
        proc = subprocess.run(["unshare", "-m", "bash", "-c", inner], capture_output=True, text=True, timeout=60)
        lib = state / "var/lib"
        marker = lib / CONTROLLER_READY_MARKER.removeprefix("/var/lib/")
        err = lib / "gpufleet" / "startup-error.txt"
        return (
            proc,
            json.loads(marker.read_text()) if marker.exists() else None,
            err.read_text() if err.exists() else None,
            (tmp_path / "link").read_text().strip(),
            log.read_text().splitlines(),
        )

    return boot


def _installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("python3 -m venv") or " -m pip " in c]


def test_the_controller_script_installs_the_launcher_once_per_source(controller):
    proc, marker, error, link, calls = controller()
    assert proc.returncode == 0, proc.stderr
    assert error is None and link == f"{CONTROLLER_VENV}/bin/launch"
    assert {k: v for k, v in marker.items() if k not in ("controller", "booted_at")} == {
        "cluster": "demo",
        "source": CONTROLLER_SOURCE,
        "gpufleet": "0.1.0",
        "google_cloud_compute": "1.40.0",
    }
    assert _installs(calls) == [
        f"python3 -m venv {CONTROLLER_VENV}",
        f"python -m pip install --quiet --disable-pip-version-check gpufleet @ {CONTROLLER_SOURCE}",
    ]

    # A reboot with the same source: no venv, no pip; the same marker.
    proc, again, error, link, calls = controller()
    assert proc.returncode == 0, proc.stderr
    assert _installs(calls) == [] and link == f"{CONTROLLER_VENV}/bin/launch"
    assert {k: v for k, v in again.items() if k != "booted_at"} == {k: v for k, v in marker.items() if k != "booted_at"}

    # A new source (a `pulumi up` that changed gpufleet:controllerSource): installed into the same venv.
    newer = "git+https://github.com/me/gpufleet.git@v0.2.0"
    proc, marker, _, _, calls = controller(source=newer)
    assert proc.returncode == 0, proc.stderr
    assert (
        _installs(calls) == [f"python -m pip install --quiet --disable-pip-version-check gpufleet @ {newer}"]
        and marker["source"] == newer
    )


def test_without_a_source_the_controller_gets_the_compute_client_alone(controller):
    proc, marker, error, link, calls = controller(source=None)
    assert proc.returncode == 0, proc.stderr
    assert error is None and link == ""  # no `launch` on the PATH: the client ships the launcher
    assert {k: v for k, v in marker.items() if k not in ("controller", "booted_at")} == {
        "cluster": "demo",
        "source": None,
        "gpufleet": None,
        "google_cloud_compute": "1.40.0",
    }
    assert _installs(calls) == [
        f"python3 -m venv {CONTROLLER_VENV}",
        f"python -m pip install --quiet --disable-pip-version-check {COMPUTE_REQUIREMENT}",
    ]
    assert not any(c.startswith("apt-get install") and " git" in c for c in calls)
    # Once installed, a reboot installs nothing.
    proc, _, _, _, calls = controller(source=None)
    assert proc.returncode == 0 and _installs(calls) == []


def test_dropping_the_source_uninstalls_the_launcher_and_its_link(controller):
    assert controller()[3] == f"{CONTROLLER_VENV}/bin/launch"
    proc, marker, _, link, calls = controller(source=None)
    assert proc.returncode == 0, proc.stderr
    # A launcher left in the venv would shadow the one the client ships.
    assert _installs(calls) == [
        "python -m pip uninstall --quiet --disable-pip-version-check --yes gpufleet",
        f"python -m pip install --quiet --disable-pip-version-check {COMPUTE_REQUIREMENT}",
    ]
    assert link == "" and marker["source"] is None


def test_a_failed_install_leaves_no_ready_marker_and_says_where(controller):
    assert controller()[0].returncode == 0  # a good boot first: its marker must not survive a bad one
    proc, marker, error, _, _ = controller(source="git+https://github.com/me/gpufleet.git@broken", pip_fails=True)
    assert proc.returncode != 0
    assert marker is None
    assert error is not None and error.startswith("line ") and "pip install" in error


def test_the_controller_boot_starts_again_the_controllers_of_live_jobs_only(controller, tmp_path):
    """A reboot killed the detached jobs' controllers: the boot starts each live job's again (its
    directory's controller.sh, as its owner with its HOME); an ended job's is left alone."""
    jobs = tmp_path / "state" / "root" / ".gpufleet" / "jobs"
    for job, state in (("20260101-000000-aaaaaa", "RUNNING"), ("20260101-000001-bbbbbb", "SUCCEEDED")):
        (jobs / job).mkdir(parents=True)
        (jobs / job / "state.json").write_text(json.dumps({"id": job, "state": state}, indent=1))
        (jobs / job / "controller.sh").write_text(f'echo "$HOME" > "$HOME/started-{job}"\n')
    proc, marker, error, _, _ = controller()
    assert proc.returncode == 0 and marker is not None and error is None, proc.stderr
    home = tmp_path / "state" / "root"
    assert (home / "started-20260101-000000-aaaaaa").read_text() == "/root\n"
    assert not (home / "started-20260101-000001-bbbbbb").exists()
    assert "started the controller of job 20260101-000000-aaaaaa (root) again" in proc.stderr + proc.stdout


# ---- what the scripts run as root is pinned (infra/pins.py) --------------------------------------

TEMPLATES = Path(__file__).parents[2] / "infra" / "templates"


def test_the_templates_hold_no_pin_of_their_own_and_trust_nothing_unsigned():
    for path in sorted(TEMPLATES.glob("*.sh")):
        # The code, not the comments that say what it no longer does.
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        for banned in (
            "trusted=yes",
            "--pull=always",
            "git clone",
            "@sha256",
            "pkg.dev/gce-ai-infra/gpudirect-tcpx",
        ):
            assert banned not in text, f"{path.name}: {banned}"
        # No version tag of an image, no commit, no fingerprint written into a template.
        assert not re.search(r":v[0-9]+\.[0-9]+\.[0-9]+", text), path.name
        assert not re.search(r"\b[0-9a-f]{40}\b|\b[0-9A-F]{40}\b", text), path.name
        # The firewall opens on named interfaces only.
        assert not re.search(r"iptables -I INPUT -p", text), path.name


@pytest.mark.parametrize("name", ["a3-highgpu-8g", "a3-megagpu-8g", "a3-ultragpu-8g", "a2-highgpu-8g"])
def test_every_pin_the_script_uses_comes_from_pins(name):
    s = render_startup_script(lookup(name), cluster="demo", image_os="ubuntu")
    assert f"readonly NCCL_TESTS_PIN={NCCL_TESTS.commit}" in s
    assert f"[2404]={pins.CUDA_KEYRING_SHA256['2404']}" in s
    assert pins.NVIDIA_CONTAINER_TOOLKIT_KEY.fingerprints[0] in s
    stack = lookup(name).net_stack
    if stack is NetStack.TCPXO:
        assert f"readonly TCPXO_RXDM_IMAGE={pins.TCPXO_RXDM.ref}" in s and "@sha256:" in pins.TCPXO_RXDM.ref
        assert f"readonly TCPXO_PLUGIN_IMAGE={pins.TCPXO_PLUGIN.ref}" in s
    if stack in (NetStack.TCPXO, NetStack.RDMA):
        assert pins.ARTIFACT_REGISTRY_APT_KEY.fingerprints[0] in s
        assert 'signed-by=$AR_KEYRING] ar+https://us-apt.pkg.dev/projects/gce-ai-infra' in s
    if stack is NetStack.FAST_SOCKET:
        assert all(f in s for f in pins.GOOGLE_CLOUD_APT_KEY.fingerprints)


def test_pins_are_whole():
    assert re.fullmatch(r"[0-9a-f]{40}", NCCL_TESTS.commit)
    assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in pins.CUDA_KEYRING_SHA256.values())
    assert re.fullmatch(r"[0-9a-f]{64}", UV["sha256"])
    for key in (pins.NVIDIA_CONTAINER_TOOLKIT_KEY, pins.GOOGLE_CLOUD_APT_KEY, pins.ARTIFACT_REGISTRY_APT_KEY):
        assert key.url.startswith("https://") and all(re.fullmatch(r"[0-9A-F]{40}", f) for f in key.fingerprints)
    for image in (pins.TCPXO_PLUGIN, pins.TCPXO_RXDM, pins.CUDA_DEVEL_IMAGE):
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", image.digest or "")
        assert image.ref == f"{image.name}@{image.digest}"
    # No public digest for the TCPX pair: by tag, said in pins.py.
    assert pins.TCPX_RXDM.digest is None and pins.TCPX_RXDM.ref.endswith(":v2.0.12")


def _functions(script: str) -> str:
    """A rendered script without its last line (`main "$@"`): sourcing it defines the functions."""
    body, last = script.rstrip("\n").rsplit("\n", 1)
    assert last == 'main "$@"'
    return body


def _run(script: str, call: str, tmp_path: Path, stubs: dict[str, str], env: dict[str, str] | None = None):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool, body in stubs.items():
        (bindir / tool).write_text("#!/bin/bash\n" + body)
        (bindir / tool).chmod(0o755)
    lib = tmp_path / "script.sh"
    lib.write_text(_functions(script))
    return subprocess.run(
        ["bash", "-c", f"source {lib}; {call}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), **(env or {})},
    )


@pytest.mark.parametrize("name", ["a3-highgpu-8g", "a3-megagpu-8g"])
def test_the_firewall_opens_on_the_gpu_nics_alone(tmp_path, name):
    t = lookup(name)
    log = tmp_path / "iptables.log"
    stub = f'echo "$*" >>{log}\n[[ "$1" != -C ]]\n'  # no rule yet: -C fails, -I adds
    r = _run(
        render_startup_script(t, cluster="demo", image_os="ubuntu"),
        "accept_tcp_on_gpu_nics",
        tmp_path,
        {"iptables": stub},
    )
    assert r.returncode == 0, r.stderr
    gpu = [n for nic, n in zip(t.nics, t.interface_names("ubuntu")) if nic.role == "gpu"]
    added = [line for line in log.read_text().splitlines() if line.startswith("-I")]
    assert added == [f"-I INPUT -i {nic} -p tcp -m tcp -j ACCEPT" for nic in gpu] and len(gpu) in (4, 8)


@pytest.mark.parametrize("name", ["a3-highgpu-8g", "a3-megagpu-8g"])
def test_rxdm_starts_by_its_pin_under_its_known_name(tmp_path, name):
    s = render_startup_script(lookup(name), cluster="demo", image_os="ubuntu")
    assert f"readonly RXDM_CONTAINER={RXDM_CONTAINER}" in s
    assert 'docker run --detach --name "$RXDM_CONTAINER"' in s
    if lookup(name).net_stack is NetStack.TCPX:
        assert f"readonly RXDM_SOCKET_DIR={RXDM_SOCKET_DIR}" in s and '--uds_path "$RXDM_SOCKET_DIR"' in s


def _gpg(home: Path, *args: str) -> str:
    return subprocess.run(
        ["gpg", "--batch", "--homedir", str(home), *args], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory) -> Iterator[tuple[Path, str, str]]:
    """A key file holding two real OpenPGP keys, and their fingerprints (the vendor's and a stranger's)."""
    assert shutil.which("gpg"), "gpg is not installed"
    home = tmp_path_factory.mktemp("gnupg")
    home.chmod(0o700)
    fprs = []
    for who in ("vendor", "stranger"):
        _gpg(home, "--passphrase", "", "--quick-gen-key", f"{who} <{who}@example.com>", "ed25519", "sign", "never")
        out = _gpg(home, "--with-colons", "--list-keys", f"{who}@example.com")
        fprs.append(next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr")))
    path = home / "both.asc"
    path.write_text(_gpg(home, "--armor", "--export"))
    yield path, fprs[0], fprs[1]
    # gpg started an agent for this home to make the keys; it would outlive the suite.
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], capture_output=True, timeout=30)


CURL_STUB = 'out=""; while (($#)); do [[ "$1" == -o ]] && out=$2; shift; done; cp "$KEY_FILE" "$out"\n'


def test_a_keyring_holds_the_pinned_key_alone(tmp_path, two_keys):
    keyfile, vendor, stranger = two_keys
    keyring = tmp_path / "keyring.gpg"
    script = render_startup_script(lookup("a2-highgpu-8g"), cluster="demo", image_os="ubuntu")
    call = f"pinned_keyring {keyring} https://vendor.example/key {vendor}"
    r = _run(script, call, tmp_path, {"curl": CURL_STUB}, {"KEY_FILE": str(keyfile)})
    assert r.returncode == 0, r.stderr
    listed = subprocess.run(
        ["gpg", "--batch", "--show-keys", "--with-colons", str(keyring)], capture_output=True, text=True
    ).stdout
    assert vendor in listed and stranger not in listed
    # Kept as is on the next boot: no download.
    r = _run(script, call, tmp_path, {"curl": "exit 99\n"}, {"KEY_FILE": str(keyfile)})
    assert r.returncode == 0, r.stderr


def test_a_download_without_the_pinned_key_is_not_trusted(tmp_path, two_keys):
    keyfile, vendor, stranger = two_keys
    keyring = tmp_path / "keyring.gpg"
    script = render_startup_script(lookup("a2-highgpu-8g"), cluster="demo", image_os="ubuntu")
    pinned = "0" * 40
    r = _run(
        script,
        f"pinned_keyring {keyring} https://vendor.example/key {pinned}",
        tmp_path,
        {"curl": CURL_STUB},
        {"KEY_FILE": str(keyfile)},
    )
    assert r.returncode != 0 and not keyring.exists()
    assert f"https://vendor.example/key holds none of the pinned keys ({pinned})" in r.stderr


def test_a_cuda_keyring_that_is_not_the_pinned_one_is_not_installed(tmp_path):
    (tmp_path / "os-release").write_text('VERSION_ID="24.04"\n')
    script = render_startup_script(lookup("a2-highgpu-8g"), cluster="demo", image_os="ubuntu")
    script = script.replace("/etc/os-release", str(tmp_path / "os-release"))
    dpkg_log = tmp_path / "dpkg.log"
    stubs = {
        "curl": 'out=""; while (($#)); do [[ "$1" == -o ]] && out=$2; shift; done; echo tampered >"$out"\n',
        "dpkg": f'echo "$*" >>{dpkg_log}\n',
        "dpkg-query": "exit 1\n",
    }
    r = _run(script, "ensure_cuda_toolkit", tmp_path, stubs)
    assert r.returncode != 0
    assert (
        f"cuda-keyring for Ubuntu 2404 does not match its pinned SHA-256 {pins.CUDA_KEYRING_SHA256['2404']}" in r.stderr
    )
    assert not dpkg_log.exists()
    # An Ubuntu release without a pinned checksum is refused by name.
    (tmp_path / "os-release").write_text('VERSION_ID="25.10"\n')
    r = _run(script, "ensure_cuda_toolkit", tmp_path, stubs)
    assert r.returncode != 0 and "no pinned cuda-keyring checksum for Ubuntu 2510" in r.stderr


@pytest.mark.parametrize("image_os", ["ubuntu", "cos"])
def test_docker_gets_the_vms_credentials_for_the_registries_as_google_documents(tmp_path, image_os):
    log = tmp_path / "calls.log"
    stub = f'echo "$(basename "$0") $*" >>{log}\n'
    script = render_startup_script(
        lookup("a3-megagpu-8g"), cluster="demo", image_os=image_os, docker_registries=("us-central1-docker.pkg.dev",)
    )
    r = _run(script, "configure_registry_auth", tmp_path, {"gcloud": stub, "docker-credential-gcr": stub})
    assert r.returncode == 0, r.stderr
    hosts = "us-docker.pkg.dev,us-central1-docker.pkg.dev"  # Google's GPUDirect images, then the stack's
    expected = (
        f"gcloud auth configure-docker --quiet {hosts}"
        if image_os == "ubuntu"
        else f"docker-credential-gcr configure-docker --registries={hosts}"
    )
    assert log.read_text().splitlines() == [expected]
    # Before the network stack pulls anything.
    main = script.split("\nmain() {", 1)[1]
    assert main.index("configure_registry_auth") < main.index("net_stack_setup")


def test_no_shared_uv_cache_is_made_and_an_older_scripts_config_goes(tmp_path):
    """One cache for every account lets one plant what uv installs into another's environment:
    the node agent keeps each account's own (launcher.code.node_agent.local_cache)."""
    ssd, config = tmp_path / "localssd", tmp_path / "etc-uv" / "uv.toml"
    ssd.mkdir()
    config.parent.mkdir()
    config.write_text(f'cache-dir = "{ssd}/uv-cache"\n')  # what the startup script wrote before
    script = render_startup_script(lookup("a3-megagpu-8g"), cluster="demo", image_os="ubuntu")
    script = script.replace("readonly LOCAL_SSD_MOUNT=/mnt/localssd", f"readonly LOCAL_SSD_MOUNT={ssd}")
    script = script.replace("readonly UV_CONFIG=/etc/uv/uv.toml", f"readonly UV_CONFIG={config}")
    script = script.replace("readonly UV_HOME=/var/lib/gpufleet/uv", f"readonly UV_HOME={tmp_path / 'uv'}")
    script = script.replace("readonly UV_LINK=/usr/local/bin/uv", f"readonly UV_LINK={tmp_path / 'bin-uv'}")
    (tmp_path / "uv" / "bin").mkdir(parents=True)
    (tmp_path / "uv" / "bin" / "uv").write_text(f"#!/bin/sh\necho 'uv {UV['version']}'\n")
    (tmp_path / "uv" / "bin" / "uv").chmod(0o755)
    stubs = {"dpkg-query": 'echo "install ok installed"\n', "mountpoint": f'[[ "$2" == {ssd} ]]\n'}
    r = _run(script, "prepare_python_build", tmp_path, stubs)
    assert r.returncode == 0, r.stderr
    assert not config.exists() and not (ssd / "uv-cache").exists()
    assert os.readlink(tmp_path / "bin-uv") == str(tmp_path / "uv" / "bin" / "uv")


def test_the_holds_registry_is_roots_and_sticky_and_made_before_anything_else(tmp_path):
    script = render_startup_script(lookup("a3-megagpu-8g"), cluster="demo", image_os="ubuntu")
    assert f"readonly HOLDS_DIR={HOLDS_DIR}\n" in script  # the launcher's (gpufleet.contracts)
    holds = tmp_path / "run" / "gpufleet-holds"
    script = script.replace(f"readonly HOLDS_DIR={HOLDS_DIR}", f"readonly HOLDS_DIR={holds}")
    r = _run(script, "make_holds_dir", tmp_path, {})
    assert r.returncode == 0, r.stderr
    st = holds.stat()
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o1777)
    main = script.split("\nmain() {", 1)[1]
    assert main.split()[:2] == ["prepare", "make_holds_dir"]
