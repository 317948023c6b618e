#!/bin/bash
# gpufleet controller startup script: the controller VM of cluster @@CLUSTER@@.
# Rendered by infra/startup.py from infra/templates/; do not edit on the VM.
# GCE runs it at every boot, so every step checks before it acts and re-running it is safe.
# It makes a virtual environment with the Compute Engine client (which restarting stopped nodes
# needs): with a source, the launcher itself from there (it brings the client); without one, the
# client alone, and the launcher ships its own code to this VM at first use. It writes the ready
# marker, then starts again the controllers of the detached jobs this VM's last boot left running.
set -Eeuo pipefail  # -E: the ERR trap also fires inside functions

readonly CLUSTER=@@CLUSTER@@
# Empty: no gpufleet:controllerSource.
readonly SOURCE=@@SOURCE@@
# What pip installs: "gpufleet @ SOURCE", or the Compute Engine client alone.
readonly REQUIREMENT=@@REQUIREMENT@@
# What must import once it is installed.
readonly IMPORTS=@@IMPORTS@@
readonly VENV=@@VENV@@
readonly LAUNCH_LINK=@@LAUNCH_LINK@@
readonly READY_MARKER=@@READY_MARKER@@
readonly STATE_DIR=/var/lib/gpufleet
readonly ERROR_FILE="$STATE_DIR/startup-error.txt"
# What the venv was last installed with: a boot with the same requirement installs nothing.
readonly INSTALLED_FROM="$STATE_DIR/controller-source.txt"

@@COMMON@@

prepare() {
  mkdir -p "$STATE_DIR"
  # A marker or error left by the previous boot must not describe this one.
  rm -f "$READY_MARKER" "$READY_MARKER.tmp" "$ERROR_FILE"
}

# Whether the venv's python imports what the requirement brings.
venv_works() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import $IMPORTS" 2>/dev/null
}

install_venv() {
  if [[ "$(cat "$INSTALLED_FROM" 2>/dev/null)" == "$REQUIREMENT" ]] && venv_works; then
    log "already installed: $REQUIREMENT"
    return 0
  fi
  # python3-venv for the venv (Ubuntu ships python3 without it); git for a git+https source.
  local packages=(python3-venv ca-certificates)
  [[ "$SOURCE" != git+* ]] || packages+=(git)
  apt_install "${packages[@]}"
  if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
  fi
  if [[ -z "$SOURCE" && -e "$VENV/bin/launch" ]]; then
    # The source was dropped from the config: a launcher left installed here must not shadow the
    # one the client ships.
    "$VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check --yes gpufleet
  fi
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$REQUIREMENT"
  if ! venv_works; then
    log "$REQUIREMENT does not import ($IMPORTS)"
    return 1
  fi
  printf '%s\n' "$REQUIREMENT" >"$INSTALLED_FROM"
  log "installed: $REQUIREMENT"
}

# `launch` on the PATH when the venv holds the launcher; no stale link when it does not.
link_launch() {
  local target
  target=$(readlink "$LAUNCH_LINK" 2>/dev/null || true)
  if [[ -z "$SOURCE" ]]; then
    [[ "$target" != "$VENV/bin/launch" ]] || rm -f "$LAUNCH_LINK"  # ours only, never a user's own
  elif [[ "$target" != "$VENV/bin/launch" ]]; then
    mkdir -p "$(dirname "$LAUNCH_LINK")"
    ln -sfn "$VENV/bin/launch" "$LAUNCH_LINK"
  fi
}

version_of() {
  "$VENV/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null \
    || echo unknown
}

# A JSON string, or null for an empty value.
json_or_null() { if [[ -n "$1" ]]; then printf '"%s"' "$(json_str "$1")"; else printf null; fi; }

write_ready_marker() {
  local tmp="$READY_MARKER.tmp" gpufleet=""
  [[ -z "$SOURCE" ]] || gpufleet=$(version_of gpufleet)
  printf '{"cluster": "%s", "controller": "%s", "source": %s, "gpufleet": %s, "google_cloud_compute": "%s", "booted_at": "%s"}\n' \
    "$(json_str "$CLUSTER")" "$(json_str "$(hostname)")" "$(json_or_null "$SOURCE")" "$(json_or_null "$gpufleet")" \
    "$(json_str "$(version_of google-cloud-compute)")" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$tmp"
  mv -f "$tmp" "$READY_MARKER"
  log "ready: $READY_MARKER"
}

# Detached jobs whose controller died with this VM (a reboot, a stop and a start): start each one's
# controller again, as the job's owner, from the start line its hand-off left (controller.sh in
# the job's directory). It re-adopts the job's nodes, or ends the job FAILED when their
# --controller-grace ran out; a job that has a live controller, or has ended, is left alone by it.
adopt_jobs() {
  local dir owner home
  for dir in /root/.gpufleet/jobs/*/ /home/*/.gpufleet/jobs/*/; do
    [[ -f "$dir/controller.sh" && -f "$dir/state.json" ]] || continue
    grep -Eq '"state": "(PENDING|RUNNING|RECOVERING)"' "$dir/state.json" || continue
    owner=$(stat -c %U "$dir")
    home=${dir%/.gpufleet/jobs/*}
    if runuser -u "$owner" -- env HOME="$home" bash "$dir/controller.sh" >/dev/null; then
      log "started the controller of job $(basename "$dir") ($owner) again"
    else
      log "could not start the controller of job $(basename "$dir") ($owner)"
    fi
  done
}

main() {
  prepare
  install_venv
  link_launch
  write_ready_marker
  adopt_jobs
}

main "$@"
