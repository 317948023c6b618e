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
readonly STATE_DIR=/var/lib/gpufleet
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
  # NVIDIA container toolkit for --gpus.
  if [[ "$IMAGE_OS" == cos ]]; then
    return 0
  fi
  apt_install docker.io
  if ! command -v nvidia-ctk >/dev/null 2>&1; then
    curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey \
      | gpg --dearmor --yes -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
    curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
      | sed 's#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#' \
      >/etc/apt/sources.list.d/nvidia-container-toolkit.list
    apt-get update -qq
    apt_install nvidia-container-toolkit
    nvidia-ctk runtime configure --runtime=docker
    systemctl restart docker
  fi
}

# ---- network stack: @@NET_STACK@@ ----------------------------------------------------------
@@NET_STACK_SETUP@@
# ---- end of network stack ------------------------------------------------------------------

# nccl-tests (MPI build, so it runs across nodes) into NCCL_TESTS_DIR, once.
build_nccl_tests() {
  local src="$STATE_DIR/nccl-tests"
  if [[ -x "$NCCL_TESTS_DIR/all_reduce_perf" ]]; then
    NCCL_TESTS_COMMIT=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)
    return 0
  fi
  if [[ "$IMAGE_OS" == cos ]]; then
    # COS has no compiler: build in a CUDA devel container, onto the exec-mounted state dir.
    docker run --rm --network=host -v "$STATE_DIR:$STATE_DIR" nvidia/cuda:12.8.1-devel-ubuntu22.04 \
      bash -c "apt-get update -qq && apt-get install -y -qq git libnccl-dev libopenmpi-dev && \
        rm -rf $src && git clone --depth 1 https://github.com/NVIDIA/nccl-tests.git $src && \
        make -C $src -j MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi NCCL_HOME=/usr BUILDDIR=$NCCL_TESTS_DIR"
  else
    ensure_cuda_toolkit
    apt_install git libopenmpi-dev openmpi-bin build-essential
    rm -rf "$src"
    git clone --depth 1 https://github.com/NVIDIA/nccl-tests.git "$src"
    make -C "$src" -j "$(nproc)" MPI=1 MPI_HOME=/usr/lib/x86_64-linux-gnu/openmpi \
      CUDA_HOME=/usr/local/cuda NCCL_HOME=/usr BUILDDIR="$NCCL_TESTS_DIR"
  fi
  NCCL_TESTS_COMMIT=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)
}

# nvcc and NCCL headers from NVIDIA's CUDA apt repo (github.com/GoogleCloudPlatform/cluster-toolkit
# examples/machine-learning/a4-highgpu-8g/a4high-vm.yaml installs cuda-toolkit-12-8, libnccl2,
# libnccl-dev from it).
ensure_cuda_toolkit() {
  if [[ -x /usr/local/cuda/bin/nvcc ]] && dpkg-query -W libnccl-dev >/dev/null 2>&1; then
    return 0
  fi
  if ! dpkg-query -W cuda-keyring >/dev/null 2>&1; then
    local version deb=/tmp/cuda-keyring.deb
    version=$(sed -n 's/^VERSION_ID="\{0,1\}\([0-9.]*\)"\{0,1\}$/\1/p' /etc/os-release)
    curl -fsSL -o "$deb" "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu${version//./}/x86_64/cuda-keyring_1.1-1_all.deb"
    dpkg -i "$deb"
    apt-get update -qq
  fi
  apt_install cuda-toolkit-12-8 libnccl2 libnccl-dev
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
  wait_for_gpu_nics
  ensure_driver
  set_ulimits
  setup_local_ssd
  net_stack_setup
  build_nccl_tests
  if [[ "$NCCL_VERSION" == unknown ]]; then
    NCCL_VERSION=$(nccl_version "")
  fi
  write_ready_marker
}

main "$@"
