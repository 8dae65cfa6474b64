"""``kvhandoff demo``: prefill and decode as separate processes, checked against colocated.

The parent starts a bootstrap server and two spawned engine processes
(:mod:`kvhandoff.lab.demo_worker`): a prefill instance at TP ``--prefill-tp`` and a decode
instance at TP ``--decode-tp``, each rank an agent of the session layer over a real
transport (``auto`` by default: cma between these processes on one host). For every
prompt, decode admits it (prefix cache, destinations), prefill runs it chunk by chunk
and sends as it goes, decode rebuilds the cache from its pools and decodes
``--max-new-tokens`` greedily. The prefill process then decodes the same prompt
*colocated* (plain HF, its own cache, same chunks). A request passes when the tokens
are equal and decode's cache equals prefill's (per-tensor digests). The prompts cover:
shorter than a page multiple, page-aligned, several chunks and longer than the sliding
window, and a decode prefix-cache hit. After the
last request both workers report their pools: the run passes only when every page, SWA
page and slot is free again (a leak fails it and names the pool).

``kvhandoff demo --layout-only`` runs the older layouts-only check
(:mod:`kvhandoff.lab.layout_demo`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvhandoff.lab.demo_worker import (
    LEAKS,
    Decoded,
    Failed,
    Leaks,
    Prefilled,
    Ready,
    WorkerSpec,
    decode_main,
    prefill_main,
    prompt_plan,
)
from kvhandoff.observe.trace import ENV as TRACE_ENV
from kvhandoff.observe.trace import read as read_trace
from kvhandoff.plan.format import human_size

if TYPE_CHECKING:
    from kvhandoff.bootstrap.server import BootstrapServer

DEFAULT_MODEL = "qwen3_next"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0


class DemoError(RuntimeError):
    """A worker failed or stopped answering."""


@dataclass(frozen=True, slots=True)
class Row:
    """One request's line of the table."""

    rid: int
    kind: str
    prompt_tokens: int
    pages: int
    cached_tokens: int  # prefix-cache hit on decode (not transferred)
    bytes_by_component: dict[str, int]
    transfer_ms: float
    tokens: list[int]
    colocated: list[int]
    state_equal: bool
    problem: str

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_component.values())

    @property
    def gbps(self) -> float:
        return self.nbytes / (self.transfer_ms * 1e6) if self.transfer_ms > 0 else 0.0

    @property
    def ok(self) -> bool:
        return self.tokens == self.colocated and self.state_equal and not self.problem


@dataclass(frozen=True, slots=True)
class Outcome:
    """Every request's row, and the pools still holding ids after the run."""

    rows: list[Row]
    leaks: dict[str, int]  # e.g. {"decode pages": 3}; empty when every pool is free
    # per request id, per side, each phase in ms (from the trace; prefill: slowest rank)
    phases: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # per side, its metrics URL and the kvhandoff series it served after the run
    metrics: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows) and not any(self.leaks.values())


@dataclass(frozen=True, slots=True)
class Options:
    """The demo's settings (from the command line)."""

    model: str = DEFAULT_MODEL
    prefill_tp: int = 2
    decode_tp: int = 1
    transport: str = "auto"
    requests: int = 4
    max_new_tokens: int = 16
    chunk: int = 16
    corrupt: str | None = None
    session: dict[str, float] = field(default_factory=dict)  # SessionConfig overrides (flags)
    trace: str = ""  # where to keep the trace ("": $KVHANDOFF_TRACE, else a temporary file)
    metrics_port: int | None = None  # prefill serves its metrics here, decode on the next
    hold: float = 0.0  # seconds the workers stay up after the run


