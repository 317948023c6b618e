# A3 Mega: GPUDirect-TCPXO: the dmabuf import-helper module, the aperture devices
# udev rule, the NCCL plugin installer (NCCL into /var/lib/tcpxo/lib64) and the RxDM container.
# Images: the current pair of github.com/GoogleCloudPlatform/container-engine-accelerators
# gpudirect-tcpxo/README.md (Jan 9, 2026), qualified with NCCL 2.28.7-1.
readonly TCPXO_PLUGIN_IMAGE=us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev:v1.0.15
readonly TCPXO_RXDM_IMAGE=us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.21
readonly APERTURE_RULE=/etc/udev/rules.d/00-a3-megagpu.rules


ensure_import_helper() {
  if ! modinfo import-helper >/dev/null 2>&1; then
    # github.com/GoogleCloudPlatform/cluster-toolkit examples/machine-learning/a3-megagpu-8g/
    # a3mega-slurm-blueprint.yaml: dmabuf-import-helper DKMS package from Google's Artifact Registry apt repo.
    apt_install apt-transport-artifact-registry
    local list=/etc/apt/sources.list.d/gpudirect-tcpxo.list
    if [[ ! -f "$list" ]]; then
      echo "deb [arch=all trusted=yes] ar+https://us-apt.pkg.dev/projects/gce-ai-infra gpudirect-tcpxo-apt main" >"$list"
      apt-get update -qq
    fi
    apt_install "linux-headers-$(uname -r)" dkms dmabuf-import-helper
  fi
  modprobe import-helper
}

ensure_aperture_devices() {
  local want
  want='ACTION=="add", SUBSYSTEM=="pci", ATTR{vendor}=="0x1ae0", ATTR{device}=="0x0084", TAG+="systemd", RUN+="/usr/bin/mkdir --mode=0755 -p /dev/aperture_devices", RUN+="/usr/bin/systemd-mount --type=none --options=bind --collect %S/%p /dev/aperture_devices/%k", RUN+="/usr/bin/bash -c '"'"'/usr/bin/chmod 0666 /dev/aperture_devices/%k/resource*'"'"'"'
  if [[ "$(cat "$APERTURE_RULE" 2>/dev/null)" != "$want" ]]; then
    printf '%s\n' "$want" >"$APERTURE_RULE"
    udevadm control --reload-rules
    udevadm trigger --subsystem-match=pci --action=add
  fi
  # slurmd waits up to 60 s for the devices (same a3mega-slurm-blueprint.yaml).
  local i
  for ((i = 0; i < 30; i++)); do
    [[ -n "$(ls -A /dev/aperture_devices 2>/dev/null)" ]] && return 0
    sleep 2
  done
  log "/dev/aperture_devices is still empty after 60 s"
  return 1
}

net_stack_setup() {
  ensure_docker_gpus
  ensure_import_helper
  ensure_aperture_devices
  iptables -C INPUT -p tcp -m tcp -j ACCEPT 2>/dev/null || iptables -I INPUT -p tcp -m tcp -j ACCEPT
  gcloud auth configure-docker --quiet us-docker.pkg.dev >/dev/null 2>&1 || true
  local profile=/var/lib/tcpxo/lib64/nccl-env-profile.sh
  if [[ ! -e /var/lib/tcpxo/lib64/libnccl-net.so ]]; then
    rm -rf /var/lib/tcpxo/lib64
    docker run --rm --name nccl-installer --network=host -v /var/lib:/var/lib "$TCPXO_PLUGIN_IMAGE" install --install-nccl
  fi
  exec_mount /var/lib/tcpxo
  # On VMs the plugin finds the aperture devices here (cluster-toolkit examples/machine-learning/
  # a3-megagpu-8g/nccl-tests/run-nccl-tests.sh; github.com/GoogleCloudPlatform/slurm-gcp
  # tools/prologs-epilogs/receive-data-path-manager-mega).
  if ! grep -q NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY "$profile" 2>/dev/null; then
    echo 'export NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY=/dev/aperture_devices' >>"$profile"
  fi
  if [[ -z "$(docker ps -q -f name=^receive-datapath-manager$)" ]]; then
    docker rm -f receive-datapath-manager >/dev/null 2>&1 || true
    # Since RxDM v1.0.20 the only flag is --num_hops=2 (github.com/google/nccl-plugin-gpudirect-tcpxo
    # README.md).
    docker run --detach --pull=always --name receive-datapath-manager \
      --cap-add=NET_ADMIN --network=host --privileged --gpus all \
      --volume /var/lib/nvidia/lib64:/usr/local/nvidia/lib64 \
      --volume /dev/dmabuf_import_helper:/dev/dmabuf_import_helper \
      --env LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu \
      "$TCPXO_RXDM_IMAGE" --num_hops=2
  fi
  # RxDM takes ~30 s to initialise (CEA best-practice.md); slurm-gcp waits up to 120 s.
  local i
  for ((i = 0; i < 60; i++)); do
    docker logs receive-datapath-manager 2>&1 | grep -q "Buffer manager initialization complete" && break
    sleep 2
  done
  if ((i == 60)); then
    log "RxDM did not report 'Buffer manager initialization complete' within 120 s"
    return 1
  fi
  NCCL_VERSION=$(nccl_version /var/lib/tcpxo/lib64)
  PLUGIN_VERSION="gpudirecttcpxo-${TCPXO_PLUGIN_IMAGE##*:}+rxdm-${TCPXO_RXDM_IMAGE##*:}"
}
