# A3 High / Edge: GPUDirect-TCPX. Google's VM sequence (https://cloud.google.com/compute/docs/gpus/
# gpudirect, as skypilot sky/provision/gcp/constants.py GPU_DIRECT_TCPX_USER_DATA and dstack run
# it): the receive-datapath manager (RxDM) container, an iptables accept
# rule, the NCCL plugin installer (which also installs its NCCL into /var/lib/tcpx/lib64).
# Images: the pair github.com/GoogleCloudPlatform/cluster-toolkit pins together ("rxdm_version = v2.0.12 # matching nccl-tcpx-installer
# version v3.1.9").
readonly TCPX_PLUGIN_IMAGE=us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/nccl-plugin-gpudirecttcpx-dev:v3.1.9
readonly TCPX_RXDM_IMAGE=us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12


gpu_device_flags() {
  local i
  for ((i = 0; i < GPU_COUNT; i++)); do
    printf -- '--device=/dev/nvidia%d ' "$i"
  done
  printf -- '--device=/dev/nvidia-uvm --device=/dev/nvidiactl'
}

net_stack_setup() {
  ensure_docker_gpus
  # RxDM needs the accept rule (same Google sequence); -C first so reboots and re-runs add it once.
  iptables -C INPUT -p tcp -m tcp -j ACCEPT 2>/dev/null || iptables -I INPUT -p tcp -m tcp -j ACCEPT
  # github.com/GoogleCloudPlatform/container-engine-accelerators gpudirect-tcpx/optmem-max-ds.yaml
  # sets this for TCPX.
  sysctl -q -w net.core.optmem_max=131072
  if [[ ! -e /var/lib/tcpx/lib64/libnccl-net.so ]]; then
    docker run --rm --network=host -v /var/lib:/var/lib "$TCPX_PLUGIN_IMAGE" install --install-nccl
  fi
  exec_mount /var/lib/tcpx
  if [[ -z "$(docker ps -q -f name=^receive-datapath-manager$)" ]]; then
    docker rm -f receive-datapath-manager >/dev/null 2>&1 || true
    local gpus
    # shellcheck disable=SC2207  # word-splitting the flag list is the point
    gpus=($(gpu_device_flags))
    docker run --detach --pull=always --name receive-datapath-manager --privileged \
      --cap-add=NET_ADMIN --network=host "${gpus[@]}" \
      --volume /var/lib/nvidia/lib64:/usr/local/nvidia/lib64 \
      --env LD_LIBRARY_PATH=/usr/local/nvidia/lib64 \
      --volume /run/tcpx:/run/tcpx \
      --entrypoint /tcpgpudmarxd/build/app/tcpgpudmarxd \
      "$TCPX_RXDM_IMAGE" \
      --gpu_nic_preset a3vm --gpu_shmem_type fd --uds_path /run/tcpx --setup_param "--verbose 128 2 0"
  fi
  NCCL_VERSION=$(nccl_version /var/lib/tcpx/lib64)
  PLUGIN_VERSION="gpudirecttcpx-${TCPX_PLUGIN_IMAGE##*:}+rxdm-${TCPX_RXDM_IMAGE##*:}"
}
