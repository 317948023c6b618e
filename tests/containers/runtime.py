"""Containers for the tests, from Debian's packages (`make sysdeps`: podman, runc, docker-registry)
and this machine's own files: podman with the project's own configuration (never this machine's
/etc), a Python image built from the venv's interpreter and torch (build_image.sh), a tiny image
of dash, and a local distribution registry standing in for Artifact Registry.

podman here needs runc (crun refuses cgroups in hybrid mode on these kernels) and no default
ulimits (its nofile default is above the hard limit): containers.conf says both, found through
CONTAINERS_CONF; the registry is plain HTTP on loopback, which registries.conf marks insecure
(CONTAINERS_REGISTRIES_CONF)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["podman_env", "python_image", "python_image_name", "tiny_image", "Registry", "containers_named", "HERE"]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def podman_env(root: Path, registry: str | None = None) -> dict[str, str]:
    """The variables that point podman at the project's configuration (written under `root`)."""
    root.mkdir(parents=True, exist_ok=True)
    conf = root / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n')
    env = {"CONTAINERS_CONF": str(conf)}
    if registry:
        reg = root / "registries.conf"
        reg.write_text(f'[[registry]]\nlocation = "{registry}"\ninsecure = true\n')
        env["CONTAINERS_REGISTRIES_CONF"] = str(reg)
    return env


def _podman(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env={**os.environ, **env}, capture_output=True, text=True, check=check)


# What build_image.sh copies from the venv: a change to any of them (or to the script, or to the
# interpreter) is a new image.
_IMAGE_PACKAGES = ("torch", "numpy", "sympy", "mpmath", "networkx", "filelock", "fsspec", "jinja2", "markupsafe")


def python_image_name() -> str:
    """localhost/gpufleet-test-python:<torch version>-<key>, the key a hash of the image's inputs:
    build_image.sh, the venv's interpreter and the versions of the packages it copies."""
    from importlib.metadata import PackageNotFoundError, version

    inputs = [(HERE / "build_image.sh").read_text(), sys.version, os.path.realpath(sys.executable)]
    for name in _IMAGE_PACKAGES:
        try:
            inputs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            inputs.append(f"{name} absent")
    key = hashlib.sha256("\n".join(inputs).encode()).hexdigest()[:12]
    return f"localhost/gpufleet-test-python:{torch.__version__.replace('+', '-')}-{key}"


def python_image(env: dict[str, str]) -> str:
    """The tests' Python image, built once per machine and per inputs (`make test-image`, before
    the suite; about a minute), then reused from podman's image store, as a pre-pulled image on a
    node would be. Built here when missing (a suite started without make): under a file lock,
    so concurrent test workers wait for the first build."""
    name = python_image_name()
    if _podman(env, "image", "exists", name, check=False).returncode == 0:
        return name
    with open("/var/tmp/gpufleet-test-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _podman(env, "image", "exists", name, check=False).returncode != 0:
            subprocess.run(
                ["bash", str(HERE / "build_image.sh"), str(REPO / ".venv"), name],
                env={**os.environ, **env},
                check=True,
                capture_output=True,
            )
    return name


def tiny_image(env: dict[str, str], name: str, marker: str) -> str:
    """An image of dash and cat (and their libraries) whose /marker holds `marker`."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-tiny-") as d:
        root = Path(d)
        files = ["/bin/dash", "/bin/cat", "/bin/sleep"]
        libs = subprocess.run(["ldd", *files], capture_output=True, text=True).stdout.split()
        for f in files + [x for x in libs if x.startswith("/") and ":" not in x]:
            dst = root / f.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
        (root / "bin" / "sh").symlink_to("dash")
        (root / "marker").write_text(marker + "\n")
        tar = subprocess.run(["tar", "-C", d, "-c", "."], capture_output=True, check=True).stdout
        subprocess.run(
            ["podman", "import", "-", name], input=tar, env={**os.environ, **env}, check=True, capture_output=True
        )
    return name


def containers_named(env: dict[str, str], prefix: str) -> list[str]:
    """Containers (running or not) whose name starts with `prefix`."""
    out = _podman(env, "ps", "-a", "--format", "{{.Names}}").stdout.split()
    return [n for n in out if n.startswith(prefix)]


class Registry:
    """Debian's docker-registry (the distribution registry) on a free loopback port, its storage
    under `root`; `stop()` ends it."""

    def __init__(self, root: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        (root / "data").mkdir(parents=True, exist_ok=True)
        conf = root / "registry.yml"
        conf.write_text(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {root / 'data'}\nhttp:\n  addr: {self.address}\n"
        )
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(conf)], stdout=subprocess.DEVNULL, stderr=open(root / "registry.log", "w")
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"docker-registry did not listen on {self.address}")

    def push(self, env: dict[str, str], local: str, name: str) -> str:
        ref = f"{self.address}/{name}"
        _podman(env, "push", "--tls-verify=false", local, ref)
        return ref

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


if __name__ == "__main__":  # `make test-image`: build the image now, before the suite, if missing
    with tempfile.TemporaryDirectory(prefix="gpufleet-podman-conf-") as conf:
        print(python_image(podman_env(Path(conf))))
