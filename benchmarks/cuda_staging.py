"""GPU KV-cache paths, timed against plain torch copies of the same bytes in the same run.

    python benchmarks/cuda_staging.py [--json PATH] [--plot PATH] [--runs N]

Needs a CUDA device (``make gpu-check`` runs it after the GPU tests). Measures:

* ``to_host`` / ``to_device``: :class:`~kvhandoff.integrations.vllm.host_staging.HostStaging`
  copying N scattered blocks of a vLLM-like pool (the path a GPU cache takes over
  tcp/shm), against one contiguous pinned copy of the same number of bytes;
* ``nixl``: one NIXL write of N pages GPU → GPU (the ``cuda`` option, no mirror), against
  ``torch`` copying the same pages device to device.

Each figure is the median of ``--runs`` timed repetitions after a warm-up; ratios are
kvhandoff's time over the baseline's (1.0 = as fast as the plain copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvhandoff.integrations.vllm.host_staging import HostStaging
from kvhandoff.layout import MemoryKind, Region
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.transport import TransferState, create_transport
from kvhandoff.transport.registry import transport_class

BLOCK = 64 << 10  # bytes per block (a 16-token page of a mid-size model's layer)
POOL = 2048  # blocks in the pool: 128 MiB
COUNTS = (16, 128, 1024)


def _median_ms(fn: Callable[[], None], runs: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ids(n: int, rng: np.random.Generator) -> list[int]:
    return sorted(int(i) for i in rng.choice(POOL, n, replace=False))


def staging(runs: int) -> list[dict[str, Any]]:
    dev = torch.randint(0, 256, (POOL, BLOCK), dtype=torch.uint8, device="cuda")
    st = HostStaging({"kv": dev}, (("kv",),))
    rng = np.random.default_rng(0)
    rows = []
    for n in COUNTS:
        ids = _ids(n, rng)
        src = torch.empty(n * BLOCK, dtype=torch.uint8, device="cuda")
        dst = torch.empty(n * BLOCK, dtype=torch.uint8, pin_memory=True)
        for way in ("to_host", "to_device"):
            copy = getattr(st, way)
            ms = _median_ms(lambda c=copy, i=ids: c([i]), runs)
            a, b = (dst, src) if way == "to_host" else (src, dst)
            base = _median_ms(lambda a=a, b=b: a.copy_(b, non_blocking=True), runs)
            rows.append({"what": way, "blocks": n, "mib": n * BLOCK / 2**20, "ms": ms,
                         "baseline_ms": base, "ratio": ms / base,
                         "gib_s": n * BLOCK / 2**30 / (ms / 1e3)})
    st.close()
    return rows


def nixl(runs: int) -> list[dict[str, Any]]:
    ok, why = transport_class("nixl").usable()
    if not ok:
        print(f"nixl: skipped ({why})", file=sys.stderr)
        return []
    src = torch.randint(0, 256, (POOL, BLOCK), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    rows = []
    opts = {"cuda": True, "io_timeout": 5.0}
    with create_transport("nixl", **opts) as s, create_transport("nixl", **opts) as r:
        s.register(Region(ptr=src.data_ptr(), nbytes=src.nbytes, memory=MemoryKind.CUDA))
        r.register(Region(ptr=dst.data_ptr(), nbytes=dst.nbytes, memory=MemoryKind.CUDA))
        peer = s.connect(r.endpoint())
        rng = np.random.default_rng(1)
        for n in COUNTS:
            si, di = np.array(_ids(n, rng)), np.array(_ids(n, rng))
            plan = Plan(entries=(TensorPlan(
                component="kv", tensor="t", layer_id=0, src_ptr=src.data_ptr(),
                dst_ptr=dst.data_ptr(), src_unit=BLOCK, dst_unit=BLOCK, src_idx=si,
                dst_idx=di, pieces=np.array([[0, 0, BLOCK, 1, BLOCK, BLOCK]], np.int64)),))

            def write(p: Plan = plan) -> None:
                h = s.submit(peer, p)
                if s.wait(h, 60) is not TransferState.DONE:
                    raise RuntimeError(h.error)
                h.release()

            try:
                ms = _median_ms(write, runs)
            except RuntimeError as e:
                print(f"nixl gpu→gpu in one process: {e}; not measured", file=sys.stderr)
                break
            assert torch.equal(dst[torch.from_numpy(di).cuda()], src[torch.from_numpy(si).cuda()])
            ti, tj = torch.from_numpy(si).cuda(), torch.from_numpy(di).cuda()
            base = _median_ms(lambda a=ti, b=tj: dst.index_copy_(0, b, src[a]), runs)
            rows.append({"what": "nixl gpu→gpu", "blocks": n, "mib": n * BLOCK / 2**20,
                         "ms": ms, "baseline_ms": base, "ratio": ms / base,
                         "gib_s": n * BLOCK / 2**30 / (ms / 1e3)})
        peer.close()
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for what in dict.fromkeys(r["what"] for r in rows):
        sel = [r for r in rows if r["what"] == what]
        ax.plot([r["mib"] for r in sel], [r["gib_s"] for r in sel], marker="o", label=what)
    ax.set_xscale("log")
    ax.set_xlabel("MiB moved (scattered 64 KiB blocks)")
    ax.set_ylabel("GiB/s")
    ax.legend()
    ax.set_title(torch.cuda.get_device_name())
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="cuda_staging.json")
    ap.add_argument("--plot", default="cuda_staging.png")
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    rows = staging(args.runs) + nixl(args.runs)
    print(f"{'what':<14}{'blocks':>7}{'MiB':>8}{'ms':>9}{'torch ms':>10}{'ratio':>7}{'GiB/s':>8}")
    for r in rows:
        print(f"{r['what']:<14}{r['blocks']:>7}{r['mib']:>8.0f}{r['ms']:>9.3f}"
              f"{r['baseline_ms']:>10.3f}{r['ratio']:>7.2f}{r['gib_s']:>8.1f}")
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "runs": args.runs, "rows": rows}, f, indent=1)
    plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
