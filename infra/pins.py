"""What the startup scripts run as root, pinned: each commit, digest, checksum and signing key once,
here, with the public place it comes from. infra/startup.py renders these into the scripts; the
templates hold no version, digest or key of their own (tests/infra/test_startup.py holds them to it).

A pin that has no public source to check it against says so instead of inventing a value.

To move a pin: change it here, with its source, and run `python -m pytest tests/infra/test_startup.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet import contracts

__all__ = [
    "GitPin",
    "AptKey",
    "Image",
    "NCCL_TESTS",
    "CUDA_KEYRING_URL",
    "CUDA_KEYRING_SHA256",
    "NVIDIA_CONTAINER_TOOLKIT_KEY",
    "NVIDIA_CONTAINER_TOOLKIT_REPO",
    "GOOGLE_CLOUD_APT_KEY",
    "ARTIFACT_REGISTRY_APT_KEY",
    "ARTIFACT_REGISTRY_TRANSPORT_REPO",
    "TCPX_PLUGIN",
    "TCPX_RXDM",
    "TCPXO_PLUGIN",
    "TCPXO_RXDM",
    "CUDA_DEVEL_IMAGE",
    "UV",
]


@dataclass(frozen=True)
class GitPin:
    url: str
    tag: str
    commit: str
    """The full commit the tag names; the script checks out this commit and refuses another."""


@dataclass(frozen=True)
class AptKey:
    url: str
    fingerprints: tuple[str, ...]
    """Only these keys go into the keyring the repository is `signed-by`; a download that holds
    none of them stops the script (a rotated key is a pin to move here, not a key to trust)."""


@dataclass(frozen=True)
class Image:
    name: str
    tag: str
    digest: str | None
    """sha256:... of the image (its manifest list where there is one); None where no public source
    gives one: the script then pulls the tag once and logs the digest it got."""

    @property
    def ref(self) -> str:
        """What the script runs: NAME@DIGEST when pinned, else NAME:TAG."""
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"


# ---- sources built as root -------------------------------------------------------------------------

# nccl-tests v2.19.6 (github.com/NVIDIA/nccl-tests, tag v2.19.6: "NCCL_TESTS_VERSION 2.19.6").
NCCL_TESTS = GitPin(
    url="https://github.com/NVIDIA/nccl-tests.git",
    tag="v2.19.6",
    commit="a0b82b2260cf5152b9f8c061bbf7eaf0ba096432",
)

# ---- apt repositories and their keys ---------------------------------------------------------------

# NVIDIA's CUDA apt repository keyring package (https://docs.nvidia.com/cuda/cuda-installation-guide-linux/
# "Network Repository Installation": download cuda-keyring_1.1-1_all.deb, dpkg -i). NVIDIA publishes
# no checksum for it; these SHA-256 sums are the ones independent public Dockerfiles and setup
# scripts pin for the same URLs (found by searching public GitHub code for the file name; the same
# values in three or more unrelated repositories each). Ubuntu releases not listed are refused.
CUDA_KEYRING_URL = (
    "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu{release}/x86_64/cuda-keyring_1.1-1_all.deb"
)
CUDA_KEYRING_SHA256 = {
    "2204": "d93190d50b98ad4699ff40f4f7af50f16a76dac3bb8da1eaaf366d47898ff8df",
    "2404": "d2a6b11c096396d868758b86dab1823b25e14d70333f1dfa74da5ddaf6a06dba",
}

# The NVIDIA Container Toolkit's repository (https://docs.nvidia.com/datacenter/cloud-native/
# container-toolkit/latest/install-guide.html#with-apt-ubuntu-debian): its key at `url`, whose
# fingerprint is C95B 321B 61E8 8C18 09C4 F759 DDCA E044 F796 ECB0. NVIDIA's guide prints no
# fingerprint; this is the one public setup scripts pin for this key URL (found by searching public
# code: the same value in many unrelated repositories, e.g. Puppet manifests that import
# https://nvidia.github.io/nvidia-docker/gpgkey by this ID).
NVIDIA_CONTAINER_TOOLKIT_KEY = AptKey(
    url="https://nvidia.github.io/libnvidia-container/gpgkey",
    fingerprints=("C95B321B61E88C1809C4F759DDCAE044F796ECB0",),
)
# The one line NVIDIA's nvidia-container-toolkit.list holds, written here rather than downloaded.
NVIDIA_CONTAINER_TOOLKIT_REPO = "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /"

# packages.cloud.google.com/apt (google-fast-socket, apt-transport-artifact-registry): Google's
# "Rapture Automatic Signing Key" at `url` (https://cloud.google.com/sdk/docs/install#deb imports
# it the same way). Its fingerprints, as Kubernetes' and others' apt scripts pin this URL's keys.
GOOGLE_CLOUD_APT_KEY = AptKey(
    url="https://packages.cloud.google.com/apt/doc/apt-key.gpg",
    fingerprints=("A362B822F6DEDC652817EA46B53DC80D13EDEF05", "54A647F9048D5688D7DA2ABE6A030B21BA07F4FB"),
)
# Every Artifact Registry apt repository is signed by one key, "Artifact Registry Repository Signer
# <artifact-registry-repository-signer@google.com>", served at LOCATION-apt.pkg.dev/doc/repo-signing-key.gpg
# (https://cloud.google.com/artifact-registry/docs/os-packages/debian/configure). Its fingerprint
# 35BA A0B3 3E9E B396 F59C A838 C0BA 5CE6 DC63 15A3 is the one Mozilla publishes for its own
# Artifact Registry-hosted repository (https://support.mozilla.org/kb/install-firefox-linux).
ARTIFACT_REGISTRY_APT_KEY = AptKey(
    url="https://us-apt.pkg.dev/doc/repo-signing-key.gpg",
    fingerprints=("35BAA0B33E9EB396F59CA838C0BA5CE6DC6315A3",),
)
# The suite that has apt-transport-artifact-registry (the `ar+https` transport the gce-ai-infra
# repositories need): github.com/GoogleCloudPlatform/cluster-toolkit examples/machine-learning/
# a3-megagpu-8g/a3mega-slurm-blueprint.yaml adds this same line.
ARTIFACT_REGISTRY_TRANSPORT_REPO = "https://packages.cloud.google.com/apt apt-transport-artifact-registry-stable main"

# ---- containers run as root ------------------------------------------------------------------------

# A3 High (GPUDirect-TCPX): the pair github.com/GoogleCloudPlatform/cluster-toolkit pins together
# ("rxdm_version = v2.0.12 # matching nccl-tcpx-installer version v3.1.9"), the same pair
# github.com/GoogleCloudPlatform/container-engine-accelerators gpudirect-tcpx/README.md lists
# (Feb 15, 2024). No public source here gives their digests: they run by tag, pulled once (never
# --pull=always), and the script logs the digest it got.
TCPX_PLUGIN = Image("us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/nccl-plugin-gpudirecttcpx-dev", "v3.1.9", None)
TCPX_RXDM = Image("us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev", "v2.0.12", None)

# A3 Mega (GPUDirect-TCPXO): the current pair of github.com/GoogleCloudPlatform/container-engine-accelerators
# gpudirect-tcpxo/README.md (Jan 9, 2026), qualified with NCCL 2.28.7-1. Digests as NVIDIA's
# image inventory lists them (github.com/NVIDIA/aicr docs/user/container-images.md, components
# gke-nccl-tcpxo and kubeflow-trainer).
TCPXO_PLUGIN = Image(
    "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev",
    "v1.0.15",
    "sha256:4c9f0de3f39455a2ea35e844e0fc92564ca5629f6b03250fde40e8160719dae4",
)
TCPXO_RXDM = Image(
    "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev",
    "v1.0.21",
    "sha256:8d9e10fd589a34ab8a0aa64f7e70ad075c8f1c69bea176350f8d211367697e3d",
)

# Where COS (no compiler) builds nccl-tests: NVIDIA's CUDA devel image (hub.docker.com/r/nvidia/cuda),
# by the amd64 digest public Dockerfiles pin for this tag.
CUDA_DEVEL_IMAGE = Image(
    "nvidia/cuda",
    "12.8.1-devel-ubuntu22.04",
    "sha256:6617a625f4090c76c545a0e7d63f2e441718ef9af7f4efe7dd1242a29e289fd7",
)

# ---- the Python build tool -------------------------------------------------------------------------

# uv, which builds the jobs' environments: pinned in gpufleet/contracts.py (its version, its wheel's
# SHA-256 and the PyPI page they come from), since the launcher's node agent installs the same uv
# on a node without one; the startup script renders it from here.
UV = contracts.UV
