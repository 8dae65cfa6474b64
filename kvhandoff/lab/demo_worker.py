"""The two engine processes of ``kvhandoff demo``: a prefill instance and a decode instance.

Each worker runs in its own (spawned) process, builds the model with
:func:`kvhandoff.lab.engine.run.prepare` (named tiny models use a fixed seed, so both
processes hold identical weights), registers its ranks with the session layer
(:class:`~kvhandoff.lab.engine.session_link.PrefillLink` /
:class:`~kvhandoff.lab.engine.session_link.DecodeLink` over a real transport) and then
serves requests from the parent over a pipe. The pipe carries control messages and
results only; every KV and state byte moves prefill → decode through the transport.
After the last request the parent asks each worker for its :class:`Leaks`: every page,
SWA page and slot must be free again (decode drops its prefix cache first).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from kvhandoff.session.config import SessionConfig, env_of

if TYPE_CHECKING:  # torch/transformers load in the workers only
    from kvhandoff.lab.engine.decode import DecodeInstance, Ticket
    from kvhandoff.lab.engine.instance import Instance
    from kvhandoff.lab.engine.pools import PoolConfig
    from kvhandoff.lab.engine.run import Prepared
    from kvhandoff.lab.engine.session_link import DecodeLink
    from kvhandoff.lab.engine.transfer import Chunk, PrefillTransfer

LEAKS = "leaks"
"""The parent's last question to a worker (answered with :class:`Leaks`)."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to start: the model, its TP size and the rendezvous."""

    model: str
    tp: int
    chunk: int
    bootstrap_url: str
    transport: str
    requests: int  # how many prompts :func:`prompt_plan` makes (sizes the pools)
    max_new_tokens: int = 16
    prefix_cache: bool = True
    corrupt: str | None = None  # decode only: flip one received byte of this component
    session: dict[str, float] = field(default_factory=dict)  # SessionConfig overrides
    secret_file: str = ""  # the deployment secret the demo made ("": none)
    router_secret: bytes | None = None  # what keys each request (the demo's, per run)
    trace: str = ""  # append each request's trace line here ("": as the environment says)
    metrics_port: int = -1  # serve this process's metrics here (0: any free port; -1: no)


def session_config(spec: WorkerSpec) -> SessionConfig:
    """The worker's session settings: ``spec.session`` (the demo's flags) and
    ``spec.secret_file`` over the ``KVHANDOFF_*`` environment over the defaults. The
    overrides are also put into this process's environment, since the links build their
    agents without an explicit config (each agent reads :meth:`SessionConfig.from_env`)."""
    overrides: dict[str, float | str] = dict(spec.session)
    if spec.secret_file:
        overrides["secret_file"] = spec.secret_file
    if spec.trace:
        overrides["trace"] = spec.trace
    if spec.metrics_port >= 0:
        overrides["metrics_port"] = spec.metrics_port
    cfg = SessionConfig.from_env(**overrides)  # raises, naming the problem, before any agent
    os.environ.update(env_of(overrides))
    if cfg.metrics_port >= 0:  # now, so Ready can say where (the agents reuse it)
        from kvhandoff.observe.report import serve_process_metrics

        serve_process_metrics(cfg.metrics_port, cfg.host)
    return cfg


@dataclass(frozen=True, slots=True)
class Ready:
    """A worker is up: what the parent needs to make the prompts."""

    name: str
    page_size: int
    window: int  # sliding window in tokens (0: none)
    vocab: int
    metrics: str = ""  # where this process serves its metrics ("": it does not)


@dataclass(frozen=True, slots=True)
class Prefilled:
    """Prefill's answer for one request."""

    rid: int
    first_token: int
    chunks: int
    transfer_s: float  # time prefill spent in send + settle (handing bytes to the transport)
    digest: dict[str, str]  # per tensor, a digest of the request's cache rows


@dataclass(frozen=True, slots=True)
class Decoded:
    """Decode's answer for one request."""

    rid: int
    tokens: list[int]
    prefix_len: int  # tokens decode already held (prefix-cache hit)
    pages: int  # KV pages the request occupies on decode
    bytes_by_component: dict[str, int]
    digest: dict[str, str]
    problem: str = ""


@dataclass(frozen=True, slots=True)
class Leaks:
    """A worker's pools after the run: ids still allocated, per named pool (e.g.
    ``"decode pages"``); empty when every page, SWA page and slot is free."""

    pools: dict[str, int]


@dataclass(frozen=True, slots=True)
class Failed:
    """A worker could not serve a request (or start): the reason."""

    error: str


