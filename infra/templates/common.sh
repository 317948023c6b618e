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

# The primary-key fingerprints in a keyring (or a key file), one a line; none for a missing one.
key_fingerprints() {
  [[ -s "$1" ]] || return 0
  { gpg --batch --show-keys --with-colons "$1" 2>/dev/null || true; } \
    | awk -F: '$1 == "pub" { want = 1; next } $1 == "fpr" && want { print $10 } { want = 0 }'
}

# A keyring at KEYRING holding only the pinned keys of the vendor's key file at URL (infra/pins.py),
# for an apt source `signed-by=KEYRING`: apt then trusts that repository's signature by those keys
# and nothing else. A download that holds none of them stops the script; a keyring already holding
# only pinned keys is kept.
pinned_keyring() {
  local keyring=$1 url=$2
  shift 2
  local have fpr home found=()
  have=$(key_fingerprints "$keyring")
  if [[ -n "$have" ]] && ! grep -qvxF -f <(printf '%s\n' "$@") <<<"$have"; then
    return 0
  fi
  home=$(mktemp -d)
  curl -fsSL -o "$home/key" "$url"
  gpg --batch --quiet --homedir "$home" --import "$home/key" 2>/dev/null || true
  for fpr in "$@"; do
    if gpg --batch --homedir "$home" --list-keys "$fpr" >/dev/null 2>&1; then
      found+=("$fpr")
    fi
  done
  if ((${#found[@]} == 0)); then
    rm -rf "$home"
    log "$url holds none of the pinned keys ($*): not trusting it; see infra/pins.py"
    return 1
  fi
  mkdir -p "$(dirname "$keyring")"
  gpg --batch --homedir "$home" --export "${found[@]}" >"$keyring.tmp"
  mv -f "$keyring.tmp" "$keyring"
  chmod 0644 "$keyring"
  rm -rf "$home"
}

# An apt source file with exactly LINE in it; apt-get update when it changed.
apt_source() {
  local file=$1 line=$2
  if [[ "$(cat "$file" 2>/dev/null)" != "$line" ]]; then
    printf '%s\n' "$line" >"$file"
    apt-get update -qq
  fi
}
