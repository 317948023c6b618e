#!/bin/bash
# gpufleet node startup script: @@MACHINE_TYPE@@ (@@NET_STACK@@) on @@IMAGE_OS@@, cluster @@CLUSTER@@.
# Rendered by infra/startup.py from infra/templates/; do not edit on the node.
# GCE runs it at every boot, so every step checks before it acts and re-running it is safe.
# It writes the ready marker last: a node is usable once that file exists.
set -Eeuo pipefail  # -E: the ERR trap also fires inside functions

readonly CLUSTER=@@CLUSTER@@
readonly MACHINE_TYPE=@@MACHINE_TYPE@@
readonly NET_STACK=@@NET_STACK@@
readonly IMAGE_OS=@@IMAGE_OS@@
readonly GPU_COUNT=@@GPU_COUNT@@
readonly GPU_NICS=(@@GPU_NICS@@)
readonly LOCAL_SSD_COUNT=@@LOCAL_SSD_COUNT@@
readonly LOCAL_SSD_MOUNT=@@LOCAL_SSD_MOUNT@@
readonly READY_MARKER=@@READY_MARKER@@
readonly NCCL_TESTS_DIR=@@NCCL_TESTS_DIR@@
# Artifact Registry hosts whose images this node pulls: Google's GPUDirect images and the stack's
# own docker repository (empty entries are none).
readonly DOCKER_REGISTRIES=(@@DOCKER_REGISTRIES@@)
# Pins (infra/pins.py holds each with its source).
readonly NCCL_TESTS_URL=@@NCCL_TESTS_URL@@
readonly NCCL_TESTS_PIN=@@NCCL_TESTS_PIN@@
readonly CUDA_DEVEL_IMAGE=@@CUDA_DEVEL_IMAGE@@
readonly UV_VERSION=@@UV_VERSION@@
readonly UV_SHA256=@@UV_HASH@@
readonly UV_HOME=/var/lib/gpufleet/uv
readonly UV_LINK=/usr/local/bin/uv
readonly UV_CONFIG=/etc/uv/uv.toml
readonly STATE_DIR=/var/lib/gpufleet
# Who holds this node, one file per job (launcher/core/holds.py, gpufleet.contracts.HOLDS_DIR).
readonly HOLDS_DIR=/run/gpufleet-holds
readonly ERROR_FILE="$STATE_DIR/startup-error.txt"

DRIVER_VERSION=unknown
CUDA_VERSION=unknown
NCCL_VERSION=unknown
PLUGIN_VERSION=none
NCCL_TESTS_COMMIT=unknown

@@COMMON@@

# COS mounts /var/lib noexec; binaries we place there need an exec bind mount (Google's TCPX
# sequence, https://cloud.google.com/compute/docs/gpus/gpudirect, does this for /var/lib/nvidia
# and /var/lib/tcpx).
exec_mount() {
  local dir=$1
  mkdir -p "$dir"
  [[ "$IMAGE_OS" == cos ]] || return 0
  if ! findmnt -n "$dir" >/dev/null 2>&1; then
    mount --bind "$dir" "$dir"
  fi
  mount -o remount,exec "$dir"
}

prepare() {
  mkdir -p "$STATE_DIR"
  # A marker or error left by the previous boot must not describe this one.
  rm -f "$READY_MARKER" "$READY_MARKER.tmp" "$ERROR_FILE"
  exec_mount "$STATE_DIR"
}

