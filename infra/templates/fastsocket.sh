# A2: NCCL Fast Socket, Google's Debian package (github.com/google/nccl-fastsocket README.md and
# BUILD: apt source google-fast-socket, package google-fast-socket, installs /usr/lib/libnccl-net.so
# which NCCL loads as its net plugin).
net_stack_setup() {
  if [[ "$IMAGE_OS" != ubuntu ]]; then
    log "Fast Socket is packaged for Debian/Ubuntu only; NCCL uses plain sockets on $IMAGE_OS"
    return 0
  fi
  local keyring=/usr/share/keyrings/cloud.google.gpg list=/etc/apt/sources.list.d/google-fast-socket.list
  if [[ ! -s "$keyring" ]]; then
    curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | gpg --dearmor --yes -o "$keyring"
  fi
  if [[ ! -f "$list" ]]; then
    echo "deb [signed-by=$keyring] https://packages.cloud.google.com/apt google-fast-socket main" >"$list"
    apt-get update -qq
  fi
  apt_install google-fast-socket
  PLUGIN_VERSION="fastsocket-$(dpkg-query -W -f='${Version}' google-fast-socket)"
}
