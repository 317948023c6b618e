#!/bin/bash
# gpufleet controller startup script: the controller VM of cluster @@CLUSTER@@.
# Rendered by infra/startup.py from infra/templates/; do not edit on the VM.
# GCE runs it at every boot, so every step checks before it acts and re-running it is safe.
# It installs the launcher (and google-cloud-compute, which restarting stopped nodes needs) into
# a virtual environment and writes the ready marker last: the controller is usable once it exists.
set -Eeuo pipefail  # -E: the ERR trap also fires inside functions

readonly CLUSTER=@@CLUSTER@@
readonly SOURCE=@@SOURCE@@
readonly VENV=@@VENV@@
readonly LAUNCH_LINK=@@LAUNCH_LINK@@
readonly READY_MARKER=@@READY_MARKER@@
readonly STATE_DIR=/var/lib/gpufleet
readonly ERROR_FILE="$STATE_DIR/startup-error.txt"
# What the venv was last installed from: a boot with the same source installs nothing.
readonly INSTALLED_FROM="$STATE_DIR/controller-source.txt"

@@COMMON@@

prepare() {
  mkdir -p "$STATE_DIR"
  # A marker or error left by the previous boot must not describe this one.
  rm -f "$READY_MARKER" "$READY_MARKER.tmp" "$ERROR_FILE"
}

# Whether the venv holds the launcher and the Compute Engine client it restarts nodes with.
launcher_works() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import launcher.cli, google.cloud.compute_v1' 2>/dev/null
}

install_launcher() {
  if [[ "$(cat "$INSTALLED_FROM" 2>/dev/null)" == "$SOURCE" ]] && launcher_works; then
    log "launcher already installed from $SOURCE"
    return 0
  fi
  # git for a git+https source; python3-venv for the venv (Ubuntu ships python3 without it).
  apt_install python3-venv git ca-certificates
  if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
  fi
  # google-cloud-compute is one of gpufleet's own dependencies (pyproject.toml).
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "gpufleet @ $SOURCE"
  if ! launcher_works; then
    log "the launcher from $SOURCE does not import (launcher.cli, google.cloud.compute_v1)"
    return 1
  fi
  printf '%s\n' "$SOURCE" >"$INSTALLED_FROM"
  log "launcher installed from $SOURCE"
}

link_launch() {
  if [[ "$(readlink "$LAUNCH_LINK" 2>/dev/null)" != "$VENV/bin/launch" ]]; then
    mkdir -p "$(dirname "$LAUNCH_LINK")"
    ln -sfn "$VENV/bin/launch" "$LAUNCH_LINK"
  fi
}

version_of() {
  "$VENV/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null \
    || echo unknown
}

write_ready_marker() {
  local tmp="$READY_MARKER.tmp"
  printf '{"cluster": "%s", "controller": "%s", "source": "%s", "gpufleet": "%s", "google_cloud_compute": "%s", "booted_at": "%s"}\n' \
    "$(json_str "$CLUSTER")" "$(json_str "$(hostname)")" "$(json_str "$SOURCE")" \
    "$(json_str "$(version_of gpufleet)")" "$(json_str "$(version_of google-cloud-compute)")" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$tmp"
  mv -f "$tmp" "$READY_MARKER"
  log "ready: $READY_MARKER"
}

main() {
  prepare
  install_launcher
  link_launch
  write_ready_marker
}

main "$@"