# Wait for the GPU NICs to be routable before anything uses them. The delay-gpu-network.service of
# github.com/GoogleCloudPlatform/cluster-toolkit modules/scripts/startup-script/files/install_gpu_network_wait_online.yml
# runs systemd-networkd-wait-online -o routable --timeout=180.
wait_for_gpu_nics() {
  ((${#GPU_NICS[@]} > 0)) || return 0
  local deadline=$((SECONDS + 180)) nic
  for nic in "${GPU_NICS[@]}"; do
    until ip -4 route show dev "$nic" 2>/dev/null | grep -q .; do
      if ((SECONDS >= deadline)); then
        log "GPU NIC $nic is not routable after 180 s"
        return 1
      fi
      sleep 2
    done
  done
  log "GPU NICs routable: ${GPU_NICS[*]}"
}

ensure_driver() {
  if [[ "$IMAGE_OS" == cos ]]; then
    # https://cloud.google.com/compute/docs/gpus/gpudirect, as skypilot (sky/provision/gcp/
    # constants.py GPU_DIRECT_TCPX_USER_DATA) and dstack run it; a no-op once installed.
    cos-extensions install gpu -- --version=latest
    exec_mount /var/lib/nvidia
    export PATH="/var/lib/nvidia/bin:$PATH"
  elif ! nvidia-smi -L >/dev/null 2>&1; then
    # The Ubuntu accelerator images ship the driver (github.com/GoogleCloudPlatform/cluster-toolkit
    # examples/machine-learning/a3-megagpu-8g/a3mega-slurm-blueprint.yaml boots one); other
    # Ubuntu images get Ubuntu's recommended server driver.
    apt_install ubuntu-drivers-common
    ubuntu-drivers install --gpgpu
    modprobe nvidia
  fi
  local found
  found=$(nvidia-smi -L | grep -c '^GPU ' || true)
  if ((found != GPU_COUNT)); then
    log "expected $GPU_COUNT GPUs on $MACHINE_TYPE, nvidia-smi lists $found"
    return 1
  fi
  DRIVER_VERSION=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
  CUDA_VERSION=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)
  # Persistence mode keeps the driver loaded between jobs (cluster-toolkit's GPU images enable
  # nvidia-persistenced; examples/machine-learning/a4-highgpu-8g/a4high-vm.yaml starts it).
  nvidia-smi -pm 1 >/dev/null
}

# The limits github.com/GoogleCloudPlatform/cluster-toolkit's GPU images write to
# /etc/security/limits.d/99-unlimited.conf; written only when it differs.
set_ulimits() {
  local conf=/etc/security/limits.d/99-gpufleet.conf want
  [[ -d /etc/security/limits.d ]] || return 0
  want=$'* - memlock unlimited\n* - nproc unlimited\n* - stack unlimited\n* - nofile 1048576\n* - cpu unlimited\n* - rtprio unlimited'
  if [[ "$(cat "$conf" 2>/dev/null)" != "$want" ]]; then
    printf '%s\n' "$want" >"$conf"
  fi
}

# RAID0 of the bundled local NVMe SSDs at one mount point, re-done at every boot because a stop or
# a maintenance event discards local SSD contents (github.com/GoogleCloudPlatform/cluster-toolkit
# modules/scripts/startup-script/files/setup-raid.yml).
setup_local_ssd() {
  ((LOCAL_SSD_COUNT > 0)) || return 0
  if mountpoint -q "$LOCAL_SSD_MOUNT"; then
    return 0
  fi
  local disks=() dev
  mapfile -t disks < <({ compgen -G '/dev/disk/by-id/google-local-nvme-ssd-*' || true; } | sort)
  if ((${#disks[@]} == 0)); then
    log "no local NVMe SSDs found; $LOCAL_SSD_MOUNT stays on the boot disk"
    return 0
  fi
  dev=${disks[0]}
  if ((${#disks[@]} > 1)); then
    if ! command -v mdadm >/dev/null 2>&1 && [[ "$IMAGE_OS" == ubuntu ]]; then
      apt_install mdadm
    fi
    if command -v mdadm >/dev/null 2>&1; then
      dev=/dev/md/localssd
      if [[ ! -e "$dev" ]] && ! mdadm --assemble "$dev" "${disks[@]}" >/dev/null 2>&1; then
        mdadm --create "$dev" --name=localssd --homehost=any --level=0 \
          --raid-devices="${#disks[@]}" "${disks[@]}" --run
      fi
    else
      log "mdadm is missing on this image; using only ${disks[0]} of ${#disks[@]} local SSDs"
    fi
  fi
  if ! blkid "$dev" >/dev/null 2>&1; then
    mkfs.ext4 -F -m 0 "$dev"
  fi
  mkdir -p "$LOCAL_SSD_MOUNT"
  mount -o discard,defaults,nofail "$dev" "$LOCAL_SSD_MOUNT"
  chmod 1777 "$LOCAL_SSD_MOUNT"
}

# The NCCL version of the library in a directory (from libnccl.so.2.X.Y), or of the libnccl2 package.
nccl_version() {
  local dir=${1:-} lib
  if [[ -n "$dir" ]]; then
    lib=$(find "$dir" -maxdepth 1 -name 'libnccl.so.2.*' 2>/dev/null | sort | tail -n 1)
    if [[ -n "$lib" ]]; then
      echo "${lib##*/libnccl.so.}"
      return 0
    fi
  fi
  dpkg-query -W -f='${Version}' libnccl2 2>/dev/null || echo unknown
}

# Docker that can hand GPUs to a container (the TCPX/TCPXO RxDM and plugin installers run in one).
ensure_docker_gpus() {
  # COS ships docker and exposes the driver under /var/lib/nvidia; Ubuntu needs docker and the
  # NVIDIA container toolkit for --gpus, from NVIDIA's repository signed by its pinned key.
  if [[ "$IMAGE_OS" == cos ]]; then
    return 0
  fi
  apt_install docker.io gnupg
  if ! command -v nvidia-ctk >/dev/null 2>&1; then
    local keyring=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
    pinned_keyring "$keyring" @@NVIDIA_CTK_KEY_URL@@ @@NVIDIA_CTK_KEY_FPRS@@
    # shellcheck disable=SC2016  # $(ARCH) is apt's, not the shell's
    apt_source /etc/apt/sources.list.d/nvidia-container-toolkit.list "deb [signed-by=$keyring] "@@NVIDIA_CTK_REPO@@
    apt_install nvidia-container-toolkit
    nvidia-ctk runtime configure --runtime=docker
    systemctl restart docker
  fi
}

# The ar+https apt transport that Google's Artifact Registry apt repositories need, from
# packages.cloud.google.com signed by its pinned keys; then the Artifact Registry signing key, so a
# repository there is added `signed-by` it, never [trusted=yes].
ensure_artifact_registry_apt() {
  local google=/usr/share/keyrings/gpufleet-google-cloud.gpg
  apt_install gnupg
  if ! dpkg-query -W -f='${Status}' apt-transport-artifact-registry 2>/dev/null | grep -q "install ok installed"; then
    pinned_keyring "$google" @@GOOGLE_APT_KEY_URL@@ @@GOOGLE_APT_KEY_FPRS@@
    apt_source /etc/apt/sources.list.d/gpufleet-artifact-registry-transport.list \
      "deb [signed-by=$google] "@@AR_TRANSPORT_REPO@@
    apt_install apt-transport-artifact-registry
  fi
  pinned_keyring "$AR_KEYRING" @@AR_APT_KEY_URL@@ @@AR_APT_KEY_FPRS@@
}
readonly AR_KEYRING=/usr/share/keyrings/gpufleet-artifact-registry.gpg

# GPUDirect's receive path accepts TCP from the other nodes on the GPU NICs (Google's sequence adds
# one accept rule on every interface; this adds it on the GPU NICs alone). -C first: once per boot.
accept_tcp_on_gpu_nics() {
  local nic
  for nic in "${GPU_NICS[@]}"; do
    iptables -C INPUT -i "$nic" -p tcp -m tcp -j ACCEPT 2>/dev/null \
      || iptables -I INPUT -i "$nic" -p tcp -m tcp -j ACCEPT
  done
}

# Docker pulls from Artifact Registry with the VM's service account, as Google documents for
# Compute Engine VMs (https://cloud.google.com/artifact-registry/docs/docker/authentication):
# gcloud's credential helper on Ubuntu (`gcloud auth configure-docker HOSTS`), the standalone
# docker-credential-gcr on Container-Optimized OS (`docker-credential-gcr configure-docker
# --registries=HOSTS`, https://cloud.google.com/container-optimized-os/docs/how-to/run-container-instance).
# For root, whose docker runs RxDM and the installers; new users' homes get the same config
# (/etc/skel). Without the helper the node still boots: a pull from the stack's repository then
# fails with the registry's own reason.
configure_registry_auth() {
  local hosts
  hosts=$(IFS=,; echo "${DOCKER_REGISTRIES[*]}")
  [[ -n "$hosts" ]] || return 0
  if [[ "$IMAGE_OS" == cos ]]; then
    docker-credential-gcr configure-docker --registries="$hosts" >/dev/null 2>&1 \
      || log "docker-credential-gcr could not configure $hosts"
    return 0
  fi
  if ! command -v gcloud >/dev/null 2>&1; then
    log "no gcloud on this image: docker has no credentials for $hosts"
    return 0
  fi
  gcloud auth configure-docker --quiet "$hosts" >/dev/null 2>&1 || log "gcloud could not configure docker for $hosts"
  if [[ -f /root/.docker/config.json && -d /etc/skel ]]; then
    mkdir -p /etc/skel/.docker
    cp -f /root/.docker/config.json /etc/skel/.docker/config.json
  fi
}

# The image a container runs from: pulled only when it is not here (a digest is never pulled
# again); its digest logged, for pins without one (infra/pins.py).
ensure_image() {
  local ref=$1
  if ! docker image inspect "$ref" >/dev/null 2>&1; then
    docker pull --quiet "$ref" >/dev/null
  fi
  log "image $ref: $(docker image inspect --format '{{index .RepoDigests 0}}' "$ref" 2>/dev/null || echo 'digest unknown')"
}

# ---- network stack: @@NET_STACK@@ ----------------------------------------------------------
@@NET_STACK_SETUP@@
# ---- end of network stack ------------------------------------------------------------------

# nccl-tests (MPI build, so it runs across nodes) into NCCL_TESTS_DIR, once: the pinned commit,
# fetched by its hash and checked before it is built as root.
build_nccl_tests() {
  local src="$STATE_DIR/nccl-tests"
  if [[ -x "$NCCL_TESTS_DIR/all_reduce_perf" && "$(git -C "$src" rev-parse HEAD 2>/dev/null)" == "$NCCL_TESTS_PIN" ]]; then
    NCCL_TESTS_COMMIT=${NCCL_TESTS_PIN:0:7}
    return 0
  fi
  if [[ "$IMAGE_OS" == cos ]]; then
    # COS has no compiler: build in a CUDA devel container (pinned by digest), onto the
    # exec-mounted state dir.
    ensure_image "$CUDA_DEVEL_IMAGE"
    docker run --rm --network=host -v "$STATE_DIR:$STATE_DIR" \
      -e SRC="$src" -e URL="$NCCL_TESTS_URL" -e PIN="$NCCL_TESTS_PIN" -e OUT="$NCCL_TESTS_DIR" \
      "$CUDA_DEVEL_IMAGE" bash -c 'set -e
        apt-get update -qq && apt-get install -y -qq git libnccl-dev libopenmpi-dev
        rm -rf "$SRC" && git init -q "$SRC" && git -C "$SRC" fetch -q --depth 1 "$URL" "$PIN"
        git -C "$SRC" checkout -q --detach FETCH_HEAD
        [[ "$(git -C "$SRC" rev-parse HEAD)" == "$PIN" ]]
        make -C "$SRC" -j MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi NCCL_HOME=/usr BUILDDIR="$OUT"'
  else
    ensure_cuda_toolkit
    apt_install git libopenmpi-dev openmpi-bin build-essential
    rm -rf "$src"
    git init -q "$src"
    git -C "$src" fetch -q --depth 1 "$NCCL_TESTS_URL" "$NCCL_TESTS_PIN"
    git -C "$src" checkout -q --detach FETCH_HEAD
    if [[ "$(git -C "$src" rev-parse HEAD)" != "$NCCL_TESTS_PIN" ]]; then
      log "nccl-tests: fetched $(git -C "$src" rev-parse HEAD), not the pinned $NCCL_TESTS_PIN"
      return 1
    fi
    make -C "$src" -j "$(nproc)" MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi \
      CUDA_HOME=/usr/local/cuda NCCL_HOME=/usr BUILDDIR="$NCCL_TESTS_DIR"
  fi
  NCCL_TESTS_COMMIT=${NCCL_TESTS_PIN:0:7}
}

# nvcc and NCCL headers from NVIDIA's CUDA apt repo (github.com/GoogleCloudPlatform/cluster-toolkit
# examples/machine-learning/a4-highgpu-8g/a4high-vm.yaml installs cuda-toolkit-12-8, libnccl2,
# libnccl-dev from it). Its keyring package is checked against its pinned SHA-256 before dpkg.
ensure_cuda_toolkit() {
  if [[ -x /usr/local/cuda/bin/nvcc ]] && dpkg-query -W libnccl-dev >/dev/null 2>&1; then
    return 0
  fi
  if ! dpkg-query -W -f='${Status}' cuda-keyring 2>/dev/null | grep -q "install ok installed"; then
    local release sum deb=/tmp/cuda-keyring.deb
    release=$(sed -n 's/^VERSION_ID="\{0,1\}\([0-9.]*\)"\{0,1\}$/\1/p' /etc/os-release)
    release=${release//./}
    declare -A sums=(@@CUDA_KEYRING_SUMS@@)
    sum=${sums[$release]:-}
    if [[ -z "$sum" ]]; then
      log "no pinned cuda-keyring checksum for Ubuntu $release (infra/pins.py has: ${!sums[*]})"
      return 1
    fi
    curl -fsSL -o "$deb" "@@CUDA_KEYRING_URL@@"
    if ! echo "$sum  $deb" | sha256sum --check --status; then
      log "cuda-keyring for Ubuntu $release does not match its pinned SHA-256 $sum"
      rm -f "$deb"
      return 1
    fi
    dpkg -i "$deb"
    rm -f "$deb"
    apt-get update -qq
  fi
  apt_install cuda-toolkit-12-8 libnccl2 libnccl-dev
}

# What building a job's Python environment needs on Ubuntu/Debian (COS runs jobs in containers):
# python3-venv, uv (the pinned wheel, by its hash) on the PATH, and uv's cache on the local SSD
# when there is one, so environments hardlink from it (/etc/uv/uv.toml, uv's system config:
# https://docs.astral.sh/uv/concepts/configuration-files/).
prepare_python_build() {
  [[ "$IMAGE_OS" == ubuntu ]] || return 0
  apt_install python3-venv
  if [[ "$("$UV_HOME/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
    rm -rf "$UV_HOME"
    python3 -m venv "$UV_HOME"
    printf 'uv==%s --hash=sha256:%s\n' "$UV_VERSION" "$UV_SHA256" >"$UV_HOME/requirements.txt"
    "$UV_HOME/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes \
      --only-binary=:all: -r "$UV_HOME/requirements.txt"
  fi
  if [[ "$(readlink "$UV_LINK" 2>/dev/null)" != "$UV_HOME/bin/uv" ]]; then
    mkdir -p "$(dirname "$UV_LINK")"
    ln -sfn "$UV_HOME/bin/uv" "$UV_LINK"
  fi
  # No shared cache: every account keeps uv's cache in its own directory (on the local SSD when
  # there is one, LOCAL_SSD_MOUNT/gpufleet-UID, made by the launcher's node agent), since entries
  # one account plants in a shared cache are installed into another's environment. A config an
  # older startup script wrote, pointing every account at one cache, goes.
  if [[ "$(cat "$UV_CONFIG" 2>/dev/null)" == "cache-dir = \"$LOCAL_SSD_MOUNT/uv-cache\"" ]]; then
    rm -f "$UV_CONFIG"
  fi
}

# The registry of who holds this node (launcher/core/holds.py): every account reads it and each
# writes only its own files in it, so root's and sticky, like /tmp. Made at every boot (/run is a
# tmpfs: the holds of jobs from before a reboot are gone with them) where no account can make it
# first (/run is root's, 0755).
make_holds_dir() {
  install -d -o root -g root -m 1777 "$HOLDS_DIR"
}

write_ready_marker() {
  local tmp="$READY_MARKER.tmp"
  printf '{"cluster": "%s", "node": "%s", "machine_type": "%s", "net_stack": "%s", "driver": "%s", "cuda": "%s", "nccl": "%s", "plugin": "%s", "nccl_tests": "%s", "booted_at": "%s"}\n' \
    "$(json_str "$CLUSTER")" "$(json_str "$(hostname)")" "$(json_str "$MACHINE_TYPE")" \
    "$(json_str "$NET_STACK")" "$(json_str "$DRIVER_VERSION")" "$(json_str "${CUDA_VERSION:-unknown}")" \
    "$(json_str "${NCCL_VERSION:-unknown}")" "$(json_str "$PLUGIN_VERSION")" \
    "$(json_str "$NCCL_TESTS_COMMIT")" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$tmp"
  mv -f "$tmp" "$READY_MARKER"
  log "ready: $READY_MARKER"
}

main() {
  prepare
  make_holds_dir
  wait_for_gpu_nics
  ensure_driver
  set_ulimits
  setup_local_ssd
  prepare_python_build
  configure_registry_auth  # before the network stack pulls Google's GPUDirect images
  net_stack_setup
  build_nccl_tests
  if [[ "$NCCL_VERSION" == unknown ]]; then
    NCCL_VERSION=$(nccl_version "")
  fi
  write_ready_marker
}

main "$@"
