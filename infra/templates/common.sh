# Helpers every gpufleet startup script shares (rendered into base.sh and controller.sh by
# infra/startup.py). The script defines ERROR_FILE before it runs any of them.

log() { echo "gpufleet-startup: $*" >&2; }

on_error() {
  local line=$1 cmd=$2
  # Tolerated failures inside $(...) or <(...) also trip the inherited trap; the main shell
  # reports the ones that matter.
  ((BASH_SUBSHELL == 0)) || return 0
  log "failed at line $line: $cmd"
  printf 'line %s: %s\n' "$line" "$cmd" >"$ERROR_FILE" || true
}
trap 'on_error "$LINENO" "$BASH_COMMAND"' ERR

json_str() { printf '%s' "$1" | tr -d '"\\\n\r'; }

# An apt install that is a no-op when every package is already there.
apt_install() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]} == 0)) && return 0
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}"
}
