#!/usr/bin/env bash
# The CUDA paths, on a machine with an NVIDIA GPU and a CUDA build of torch (make gpu-check):
# pinned host staging (vLLM's GPU cache over tcp/shm) on its three copy paths (blocks: one
# copy per run of blocks; packed: gathered on the GPU, one contiguous copy; mapped: the GPU
# writes the pinned mirror itself), byte-exact against a per-block oracle (hypothesis);
# staged and NIXL device-to-device handoffs through the real session; GPU memory through
# the engines' transports; then the GPU staging benchmark (each path against one
# contiguous copy of the same bytes; goal <= 1.5x). Everywhere else these tests are
# skipped, naming why.
#   PYTHON    the interpreter (default: python3)
#   OUT       where the benchmark's JSON and plot go (default: .)
#   WHEELS    a folder of wheels to install first, without an index (for hosts offline)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-.}
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvh-gpu-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/kvh-gpu-site:${PYTHONPATH:-}
  rt=/tmp/kvh-gpu-site/nvidia/cuda_runtime/lib  # CUDA 12's runtime, for UCX (nixl)
  [ -d "$rt" ] && export LD_LIBRARY_PATH=$rt:${LD_LIBRARY_PATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; \
print('torch', torch.__version__, 'on', torch.cuda.get_device_name())" || exit 1
"$PY" -c "import pytest, hypothesis" \
  || { echo "gpu-check needs pytest and hypothesis in $PY (pip install pytest hypothesis)"; exit 1; }
"$PY" -c "from kvhandoff.lab.cli import main; main(['transports'])" || true
# One process per file: on the H100, torch's CUDA copies failed in a process where a
# NIXL agent had loaded UCX's CUDA modules with CUDA 12's runtime beside torch's CUDA 13.
rc=0
for f in tests/unit/test_vllm_host_staging.py tests/e2e/test_vllm_worker.py \
         tests/conformance/test_cuda_memory.py; do
  "$PY" -m pytest -q -p no:cacheprovider -rs "$f" "$@" || rc=1
done
"$PY" benchmarks/cuda_staging.py --json "$OUT/cuda_staging.json" --plot "$OUT/cuda_staging.png" \
  || rc=1
exit $rc
