#!/usr/bin/env bash
# Debian packages the optional engines need (idempotent, non-interactive, run as root).
#
#   mooncake-transfer-engine: engine.so links libibverbs.so.1 + libmlx5.so.1 (RDMA verbs,
#     loaded even for TCP), libcuda.so.1 (Debian non-free; its nvidia-support dependency
#     is in contrib, so both components are enabled), libnuma.so.1 and
#     libcurl.so.4. libcudart.so.12 comes from the nvidia-cuda-runtime-cu12 wheel and is
#     preloaded by kvhandoff.transport.mooncake, so no LD_LIBRARY_PATH is needed.
#   nixl-cu12: self-contained (bundled UCX); nothing from apt.
#
# Usage: sudo scripts/system-deps.sh    (or: make system-deps)
set -euo pipefail

PKGS=(libibverbs1 ibverbs-providers libnuma1 libcurl4 libcuda1)

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then exec sudo -n "$0" "$@"; fi
    echo "system-deps.sh: must run as root (or with passwordless sudo)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps.sh: apt-get not found; this script supports Debian only." >&2
    echo "  needed: libibverbs.so.1, libmlx5.so.1, libcuda.so.1, libnuma.so.1, libcurl.so.4" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive

# A host with an NVIDIA driver already provides libcuda.so.1 (matching its kernel
# module); Debian's libcuda1 would conflict with it, so only install it where none is.
if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' \
        && ! dpkg-query -W -f='${Status}' libcuda1 2>/dev/null | grep -q "install ok installed"; then
    PKGS=("${PKGS[@]/libcuda1}")
fi

# Already satisfied? (every package installed) -> nothing to do.
missing=()
for p in ${PKGS[@]}; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "system-deps: all present (${PKGS[*]})"
    exit 0
fi

# libcuda1 lives in Debian's non-free component and depends on nvidia-support (contrib):
# enable both for the debian.org entries, in whichever sources format is present.
add_component() {  # $1 = component name
    local c="$1" f
    # deb822 format (Debian 12 default): /etc/apt/sources.list.d/*.sources
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        grep -qE '^URIs:.*debian\.org/debian' "$f" || continue
        sed -i -E "/^Components:/{/[[:space:]]$c([[:space:]]|\$)/!s/\$/ $c/}" "$f"
    done
    # one-line format: /etc/apt/sources.list and *.list
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        sed -i -E "/^deb[[:space:]].*debian\.org\/debian/{/[[:space:]]$c([[:space:]]|\$)/!s/\$/ $c/}" "$f"
    done
}
add_component contrib
add_component non-free

apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "system-deps: installed ${missing[*]}"
