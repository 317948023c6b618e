# A3 High / Edge: GPUDirect-TCPX. Google's VM sequence (https://cloud.google.com/compute/docs/gpus/
# gpudirect, as skypilot sky/provision/gcp/constants.py GPU_DIRECT_TCPX_USER_DATA and dstack run
# it): the receive-datapath manager (RxDM) container, an iptables accept
# rule on the GPU NICs, the NCCL plugin installer (which also installs its NCCL into /var/lib/tcpx/lib64).
# Images: infra/pins.py (TCPX_PLUGIN, TCPX_RXDM).
readonly TCPX_PLUGIN_IMAGE=@@TCPX_PLUGIN_IMAGE@@
readonly TCPX_RXDM_IMAGE=@@TCPX_RXDM_IMAGE@@
readonly RXDM_CONTAINER=@@RXDM_CONTAINER@@
readonly RXDM_SOCKET_DIR=@@RXDM_SOCKET_DIR@@


gpu_device_flags() {
  local i
  for ((i = 0; i < GPU_COUNT; i++)); do
    printf -- '--device=/dev/nvidia%d ' "$i"
  done
  printf -- '--device=/dev/nvidia-uvm --device=/dev/nvidiactl'
}

net_stack_setup() {
  ensure_docker_gpus
  accept_tcp_on_gpu_nics
  # github.com/GoogleCloudPlatform/container-engine-accelerators gpudirect-tcpx/optmem-max-ds.yaml
  # sets this for TCPX.
  sysctl -q -w net.core.optmem_max=131072
  if [[ ! -e /var/lib/tcpx/lib64/libnccl-net.so ]]; then
    ensure_image "$TCPX_PLUGIN_IMAGE"
    docker run --rm --network=host -v /var/lib:/var/lib "$TCPX_PLUGIN_IMAGE" install --install-nccl
  fi
  exec_mount /var/lib/tcpx
  # RxDM: the container RXDM_CONTAINER, its socket in RXDM_SOCKET_DIR (what the launcher checks).
  if [[ -z "$(docker ps -q -f "name=^${RXDM_CONTAINER}\$")" ]]; then
    docker rm -f "$RXDM_CONTAINER" >/dev/null 2>&1 || true
    ensure_image "$TCPX_RXDM_IMAGE"
    mkdir -p "$RXDM_SOCKET_DIR"
    local gpus
    # shellcheck disable=SC2207  # word-splitting the flag list is the point
    gpus=($(gpu_device_flags))
    docker run --detach --name "$RXDM_CONTAINER" --privileged \
      --cap-add=NET_ADMIN --network=host "${gpus[@]}" \
      --volume /var/lib/nvidia/lib64:/usr/local/nvidia/lib64 \
      --env LD_LIBRARY_PATH=/usr/local/nvidia/lib64 \
      --volume "$RXDM_SOCKET_DIR:$RXDM_SOCKET_DIR" \
      --entrypoint /tcpgpudmarxd/build/app/tcpgpudmarxd \
      "$TCPX_RXDM_IMAGE" \
      --gpu_nic_preset a3vm --gpu_shmem_type fd --uds_path "$RXDM_SOCKET_DIR" --setup_param "--verbose 128 2 0"
  fi
  NCCL_VERSION=$(nccl_version /var/lib/tcpx/lib64)
  PLUGIN_VERSION="gpudirecttcpx-@@TCPX_PLUGIN_TAG@@+rxdm-@@TCPX_RXDM_TAG@@"
}
