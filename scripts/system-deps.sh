#!/usr/bin/env bash
# Debian packages the optional engines need (idempotent, non-interactive, run as root).
#
# Mooncake: which wheel this host gets is scripts/mooncake-wheel.sh's answer (the Makefile
# installs the same one; KVHANDOFF_MOONCAKE_WHEEL=cuda|non-cuda overrides both).
#   non-cuda (no NVIDIA GPU): mooncake-transfer-engine-non-cuda's engine.so links only
#     libibverbs.so.1 (libibverbs1, loaded even for TCP), libnuma.so.1 (libnuma1) and
#     libcurl.so.4 (libcurl4; libcurl4t64 on Debian 13): all in Debian main. No RDMA
#     provider (ibverbs-providers) is needed to load it or to run it over TCP.
#   cuda (NVIDIA GPU): mooncake-transfer-engine's engine.so also links libmlx5.so.1
#     (ibverbs-providers) and libcuda.so.1, which the NVIDIA driver provides; only where no
#     driver is installed does this script install Debian's libcuda1, which is in non-free
#     and depends on nvidia-support (contrib), so then both components are enabled.
#     libcudart.so.12 comes from the nvidia-cuda-runtime-cu12 wheel and is preloaded by
#     kvhandoff.transport.engines.mooncake, so no LD_LIBRARY_PATH is needed.
#   Apt sources are only ever changed on that last path.
# NIXL (nixl-cu12): self-contained (bundled UCX); nothing from apt.
#
# Usage: sudo scripts/system-deps.sh    (or: make system-deps)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
wheel="$(sh "$here/mooncake-wheel.sh")"

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        exec sudo -n env KVHANDOFF_MOONCAKE_WHEEL="$wheel" "$here/$(basename "$0")" "$@"
    fi
    echo "system-deps.sh: must run as root (or with passwordless sudo)" >&2
    exit 1
fi

# One entry per library; "a|b": either package provides it (the first one apt knows is
# installed when neither is).
if [ "$wheel" = cuda ]; then
    WANT=(libibverbs1 ibverbs-providers libnuma1 "libcurl4t64|libcurl4" libcuda1)
    # A host with an NVIDIA driver already provides libcuda.so.1 (matching its kernel
    # module); Debian's libcuda1 would conflict with it, so only install it where none is.
    if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' \
            && ! dpkg-query -W -f='${Status}' libcuda1 2>/dev/null \
                | grep -q "install ok installed"; then
        WANT=(libibverbs1 ibverbs-providers libnuma1 "libcurl4t64|libcurl4")
    fi
else
    WANT=(libibverbs1 libnuma1 "libcurl4t64|libcurl4")
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps.sh: apt-get not found; this script supports Debian only." >&2
    echo "  needed ($wheel Mooncake wheel): libibverbs.so.1, libnuma.so.1, libcurl.so.4" >&2
    [ "$wheel" = cuda ] && echo "  and libmlx5.so.1, libcuda.so.1 (NVIDIA driver)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive

installed() {  # $1 = package
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

# Already satisfied? (one package of every entry installed) -> nothing to do.
missing=()
for entry in "${WANT[@]}"; do
    IFS='|' read -r -a alts <<<"$entry"
    ok=0
    for p in "${alts[@]}"; do
        if installed "$p"; then ok=1; break; fi
    done
    [ "$ok" -eq 1 ] || missing+=("$entry")
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "system-deps: all present for the $wheel Mooncake wheel (${WANT[*]})"
    exit 0
fi

# libcuda1 lives in Debian's non-free component and depends on nvidia-support (contrib):
# enable both for the debian.org entries, in whichever sources format is present. Only
# for the CUDA wheel on a host without an NVIDIA driver (see above).
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
for entry in "${missing[@]}"; do
    if [ "$entry" = libcuda1 ]; then
        add_component contrib
        add_component non-free
    fi
done

apt-get update -qq

# Resolve "a|b" entries to the first package apt has a candidate for (Debian 13 renamed
# libcurl4 to libcurl4t64; Debian 12 has only libcurl4).
pkgs=()
for entry in "${missing[@]}"; do
    IFS='|' read -r -a alts <<<"$entry"
    pick="${alts[-1]}"
    for p in "${alts[@]}"; do
        if apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [^(]'; then
            pick="$p"
            break
        fi
    done
    pkgs+=("$pick")
done

apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
echo "system-deps: installed ${pkgs[*]} (for the $wheel Mooncake wheel)"
