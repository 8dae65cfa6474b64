"""GPU KV-cache paths, timed against plain torch copies of the same bytes in the same run.

    python benchmarks/cuda_staging.py [--json PATH] [--plot PATH] [--runs N] [--device cpu]

Needs a CUDA device (``make gpu-check`` runs it after the GPU tests; ``--device cpu`` is a
dry run of the same code on CPU tensors, whose figures mean nothing). Measures:

* ``to_host`` / ``to_device``: :class:`~kvhandoff.integrations.vllm.host_staging.HostStaging`
  copying N scattered blocks of a vLLM-like pool (the path a GPU cache takes over
  tcp/shm), on each staging path (``blocks``: one copy per run of blocks; ``packed``:
  gathered on the device, one contiguous copy, placed on the host; ``mapped``: the
  device writes and reads the pinned mirror itself), with the pool as one
  layer tensor and split into 8 layer tensors of the same total size; each against one
  contiguous pinned copy of the same number of bytes (the goal: at most 1.5x). After the
  timing, the mirror is checked byte-exact against the device for the moved blocks;
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

from kvhandoff.integrations.vllm.block_copy import StagingPath
from kvhandoff.integrations.vllm.host_staging import HostStaging, StagingError
from kvhandoff.layout import MemoryKind, Region
from kvhandoff.plan.model import Plan, TensorPlan
from kvhandoff.transport import TransferState, create_transport
from kvhandoff.transport.registry import transport_class

BLOCK = 64 << 10  # bytes per block (a 16-token page of a mid-size model's layer)
POOL = 2048  # blocks in the pool: 128 MiB
COUNTS = (16, 128, 1024)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn: Callable[[], None], runs: int, device: str = "cuda") -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _ids(n: int, rng: np.random.Generator) -> list[int]:
    return sorted(int(i) for i in rng.choice(POOL, n, replace=False))


def _row(what: str, n: int, ms: float, base: float, **extra: object) -> dict[str, Any]:
    return {"what": what, "blocks": n, "mib": n * BLOCK / 2**20, "ms": ms, "baseline_ms": base,
            "ratio": ms / base, "gib_s": n * BLOCK / 2**30 / (ms / 1e3), **extra}


def _exact(st: HostStaging, layers: dict[str, torch.Tensor], ids: list[int]) -> bool:
    """Both directions moved the chosen blocks byte-exact: the mirror holds the device's
    after ``to_host``; the device holds the mirror's (changed) after ``to_device``."""
    idx = torch.tensor(ids)
    st.to_host([ids])
    ok = all(torch.equal(st.mirrors[n][idx], t[idx.to(t.device)].cpu())
             for n, t in layers.items())
    for n in layers:
        st.mirrors[n][idx] = 255 - st.mirrors[n][idx]
    st.to_device([ids])
    return ok and all(torch.equal(st.mirrors[n][idx], t[idx.to(t.device)].cpu())
                      for n, t in layers.items())


def _time_path(st: HostStaging, counts: dict[int, list[int]], runs: int, device: str,
               base: dict[tuple[str, int], float], nl: int) -> list[dict[str, Any]]:
    """Both directions of ``st``'s path for each block count."""
    rows = []
    for n, ids in counts.items():
        for way in ("to_host", "to_device"):
            copy = getattr(st, way)
            ms = _median_ms(lambda c=copy, i=ids: c([i]), runs, device)
            rows.append(_row(f"{way} {st.path.value} x{nl}", n, ms, base[way, n], way=way,
                             path=st.path.value, layers=nl))
    return rows


def staging(runs: int, device: str = "cuda") -> tuple[list[dict[str, Any]], list[str]]:
    """Every staging path, one and 8 layer tensors, against one contiguous copy; also
    what went wrong (a path that could not start, bytes that differ)."""
    pin = device == "cuda"
    rng = np.random.default_rng(0)
    counts = {n: _ids(n, rng) for n in COUNTS}
    base: dict[tuple[str, int], float] = {}
    for n in COUNTS:
        src = torch.empty(n * BLOCK, dtype=torch.uint8, device=device)
        dst = torch.empty(n * BLOCK, dtype=torch.uint8, pin_memory=pin)
        for way, (a, b) in {"to_host": (dst, src), "to_device": (src, dst)}.items():
            base[way, n] = _median_ms(lambda a=a, b=b: a.copy_(b, non_blocking=True), runs,
                                      device)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for nl in (1, 8):
        layers = {f"l{i}": torch.randint(0, 256, (POOL, BLOCK // nl), dtype=torch.uint8,
                                         device=device) for i in range(nl)}
        for path in StagingPath:
            try:
                st = HostStaging(layers, (tuple(layers),), pin=pin, path=path)
            except StagingError as e:
                errors.append(f"{path.value} x{nl}: not measured ({e})")
                continue
            rows += _time_path(st, counts, runs, device, base, nl)
            errors += [f"{path.value} x{nl}: {n} blocks NOT byte-exact"
                       for n, ids in counts.items() if not _exact(st, layers, ids)]
            st.close()
    return rows, errors


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
            rows.append(_row("nixl gpu→gpu", n, ms, base))
        peer.close()
    return rows


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """One panel per direction (and one for nixl): each path's time over one contiguous
    copy of the same bytes, against the bytes moved; the dashed line is the 1.5x goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(r.get("way", r["what"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        sel = [r for r in rows if r.get("way", r["what"]) == panel]
        for what in dict.fromkeys(r["what"] for r in sel):
            line = [r for r in sel if r["what"] == what]
            ax.plot([r["mib"] for r in line], [r["ratio"] for r in line], marker="o",
                    label=what)
        ax.axhline(1.5, linestyle="--", color="grey")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("MiB moved (scattered 64 KiB blocks)")
        ax.set_ylabel("time / one contiguous copy")
        ax.set_title(f"{panel} ({title})")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)


def summary(rows: list[dict[str, Any]]) -> str:
    """The worst ratio of each staging path over every size, direction and layer count."""
    worst = {p.value: max((r["ratio"] for r in rows if r.get("path") == p.value), default=0.0)
             for p in StagingPath}
    return ("staging vs one contiguous copy, worst case (goal <= 1.5x): "
            + "; ".join(f"{p} {w:.2f}x" for p, w in worst.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="cuda_staging.json")
    ap.add_argument("--plot", default="cuda_staging.png")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the same code (its figures mean nothing)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    rows, errors = staging(args.runs, args.device)
    rows += nixl(args.runs) if args.device == "cuda" else []
    title = torch.cuda.get_device_name() if args.device == "cuda" else "cpu dry run"
    print(f"{'what':<22}{'blocks':>7}{'MiB':>8}{'ms':>9}{'torch ms':>10}{'ratio':>7}"
          f"{'GiB/s':>8}")
    for r in rows:
        print(f"{r['what']:<22}{r['blocks']:>7}{r['mib']:>8.0f}{r['ms']:>9.3f}"
              f"{r['baseline_ms']:>10.3f}{r['ratio']:>7.2f}{r['gib_s']:>8.1f}")
    print(summary(rows))
    for e in errors:
        print(e, file=sys.stderr)
    with open(args.json, "w") as f:
        json.dump({"device": title, "torch": torch.__version__, "runs": args.runs,
                   "rows": rows, "errors": errors}, f, indent=1)
    plot(rows, args.plot, title)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
