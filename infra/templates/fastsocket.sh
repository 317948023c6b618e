# A2: NCCL Fast Socket, Google's Debian package (github.com/google/nccl-fastsocket README.md and
# BUILD: apt source google-fast-socket, package google-fast-socket, installs /usr/lib/libnccl-net.so
# which NCCL loads as its net plugin).
net_stack_setup() {
  if [[ "$IMAGE_OS" != ubuntu ]]; then
    log "Fast Socket is packaged for Debian/Ubuntu only; NCCL uses plain sockets on $IMAGE_OS"
    return 0
  fi
  # Signed by packages.cloud.google.com's pinned keys (infra/pins.py GOOGLE_CLOUD_APT_KEY).
  local keyring=/usr/share/keyrings/gpufleet-google-cloud.gpg
  apt_install gnupg
  pinned_keyring "$keyring" @@GOOGLE_APT_KEY_URL@@ @@GOOGLE_APT_KEY_FPRS@@
  apt_source /etc/apt/sources.list.d/google-fast-socket.list \
    "deb [signed-by=$keyring] https://packages.cloud.google.com/apt google-fast-socket main"
  apt_install google-fast-socket
  PLUGIN_VERSION="fastsocket-$(dpkg-query -W -f='${Version}' google-fast-socket)"
}
