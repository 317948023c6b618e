# A3 Ultra / A4: GPUDirect RDMA over the 8 CX-7 NICs with Google's gIB NCCL plugin, installed as
# the nccl-gib apt package into /usr/local/gib (github.com/GoogleCloudPlatform/cluster-toolkit examples/machine-learning/
# a4-highgpu-8g/a4high-vm.yaml, a3-ultragpu-8g/a3ultra-slurm-blueprint.yaml).
readonly GIB_DIR=/usr/local/gib
readonly RDMA_NIC_COUNT=@@RDMA_NIC_COUNT@@

wait_for_rdma_nics() {
  local i n
  for ((i = 0; i < 90; i++)); do
    n=$(find /sys/class/infiniband -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
    ((n >= RDMA_NIC_COUNT)) && return 0
    sleep 2
  done
  log "found $n of $RDMA_NIC_COUNT RDMA devices under /sys/class/infiniband after 180 s"
  return 1
}

net_stack_setup() {
  wait_for_rdma_nics
  apt_install ibverbs-utils
  # Google's Artifact Registry apt repo, signed by the Artifact Registry key (pinned), not [trusted=yes].
  ensure_artifact_registry_apt
  apt_source /etc/apt/sources.list.d/gpudirect-gib.list \
    "deb [signed-by=$AR_KEYRING] ar+https://us-apt.pkg.dev/projects/gce-ai-infra gpudirect-gib-apt main"
  apt_install nccl-gib
  local ldconf=/etc/ld.so.conf.d/000_nccl-gib.conf
  if [[ "$(cat "$ldconf" 2>/dev/null)" != "$GIB_DIR/lib64" ]]; then
    echo "$GIB_DIR/lib64" >"$ldconf"
    ldconfig
  fi
  local profile=/etc/profile.d/nccl-gib.sh
  if [[ ! -f "$profile" ]]; then
    printf '%s\n' "source $GIB_DIR/scripts/set_nccl_env.sh" >"$profile"
  fi
  NCCL_VERSION=$(nccl_version "$GIB_DIR/lib64")
  PLUGIN_VERSION="gib-$(dpkg-query -W -f='${Version}' nccl-gib)"
}