def run_demo(args: argparse.Namespace) -> int:
    """``kvhandoff demo``: 0 when every request matches its colocated run."""
    if getattr(args, "layout_only", False):
        from kvhandoff.lab.layout_demo import run_layout_demo

        return run_layout_demo(args)
    if args.list_models:
        print(list_models())
        return 0
    from kvhandoff.session.config import SessionConfig, timeout_overrides

    session = timeout_overrides(args)
    try:  # the workers inherit this environment: refuse a bad mix here, before starting them
        SessionConfig.from_env(**session)
    except ValueError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    opts = Options(model=args.model or DEFAULT_MODEL, prefill_tp=args.prefill_tp,
                   decode_tp=args.decode_tp, transport=args.transport, requests=args.requests,
                   max_new_tokens=args.max_new_tokens, chunk=args.chunk, corrupt=args.corrupt,
                   session=session, trace=args.trace or "",
                   metrics_port=args.metrics_port, hold=max(0.0, args.hold))
    t0 = time.perf_counter()
    print(header(opts), flush=True)
    try:
        out = run(opts, progress=lambda r: print(progress_line(r), flush=True))
    except DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 2
    print(render(out.rows, time.perf_counter() - t0, out.leaks))
    if out.phases:
        print(render_phases(out.phases))
    for side, (url, n) in out.metrics.items():
        print(f"{side} metrics at {url}: "
              + (f"{n} kvhandoff series ✓" if n > 0 else "did not answer ✗"))
    if opts.trace:
        print(f"trace: {opts.trace} (draw it with `kvhandoff trace {opts.trace}`)")
    if args.json:
        write_json(args.json, opts, out)
    return 0 if out.ok and all(n > 0 for _, n in out.metrics.values()) else 1


def list_models() -> str:
    """The named tiny architectures (``--model`` also takes a local checkpoint dir)."""
    from kvhandoff.lab.engine.models import ARCHITECTURES

    width = max(map(len, ARCHITECTURES))
    return "\n".join(f"{a.name:<{width}}  {a.about}" for a in ARCHITECTURES.values())


def run(opts: Options, progress: Callable[[Row], None] | None = None) -> Outcome:
    """Start the bootstrap server and both engine processes, hand every prompt off and
    return one :class:`Row` per request (in order, ``progress`` called as each ends) and
    both workers' pool leaks. The three share a throwaway deployment secret (a 0600 file
    in a temporary directory, gone afterwards), so the demo runs authenticated."""
    from kvhandoff.bootstrap.server import BootstrapServer
    from kvhandoff.secret import Secret, write_secret_file

    with tempfile.TemporaryDirectory(prefix="kvhandoff-demo-") as tmp:
        secret_file = write_secret_file(os.path.join(tmp, "secret"))
        trace = opts.trace or os.environ.get(TRACE_ENV) or os.path.join(tmp, "trace.jsonl")
        out = _run(opts, BootstrapServer(secret=Secret.load(secret_file)), secret_file,
                   trace, progress)
        if os.path.exists(trace):
            out = replace(out, phases=phases_by_request(read_trace(trace)))
        return out


