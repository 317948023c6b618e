#!/usr/bin/env bash
# Builds the tests' Python image from this machine's own files, no registry or network needed:
# a root filesystem of hard links (cp -al; copies where another filesystem) holding the
# interpreter that runs the venv (its standard library, without its test suite and its own
# site-packages), the venv's torch and numpy (what a stock PyTorch image holds and gpufleet's
# workloads import) and torch's pure-Python dependencies in that interpreter's site-packages, the shared libraries they link, and dash as /bin/sh; then
# `podman import` of it as IMAGE (a tar stream on stdin, nothing written but the image).
#   build_image.sh VENV IMAGE
set -euo pipefail
venv=$1 image=$2
py=$(readlink -f "$venv/bin/python")
prefix=$("$py" -c 'import sys; print(sys.base_prefix)')
ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stage=$(mktemp -d /tmp/gpufleet-image-XXXXXX)
trap 'rm -rf "$stage"' EXIT
link() { mkdir -p "$stage$(dirname "$2")"; cp -al "$1" "$stage$2" 2>/dev/null || cp -a "$1" "$stage$2"; }
link "$prefix/bin" "$prefix/bin"
mkdir -p "$stage$prefix/lib/python$ver"
for f in "$prefix"/lib/libpython*; do link "$f" "$f"; done
for f in "$prefix/lib/python$ver"/*; do
  case ${f##*/} in test | site-packages | idlelib | tkinter | turtledemo | ensurepip) continue ;; esac
  link "$f" "$f"
done
dst="$prefix/lib/python$ver/site-packages"
mkdir -p "$stage$dst"
for p in torch torchgen functorch numpy numpy.libs sympy mpmath networkx filelock fsspec jinja2 markupsafe typing_extensions.py; do
  [ -e "$site/$p" ] && link "$site/$p" "$dst/$p"
done
for d in "$site"/*.dist-info; do
  case ${d##*/} in torch-* | numpy-* | sympy-* | mpmath-* | networkx-* | filelock-* | fsspec-* | jinja2-* | markupsafe-* | typing_extensions-*) link "$d" "$dst/${d##*/}" ;; esac
done
rm -rf "$stage$dst/torch/include"
mkdir -p "$stage/usr/local/bin" "$stage/bin" "$stage/tmp" "$stage/etc"
chmod 1777 "$stage/tmp"
ln -s "$prefix/bin/python$ver" "$stage/usr/local/bin/python3"
ln -s "$prefix/bin/python$ver" "$stage/usr/local/bin/python"
for b in /bin/dash /bin/sleep /bin/cat; do link "$b" "$b"; done
ln -s dash "$stage/bin/sh"
echo "root:x:0:0:root:/root:/bin/sh" >"$stage/etc/passwd"
# The shared libraries every binary and extension module here links against, from this machine.
libs=$(find "$stage" -type f \( -name '*.so*' -o -perm -u+x \) -print0 | { xargs -0 ldd 2>/dev/null || true; } |
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/lib/ {print $1}' | grep -v "^$stage" | sort -u)
for lib in $libs; do
  [ -e "$stage$lib" ] || { mkdir -p "$stage$(dirname "$lib")"; cp -L "$lib" "$stage$lib"; }
done
tar -C "$stage" -c . | podman import --change "ENV=PATH=/usr/local/bin:/usr/bin:/bin" - "$image" >/dev/null