@dataclass(slots=True)
class TimedLink:
    """A :class:`~kvhandoff.lab.engine.transfer.Transfer` wrapper that times ``send`` and
    ``settle``: how long prefill is blocked handing bytes to the transport."""

    inner: PrefillTransfer
    seconds: dict[int, float] = field(default_factory=dict)

    def start(self, rid: int, prefill_rank: int, num_pages: int, aux_row: int) -> int:
        return self.inner.start(rid, prefill_rank, num_pages, aux_row)

    def send(self, rid: int, prefill_rank: int, chunk: Chunk) -> None:
        self._timed(rid, self.inner.send, rid, prefill_rank, chunk)

    def settle(self, rid: int, prefill_rank: int) -> None:
        self._timed(rid, self.inner.settle, rid, prefill_rank)

    def _timed(self, rid: int, fn: Callable[..., None], *args: object) -> None:
        t0 = time.perf_counter()
        fn(*args)
        self.seconds[rid] = self.seconds.get(rid, 0.0) + time.perf_counter() - t0


def prompt_plan(requests: int, page_size: int, chunk: int, window: int, vocab: int,
                seed: int = 0) -> list[tuple[str, list[int]]]:
    """``requests`` seeded prompts, cycling through four kinds:

    * ``short``: one page and a token (a partial last page, a single chunk);
    * ``aligned``: whole pages and at least two chunks;
    * ``long``: several chunks, longer than the sliding window, a partial last page;
    * ``prefix hit``: the latest ``long`` prompt's first ``P`` tokens (``P`` whole pages
      and whole chunks, so the cached rows are bit-identical) and a new tail, long enough
      past ``P`` that the window still comes from prefill: decode already holds ``P``.

    Later rounds grow each length by a page (keeping its alignment)."""
    from kvhandoff.lab.engine.models import sample_prompts

    step = math.lcm(page_size, chunk)
    out: list[tuple[str, list[int]]] = []
    base: list[int] = []
    for i in range(requests):
        grow, kind = page_size * (i // 4), ("short", "aligned", "long", "prefix hit")[i % 4]
        lens = {"short": page_size + 1 + grow,
                "aligned": math.ceil(2 * chunk / page_size) * page_size + grow,
                "long": max(3 * chunk, window + 2 * page_size, step) + 3 + grow}
        if kind == "prefix hit" and base:
            p = len(base) // page_size * page_size // step * step
            tail = sample_prompts([window + page_size + 2 + grow], vocab=vocab,
                                  seed=seed + 1000 + i)[0]
            tokens = base[:p] + [(t + 1) % vocab for t in tail]
        else:
            kind = "long" if kind == "prefix hit" else kind
            tokens = sample_prompts([lens[kind]], vocab=vocab, seed=seed + i)[0]
        if kind == "long":
            base = tokens
        out.append((kind, tokens))
    return out


def _quiet_setup() -> None:
    """One thread per process (two processes share a small machine) and no fallback-kernel
    notices from transformers."""
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity(logging.ERROR)


def _prepare(spec: WorkerSpec) -> tuple[Prepared, PoolConfig]:
    """The model and pools sized for the demo's prompts."""
    from kvhandoff.lab.engine.pools import PoolConfig
    from kvhandoff.lab.engine.run import prepare

    prep = prepare(spec.model)
    ps, sps = prep.page_size, prep.swa_page_size
    prompts = [t for _, t in prompt_plan(spec.requests, *_shape(prep, spec.chunk))]
    total = sum(map(len, prompts))
    pages = 2 * sum(math.ceil(len(t) / ps) + 1 for t in prompts) + 8
    pools = PoolConfig(page_size=ps, num_pages=pages, num_slots=8, swa_page_size=sps,
                       num_swa_pages=2 * total // (sps or ps) + 16)
    return prep, pools


def _shape(prep: Prepared, chunk: int) -> tuple[int, int, int, int]:
    """``prompt_plan``'s model arguments: page size, chunk, window, vocabulary."""
    vocab = int(prep.model.config.get_text_config().vocab_size)
    return prep.page_size, chunk, prep.arch.window, vocab


def _ready(prep: Prepared, chunk: int) -> Ready:
    from kvhandoff.observe.report import metrics_url

    _, _, window, vocab = _shape(prep, chunk)
    return Ready(prep.name, prep.page_size, window, vocab, metrics_url() or "")


def pool_leaks(inst: Instance, side: str) -> Leaks:
    """``inst``'s pools that still hold ids, named ``"{side} {pool}"``."""
    return Leaks({f"{side} {k}": v for k, v in inst.tables.leaks().items() if v})


def prefill_main(conn: Connection, spec: WorkerSpec) -> None:
    """The prefill process: for each ``(rid, tokens)`` received, prefill in chunks, sending
    as it goes, and answer :class:`Prefilled`; then decode the prompt colocated (plain
    HF, same chunks, while decode decodes) and answer the token list. :data:`LEAKS` is
    answered with :class:`Leaks`; ``None`` ends it."""
    _quiet_setup()
    from kvhandoff.lab.engine.prefill import PrefillInstance
    from kvhandoff.lab.engine.run import colocated_greedy, snapshot_digest
    from kvhandoff.lab.engine.session_link import PrefillLink

    try:
        session_config(spec)
        prep, pools = _prepare(spec)
        inst = PrefillInstance(prep.model, prep.arch, tp=spec.tp, pools=pools, chunk=spec.chunk)
        session = PrefillLink(inst.ranks, spec.bootstrap_url, transport=spec.transport,
                              router_secret=spec.router_secret)
        link = TimedLink(session)
    except Exception as e:  # report, don't hang the parent
        conn.send(Failed(f"prefill start: {type(e).__name__}: {e}"))
        return
    conn.send(_ready(prep, spec.chunk))
    try:
        while (msg := conn.recv()) is not None:
            if msg == LEAKS:
                conn.send(pool_leaks(inst, "prefill"))
                continue
            rid, tokens = msg
            try:
                out = inst.run(rid, tokens, link)
                conn.send(Prefilled(rid, out.first_token, out.chunks_sent,
                                    link.seconds.pop(rid, 0.0), snapshot_digest(out.snapshot)))
                conn.send(colocated_greedy(prep.model, tokens, spec.max_new_tokens, spec.chunk))
            except Exception as e:
                conn.send(Failed(f"prefill request {rid}: {type(e).__name__}: {e}"))
    finally:
        session.close()


def decode_main(conn: Connection, spec: WorkerSpec) -> None:
    """The decode process: ``("admit", rid, tokens)`` preallocates and opens the transfer
    (answers ``"admitted"``); ``("finish", rid, tokens)`` waits for the bytes, decodes
    greedily and answers :class:`Decoded`; :data:`LEAKS` drops the prefix cache and
    answers :class:`Leaks`. ``None`` ends it."""
    _quiet_setup()
    from kvhandoff.lab.engine.decode import DecodeInstance
    from kvhandoff.lab.engine.session_link import DecodeLink

    try:
        session_config(spec)
        prep, pools = _prepare(spec)
        inst = DecodeInstance(prep.model, prep.arch, tp=spec.tp, pools=pools,
                              prefix_cache=spec.prefix_cache)
        link = DecodeLink(inst.ranks, spec.bootstrap_url, transport=spec.transport,
                          router_secret=spec.router_secret)
    except Exception as e:
        conn.send(Failed(f"decode start: {type(e).__name__}: {e}"))
        return
    conn.send(_ready(prep, spec.chunk))
    tickets: dict[int, Ticket] = {}
    try:
        while (msg := conn.recv()) is not None:
            if msg == LEAKS:
                inst.evict()
                conn.send(pool_leaks(inst, "decode"))
                continue
            kind, rid, tokens = msg
            try:
                if kind == "admit":
                    tickets[rid] = inst.admit(rid, tokens, link)
                    conn.send("admitted")
                else:
                    conn.send(_finish(inst, link, tickets.pop(rid), spec))
            except Exception as e:
                conn.send(Failed(f"decode request {rid}: {type(e).__name__}: {e}"))
    finally:
        link.close()


def _finish(inst: DecodeInstance, link: DecodeLink, ticket: Ticket, spec: WorkerSpec
            ) -> Decoded:
    """Wait for ``ticket``'s bytes on every decode rank and decode greedily."""
    from kvhandoff.lab.engine.run import snapshot_digest

    report = link.wait(ticket.rid)
    pages = len(ticket.req.pages)
    out = inst.finish(ticket.rid, spec.max_new_tokens, corrupt=spec.corrupt)
    problem = out.problem or ("" if out.replicas_agree else "TP replicas on decode disagree")
    return Decoded(rid=ticket.rid, tokens=out.tokens, prefix_len=ticket.prefix_len, pages=pages,
                   bytes_by_component=dict(report.bytes_by_component),
                   digest=snapshot_digest(out.snapshot), problem=problem)