def phases_by_request(lines: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Trace lines → request id → side → phase → ms; a side's ranks give their slowest."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for line in lines:
        if line["outcome"] != "success":
            continue
        side = out.setdefault(str(line["request"]), {}).setdefault(line["role"], {})
        for phase, s in line["phases"].items():
            side[phase] = max(side.get(phase, 0.0), 1e3 * float(s))
    return out


def _run(opts: Options, server: BootstrapServer, secret_file: str, trace: str,
         progress: Callable[[Row], None] | None) -> Outcome:
    with server as srv:
        port = opts.metrics_port
        spec = WorkerSpec(model=opts.model, tp=opts.prefill_tp, chunk=opts.chunk,
                          bootstrap_url=srv.url, transport=opts.transport,
                          requests=opts.requests, max_new_tokens=opts.max_new_tokens,
                          session=dict(opts.session), secret_file=secret_file, trace=trace,
                          metrics_port=-1 if port is None else port,
                          # the demo routes every request: it keys them (kvhandoff.binding)
                          router_secret=secrets.token_bytes(32))
        d_spec = replace(spec, tp=opts.decode_tp, corrupt=opts.corrupt,
                         metrics_port=-1 if port is None else port + 1 if port else 0)
        with _worker(prefill_main, spec) as (pre, ready), _worker(decode_main, d_spec) as (
                dec, d_ready):
            prompts = prompt_plan(opts.requests, ready.page_size, opts.chunk, ready.window,
                                  ready.vocab)
            rows = []
            for rid, (kind, tokens) in enumerate(prompts):
                row = _handoff(pre, dec, rid, kind, tokens)
                rows.append(row)
                if progress is not None:
                    progress(row)
            leaks = _leaks(pre, "prefill") | _leaks(dec, "decode")
            served = {side: scrape_count(url) for side, url in
                      (("prefill", ready.metrics), ("decode", d_ready.metrics)) if url}
            if opts.hold:
                print(f"holding the workers for {opts.hold:g} s: "
                      + ", ".join(f"{side} {url}" for side, url in
                                  (("prefill", ready.metrics), ("decode", d_ready.metrics))
                                  if url), flush=True)
                time.sleep(opts.hold)
            return Outcome(rows, leaks, metrics=served)


def scrape_count(url: str) -> tuple[str, int]:
    """``url`` and how many kvhandoff series it serves (-1: it did not answer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return url, -1
    return url, sum(1 for line in text.splitlines() if line.startswith("kvhandoff_"))


@contextmanager
def _worker(target: Callable[[Connection, WorkerSpec], None], spec: WorkerSpec
            ) -> Iterator[tuple[Connection, Ready]]:
    """A spawned engine process and its pipe, until it has started; stopped on exit."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, spec), daemon=True)
    proc.start()
    child.close()
    try:
        ready = _recv(parent, START_TIMEOUT_S, f"{target.__name__} start")
        if not isinstance(ready, Ready):
            raise DemoError(f"{target.__name__}: unexpected {ready!r}")
        yield parent, ready
    finally:
        with suppress(OSError):
            parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()


def _recv(conn: Connection, timeout: float, what: str) -> object:
    """The next message, raising :class:`DemoError` on a failure, a timeout or a dead
    worker."""
    try:
        if not conn.poll(timeout):
            raise DemoError(f"{what}: no answer in {timeout:.0f} s")
        msg = conn.recv()
    except (EOFError, OSError) as e:
        raise DemoError(f"{what}: worker exited ({type(e).__name__})") from e
    if isinstance(msg, Failed):
        raise DemoError(msg.error)
    return msg


def _handoff(pre: Connection, dec: Connection, rid: int, kind: str, tokens: list[int]) -> Row:
    """One request: decode admits, prefill runs and sends, decode finishes; compare."""
    dec.send(("admit", rid, tokens))
    if _recv(dec, REQUEST_TIMEOUT_S, f"decode admit {rid}") != "admitted":
        raise DemoError(f"decode admit {rid}: unexpected answer")
    pre.send((rid, tokens))
    dec.send(("finish", rid, tokens))
    p = _recv(pre, REQUEST_TIMEOUT_S, f"prefill {rid}")
    colocated = _recv(pre, REQUEST_TIMEOUT_S, f"colocated {rid}")
    d = _recv(dec, REQUEST_TIMEOUT_S, f"decode {rid}")
    if not (isinstance(p, Prefilled) and isinstance(d, Decoded) and isinstance(colocated, list)):
        raise DemoError(f"request {rid}: unexpected answers {p!r}, {d!r}")
    return Row(rid=rid, kind=kind, prompt_tokens=len(tokens), pages=d.pages,
               cached_tokens=d.prefix_len, bytes_by_component=d.bytes_by_component,
               transfer_ms=p.transfer_s * 1e3, tokens=d.tokens, colocated=colocated,
               state_equal=bool(d.digest) and d.digest == p.digest, problem=d.problem)


def _leaks(conn: Connection, side: str) -> dict[str, int]:
    """Ask a worker, after its last request, which of its pools still hold ids."""
    conn.send(LEAKS)
    ans = _recv(conn, REQUEST_TIMEOUT_S, f"{side} leak check")
    if not isinstance(ans, Leaks):
        raise DemoError(f"{side} leak check: unexpected answer {ans!r}")
    return ans.pools


# -- output -------------------------------------------------------------------------------
def header(opts: Options) -> str:
    return (f"kvhandoff demo — {opts.model}: prefill TP {opts.prefill_tp} → decode TP "
            f"{opts.decode_tp} over {opts.transport}, {opts.requests} requests, "
            f"chunk {opts.chunk}, {opts.max_new_tokens} new tokens each"
            + (f", corrupting {opts.corrupt!r}" if opts.corrupt else "")
            + ("".join(f", {k} {v:g} s" for k, v in opts.session.items())))


def progress_line(r: Row) -> str:
    return (f"  request {r.rid} ({r.kind}, {r.prompt_tokens} tokens): "
            f"{human_size(r.nbytes)} in {r.transfer_ms:.1f} ms, "
            + ("tokens equal ✓" if r.ok else f"MISMATCH ✗ {_why(r)}"))


def render(rows: list[Row], wall_s: float, leaks: dict[str, int] | None = None) -> str:
    """The results table, a verdict line and the pools check (``leaks``: ids still
    allocated per pool after the run)."""
    comps = sorted({c for r in rows for c in r.bytes_by_component},
                   key=lambda c: (c == "aux", c))
    head = (f"{'req':>3} {'kind':<11} {'tokens':>6} {'pages':>9} "
            + " ".join(f"{c:>9}" for c in comps)
            + f" {'total':>9} {'ms':>7} {'GB/s':>6}  equal")
    lines = [head, "-" * len(head)]
    for r in rows:
        pages = f"{r.pages}" + (f" ({r.cached_tokens}c)" if r.cached_tokens else "")
        lines.append(
            f"{r.rid:>3} {r.kind:<11} {r.prompt_tokens:>6} {pages:>9} "
            + " ".join(f"{human_size(r.bytes_by_component.get(c, 0)):>9}" for c in comps)
            + f" {human_size(r.nbytes):>9} {r.transfer_ms:>7.1f} {r.gbps:>6.3f}  "
            + ("✓" if r.ok else "✗"))
    bad = [r for r in rows if not r.ok]
    lines.append("(pages: KV pages on decode; Nc: tokens already in decode's prefix cache; "
                 "ms: prefill time in send + settle)")
    lines.append(f"{len(rows) - len(bad)}/{len(rows)} requests decode the same tokens as "
                 f"colocated with identical caches {'✓' if not bad else '✗'} "
                 f"({wall_s:.1f} s)")
    lines += [f"  request {r.rid}: {_why(r)}" for r in bad]
    lines.append(leak_line(leaks or {}))
    return "\n".join(lines)


def render_phases(phases: dict[str, dict[str, dict[str, float]]]) -> str:
    """Each request's phases in ms, from the request's own timeline on every rank (a
    side's slowest rank)."""
    from kvhandoff.observe.timeline import PHASES

    cols = [(role, p) for role in ("prefill", "decode") for p, _, _ in PHASES[role]]
    head = f"{'req':>3} " + " ".join(f"{role[0] + '.' + p:>{max(len(p), 7) + 2}}"
                                     for role, p in cols)
    lines = ["phases, ms (p.: prefill, its slowest rank; d.: decode):", head]
    for rid in sorted(phases, key=lambda r: (len(r), r)):
        sides = phases[rid]
        cells = [sides.get(role, {}).get(p) for role, p in cols]
        lines.append(f"{rid:>3} " + " ".join(
            f"  {'-' if v is None else f'{v:.2f}':>{max(len(p), 7)}}"
            for (_, p), v in zip(cols, cells, strict=True)))
    return "\n".join(lines)


def leak_line(leaks: dict[str, int]) -> str:
    """The pools verdict: every prefill and decode pool empty, or which are not."""
    if not any(leaks.values()):
        return "prefill and decode pools are empty after the run ✓"
    held = ", ".join(f"{pool} {n}" for pool, n in sorted(leaks.items()) if n)
    return f"LEAK ✗ pools still hold ids after the run: {held}"


def _why(r: Row) -> str:
    if r.problem:
        return r.problem
    if r.tokens != r.colocated:
        return f"tokens {r.tokens} vs colocated {r.colocated}"
    return "decode's cache differs from prefill's"


def write_json(path: str, opts: Options, out: Outcome) -> None:
    data = {"options": asdict(opts), "ok": out.ok, "leaks": out.leaks,
            "requests": [asdict(r) | {"ok": r.ok, "gbps": r.gbps} for r in out.rows]}
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
