#!/usr/bin/env bash
# The system packages `make test` needs, installed from one place (`make sysdeps`; .ci/run and
# `make test` both go through it). The simulated cluster runs real sshd nodes in network
# namespaces (openssh-server, iproute2: ip netns, veth, tc); the startup-script tests lint with
# the shellcheck package; bench_launcher compares with pdsh; the clock-skew tests use libfaketime; the
# fault tests read process tables with procps; doctor and hosts ask the (simulated) metadata server
# with curl, as they do on a real node; the --image tests run podman with runc (crun refuses cgroups
# in hybrid mode on some kernels) and pull from Debian's docker-registry, the distribution registry.
#   As root: installs what is missing with apt-get.
#   Otherwise: prints the one apt-get command to run and exits 2, before anything runs.
# GPUFLEET_SYSDEPS overrides the list (the tests use it to ask for a package that is missing).
set -euo pipefail

read -r -a packages <<<"${GPUFLEET_SYSDEPS:-openssh-server openssh-client iproute2 shellcheck pdsh procps libfaketime curl podman runc docker-registry}"

if ! command -v dpkg >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    echo "sysdeps: this is not a Debian/Ubuntu system (no dpkg/apt-get); install by hand: ${packages[*]}" >&2
    exit 2
fi

missing=()
for pkg in "${packages[@]}"; do
    # dpkg -s alone also matches a package that was removed but whose config files remain.
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "sysdeps: missing system packages; run as root: apt-get update && apt-get install -y ${missing[*]}" >&2
    exit 2
fi
echo "sysdeps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
