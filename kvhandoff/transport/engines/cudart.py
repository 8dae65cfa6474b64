"""CUDA 12's runtime (``libcudart.so.12``), loaded process-wide for the engines whose
bundled libraries link it: Mooncake's CUDA wheel (``engine.so``) and the CUDA modules of
the UCX inside ``nixl-cu12`` (``libucm_cuda``, ``libuct_cuda``), which UCX opens at
start-up. When that fails, UCX runs without CUDA and sees GPU memory as host memory:
NIXL then refuses to register VRAM. Hosts whose CUDA is another major version (a torch
built for CUDA 13, say) get the runtime from the ``nvidia-cuda-runtime-cu12`` wheel.

Loading it with ``RTLD_GLOBAL`` first makes the dynamic linker reuse it when those
libraries ask for the same soname later."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

SONAME = "libcudart.so.12"
HINT = "pip install nvidia-cuda-runtime-cu12"


def preload_cudart() -> str | None:
    """Load ``libcudart.so.12`` globally: the system's if the linker finds one, else the
    ``nvidia-cuda-runtime-cu12`` wheel's. Returns None, or why it could not."""
    try:
        ctypes.CDLL(SONAME, mode=ctypes.RTLD_GLOBAL)
        return None
    except OSError:
        pass
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        spec = None
    for d in list(spec.submodule_search_locations or []) if spec is not None else []:
        lib = Path(d) / "lib" / SONAME
        if lib.exists():
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                return None
            except OSError as e:
                return f"cannot load {lib}: {e}"
    return f"{SONAME} not found ({HINT})"
