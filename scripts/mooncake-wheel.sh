#!/bin/sh
# Which Mooncake wheel this host gets; prints `cuda` or `non-cuda`.
#
#   cuda      mooncake-transfer-engine (+ nvidia-cuda-runtime-cu12): engine.so links
#             libcuda.so.1, which only an NVIDIA driver (or Debian non-free) provides.
#   non-cuda  mooncake-transfer-engine-non-cuda: the same `mooncake` package, linking only
#             libibverbs.so.1, libnuma.so.1 and libcurl.so.4 (all in Debian main).
#
# KVHANDOFF_MOONCAKE_WHEEL=cuda|non-cuda overrides; otherwise a host with an NVIDIA GPU
# (/dev/nvidia0 or `nvidia-smi` on PATH) gets `cuda` and every other host `non-cuda`.
# Used by the Makefile (which extra goes into .venv) and scripts/system-deps.sh (which
# Debian packages), so both always agree.
case "${KVHANDOFF_MOONCAKE_WHEEL:-}" in
    cuda | non-cuda) echo "$KVHANDOFF_MOONCAKE_WHEEL" ;;
    "")
        if [ -e /dev/nvidia0 ] || command -v nvidia-smi >/dev/null 2>&1; then
            echo cuda
        else
            echo non-cuda
        fi
        ;;
    *)
        echo "KVHANDOFF_MOONCAKE_WHEEL must be 'cuda' or 'non-cuda'," \
             "not '$KVHANDOFF_MOONCAKE_WHEEL'" >&2
        exit 2
        ;;
esac
