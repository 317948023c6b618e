# One NIC and no GPUDirect (a3-highgpu-1g/2g/4g): NCCL over plain sockets on the host NIC; the
# libnccl2 package that build_nccl_tests installs is the NCCL that runs.
net_stack_setup() {
  PLUGIN_VERSION=none
}
