# A3 Mega: GPUDirect-TCPXO: the dmabuf import-helper module, the aperture devices
# udev rule, the NCCL plugin installer (NCCL into /var/lib/tcpxo/lib64) and the RxDM container.
# Images, by digest: infra/pins.py (TCPXO_PLUGIN, TCPXO_RXDM).
readonly TCPXO_PLUGIN_IMAGE=@@TCPXO_PLUGIN_IMAGE@@
readonly TCPXO_RXDM_IMAGE=@@TCPXO_RXDM_IMAGE@@
readonly RXDM_CONTAINER=@@RXDM_CONTAINER@@
readonly APERTURE_RULE=/etc/udev/rules.d/00-a3-megagpu.rules


ensure_import_helper() {
  if ! modinfo import-helper >/dev/null 2>&1; then
    # github.com/GoogleCloudPlatform/cluster-toolkit examples/machine-learning/a3-megagpu-8g/
    # a3mega-slurm-blueprint.yaml: dmabuf-import-helper DKMS package from Google's Artifact Registry
    # apt repo, signed by the Artifact Registry key (pinned), not [trusted=yes].
    ensure_artifact_registry_apt
    apt_source /etc/apt/sources.list.d/gpudirect-tcpxo.list \
      "deb [arch=all signed-by=$AR_KEYRING] ar+https://us-apt.pkg.dev/projects/gce-ai-infra gpudirect-tcpxo-apt main"
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
  accept_tcp_on_gpu_nics
  local profile=/var/lib/tcpxo/lib64/nccl-env-profile.sh
  if [[ ! -e /var/lib/tcpxo/lib64/libnccl-net.so ]]; then
    rm -rf /var/lib/tcpxo/lib64
    ensure_image "$TCPXO_PLUGIN_IMAGE"
    docker run --rm --name nccl-installer --network=host -v /var/lib:/var/lib "$TCPXO_PLUGIN_IMAGE" install --install-nccl
  fi
  exec_mount /var/lib/tcpxo
  # On VMs the plugin finds the aperture devices here (cluster-toolkit examples/machine-learning/
  # a3-megagpu-8g/nccl-tests/run-nccl-tests.sh; github.com/GoogleCloudPlatform/slurm-gcp
  # tools/prologs-epilogs/receive-data-path-manager-mega).
  if ! grep -q NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY "$profile" 2>/dev/null; then
    echo 'export NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY=/dev/aperture_devices' >>"$profile"
  fi
  # RxDM: the container RXDM_CONTAINER (what the launcher checks; TCPXO has no socket directory).
  if [[ -z "$(docker ps -q -f "name=^${RXDM_CONTAINER}\$")" ]]; then
    docker rm -f "$RXDM_CONTAINER" >/dev/null 2>&1 || true
    ensure_image "$TCPXO_RXDM_IMAGE"
    # Since RxDM v1.0.20 the only flag is --num_hops=2 (github.com/google/nccl-plugin-gpudirect-tcpxo
    # README.md).
    docker run --detach --name "$RXDM_CONTAINER" \
      --cap-add=NET_ADMIN --network=host --privileged --gpus all \
      --volume /var/lib/nvidia/lib64:/usr/local/nvidia/lib64 \
      --volume /dev/dmabuf_import_helper:/dev/dmabuf_import_helper \
      --env LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu \
      "$TCPXO_RXDM_IMAGE" --num_hops=2
  fi
  # RxDM takes ~30 s to initialise (CEA best-practice.md); slurm-gcp waits up to 120 s.
  local i
  for ((i = 0; i < 60; i++)); do
    docker logs "$RXDM_CONTAINER" 2>&1 | grep -q "Buffer manager initialization complete" && break
    sleep 2
  done
  if ((i == 60)); then
    log "RxDM did not report 'Buffer manager initialization complete' within 120 s"
    return 1
  fi
  NCCL_VERSION=$(nccl_version /var/lib/tcpxo/lib64)
  PLUGIN_VERSION="gpudirecttcpxo-@@TCPXO_PLUGIN_TAG@@+rxdm-@@TCPXO_RXDM_TAG@@"
}
